#!/usr/bin/env python3
"""attn_ptx.py: how many instructions the decode attention kernels issue per KV position, read
from their PTX (no GPU needed). Compiles cuda/attn.cu to PTX for sm_90 with nvcc (about a minute),
finds the main loops of the SIMT partition kernel (attn_part_kernel: its K loop and its V loop)
and of the tensor-core kernel (attn_dec_kernel: one loop over groups of 16 positions), and
divides each loop body's instruction count by the K+V rows a warp covers per trip. Register
moves are left out (ptxas folds most of them away); the count is still PTX, not SASS, so read it
as a ratio between the kernels, not as issue slots. The SIMT kernel's count is for GQA 4 (four
query heads per CTA, Llama-3-8B's shape).

Usage: python3 bench/attn_ptx.py [--nvcc PATH] [--ptx FILE (skip the compile)]
Prints a table (head_dim x KV dtype) and ends with simt_over_mma_min=<smallest ratio>.
"""
import argparse
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {1: "f16", 2: "bf16", 3: "fp8-e4m3"}  # kvf_dtype values (common/dtype.h)


def compile_ptx(nvcc, out):
    cmd = [nvcc, "-O2", "-DNDEBUG", "-DKVF_HAVE_CUDA=1", "-D_GNU_SOURCE", "-I" + REPO,
           "-arch=sm_90", "--expt-relaxed-constexpr", "-std=c++17", "-ptx",
           os.path.join(REPO, "cuda", "attn.cu"), "-o", out]
    print("attn_ptx: " + " ".join(cmd), file=sys.stderr)
    t = time.time()
    p = subprocess.Popen(cmd)
    while p.poll() is None:
        time.sleep(5)
        print("attn_ptx: compiling, %d s" % (time.time() - t), file=sys.stderr)
    if p.returncode != 0:
        sys.exit("attn_ptx: nvcc failed (exit %d)" % p.returncode)


def entry(lines, pattern):
    """the lines of the first .entry whose name contains pattern"""
    for i, l in enumerate(lines):
        if l.startswith(".entry") and pattern in l:
            depth, seen = 0, False
            for j in range(i, len(lines)):
                depth += lines[j].count("{") - lines[j].count("}")
                seen = seen or "{" in lines[j]
                if seen and depth == 0:
                    return lines[i:j + 1]
    return None


def loops(body):
    """(instruction ops) of every loop (a backward branch), outermost last"""
    labels = {}
    for i, l in enumerate(body):
        m = re.match(r"^(\$L__\w+):", l)
        if m:
            labels[m.group(1)] = i
    out = []
    for i, l in enumerate(body):
        m = re.search(r"bra(\.uni)?\s+(\$L__\w+);", l)
        if m and labels.get(m.group(2), i) < i:
            ops = []
            for x in body[labels[m.group(2)]:i + 1]:
                x = x.strip().lstrip("{").strip()
                if not x or x.startswith(("//", "$L", ".", "}")):
                    continue
                t = x.split()
                op = (t[1] if t[0].startswith("@") else t[0]).split(".")[0]
                ops.append(op)
            out.append(ops)
    return out


def count(ops):
    return len(ops) - ops.count("mov")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvcc", default="/usr/local/cuda/bin/nvcc")
    ap.add_argument("--ptx", help="an existing PTX of cuda/attn.cu (skips the compile)")
    args = ap.parse_args()
    ptx = args.ptx or "/tmp/kvf-attn-%d.ptx" % os.getpid()
    if not args.ptx:
        compile_ptx(args.nvcc, ptx)
    lines = open(ptx).read().split("\n")
    if not args.ptx:
        os.unlink(ptx)

    print("PTX instructions (register moves left out) per KV position (one K row + one V row) "
          "per warp, decode attention kernels of cuda/attn.cu, sm_90\n")
    print("%8s %9s %10s %10s %10s %9s %11s" % ("head_dim", "dtype", "simt_K", "simt_V", "simt",
                                                "mma", "simt/mma"))
    ratios = []
    for hd in (64, 128):
        for dt, name in DTYPES.items():
            part = entry(lines, "attn_part_kernelILi%dEL9kvf_dtype%dELi4E" % (hd, dt))
            dec = entry(lines, "attn_dec_kernelILi%dEL9kvf_dtype%dE" % (hd, dt))
            if not part or not dec:
                sys.exit("attn_ptx: no kernels for head_dim %d %s in the PTX" % (hd, name))
            # the partition kernel: a row per HD/8 lanes, 4 rows in flight: per warp and trip
            # (32 / (HD/8)) * 4 rows; its K loop shuffles, its V loop does not
            rows = 32 // (hd // 8) * 4
            pl = [o for o in loops(part) if o.count("fma") >= 64]
            k = [o for o in pl if "shfl" in o]
            v = [o for o in pl if "shfl" not in o]
            d = [o for o in loops(dec) if "mma" in o]
            if not k or not v or len(d) != 1:
                sys.exit("attn_ptx: the loops of head_dim %d %s are not where this script "
                         "expects them (K %d, V %d, mma %d)" % (hd, name, len(k), len(v), len(d)))
            sk, sv, m = count(k[0]) / rows, count(v[0]) / rows, count(d[0]) / 16
            ratios.append((sk + sv) / m)
            print("%8d %9s %10.1f %10.1f %10.1f %9.1f %11.2f" % (hd, name, sk, sv, sk + sv, m,
                                                                  (sk + sv) / m))
    print("\nsimt_over_mma_min=%.2f" % min(ratios))


if __name__ == "__main__":
    main()
