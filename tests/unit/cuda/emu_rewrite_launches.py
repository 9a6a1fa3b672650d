#!/usr/bin/env python3
"""emu_rewrite_launches.py: copies a .cu file for the host emulation of the CUDA backend
(host_backend_emu), with every kernel launch `kern<T, N><<<grid, block[, smem[, stream]]>>>(args);`
rewritten as `emu::launch_k(emu::cfg(grid, block, ...), kern<T, N>, args);` after an include of
the emulated runtime (cuda_rt_emu.h) and a #line naming the original, so diagnostics point at
the .cu file. Launches may span lines; line numbers are kept.
Usage: emu_rewrite_launches.py IN.cu OUT.cpp"""
import re
import sys


def match_back_angle(s, i):
    """s[i] == '>': index of the '<' that opens it (template arguments; a '<' or '>' inside
    parentheses there, as in (N > 2), is an operator, not a bracket)."""
    depth = 0
    parens = 0
    while i >= 0:
        c = s[i]
        if c == ')':
            parens += 1
        elif c == '(':
            parens -= 1
        elif parens == 0 and c == '>':
            depth += 1
        elif parens == 0 and c == '<':
            depth -= 1
            if depth == 0:
                return i
        i -= 1
    raise SystemExit("unbalanced '>' before a launch")


def callee_start(s, i):
    """s[:i] ends with the kernel expression (a name, maybe qualified, maybe with template
    arguments); the index where it starts."""
    j = i
    while j > 0 and s[j - 1].isspace():
        j -= 1
    while True:
        if j > 0 and s[j - 1] == '>':
            j = match_back_angle(s, j - 1)
            while j > 0 and s[j - 1].isspace():
                j -= 1
        k = j
        while k > 0 and (s[k - 1].isalnum() or s[k - 1] == '_'):
            k -= 1
        if k == j:
            raise SystemExit("no kernel name before '<<<' at offset %d" % i)
        j = k
        if j >= 2 and s[j - 2:j] == '::':
            j -= 2
            continue
        return j


def match_paren(s, i):
    """s[i] == '(': index just past its ')'."""
    depth = 0
    while i < len(s):
        if s[i] == '(':
            depth += 1
        elif s[i] == ')':
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise SystemExit("unbalanced '(' in a launch")


def rewrite(src):
    out = []
    pos = 0
    n = 0
    while True:
        i = src.find('<<<', pos)
        if i < 0:
            out.append(src[pos:])
            break
        start = callee_start(src, i)
        kernel = src[start:i].strip()
        j = src.find('>>>', i)
        if j < 0:
            raise SystemExit("'<<<' without '>>>'")
        cfg = src[i + 3:j]
        k = j + 3
        while src[k].isspace():
            k += 1
        if src[k] != '(':
            raise SystemExit("no argument list after '>>>' for %s" % kernel)
        end = match_paren(src, k)
        args = src[k + 1:end - 1]
        call = 'emu::launch_k(emu::cfg(%s), %s%s)' % (cfg, kernel, (', ' + args) if args.strip() else '')
        out.append(src[pos:start])
        out.append(call)
        pos = end
        n += 1
    return ''.join(out), n


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src = open(sys.argv[1]).read()
    text, n = rewrite(src)
    if '<<<' in text or '>>>' in text:
        raise SystemExit("%s: a launch was left unrewritten" % sys.argv[1])
    with open(sys.argv[2], 'w') as f:
        f.write('#include "cuda_rt_emu.h" /* %d launches rewritten */\n#line 1 "%s"\n' % (n, sys.argv[1]))
        f.write(text)


if __name__ == '__main__':
    main()
