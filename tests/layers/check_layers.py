#!/usr/bin/env python3
"""check_layers.py: every #include of every folder against docs/layers.txt (DESIGN.md section
2 as data), and no protobuf-c name (Kvfleet__, KVFLEET__) outside proto/. Prints each breach as
FILE:LINE: what, and a summary; exits 1 on any breach, 2 when the rules file is wrong.
Usage: check_layers.py REPO_ROOT"""
import fnmatch
import os
import re
import sys

SOURCES = (".c", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
PB_NAME = re.compile(r"\b(Kvfleet__|KVFLEET__)\w*")


def load_rules(path):
    """folder -> (project entries, third-party globs); plus the system header globs."""
    rules, system = {}, []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if ":" not in line:
                sys.exit(f"{path}:{n}: expected 'folder: entries | headers', got {line!r}")
            folder, rest = line.split(":", 1)
            folder = folder.strip()
            if folder == "system":
                system += rest.split()
                continue
            own, _, third = rest.partition("|")
            rules[folder] = (own.split(), third.split())
    return rules, system


def allowed_project(folder, own, header):
    """A quoted include: the folder's own headers, or a listed folder or header."""
    top = header.split("/", 1)[0] if "/" in header else None
    if top == folder:
        return True
    for e in own:
        if e == "*" or e == header or ("/" not in e and top == e):
            return True
    return False


def allowed_angle(third, system, header):
    return any(fnmatch.fnmatch(header, g) for g in list(third) + system)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    rules, system = load_rules(os.path.join(root, "docs", "layers.txt"))
    breaches, files, includes = [], 0, 0
    for folder in sorted(rules):
        own, third = rules[folder]
        base = os.path.join(root, folder)
        if not os.path.isdir(base):
            breaches.append(f"docs/layers.txt: folder {folder}/ does not exist")
            continue
        for dirpath, _, names in os.walk(base):
            for name in sorted(names):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                files += 1
                with open(path, encoding="utf-8", errors="replace") as f:
                    for n, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if m:
                            includes += 1
                            kind, header = m.groups()
                            if kind == '"':
                                # a quoted include without a folder is a file beside it
                                if "/" in header:
                                    ok = allowed_project(folder, own, header)
                                else:
                                    ok = "*" in own or os.path.exists(os.path.join(dirpath, header))
                            else:
                                ok = allowed_angle(third, system, header)
                            if not ok:
                                breaches.append(f"{rel}:{n}: {folder}/ may not include "
                                                f"{'<' if kind == '<' else chr(34)}{header}"
                                                f"{'>' if kind == '<' else chr(34)}")
                        if folder != "proto" and not folder.startswith("proto/"):
                            p = PB_NAME.search(line)
                            if p:
                                breaches.append(f"{rel}:{n}: protobuf-c name {p.group(0)} "
                                                f"outside proto/")
    for b in breaches:
        print(b)
    print(f"layers: {files} files, {includes} includes checked against docs/layers.txt: "
          f"{len(breaches)} breach{'es' if len(breaches) != 1 else ''}")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
