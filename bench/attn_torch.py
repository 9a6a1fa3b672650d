#!/usr/bin/env python3
"""attn_torch.py: the baseline for `kvfleet bench attn`: the same decode shapes (one query token
per sequence, batch x context) through PyTorch's scaled_dot_product_attention on contiguous K/V
(bf16 by default), timed the same way (CUDA events, L2 flushed before every call), beside the
same device-to-device copy, printing the same table columns. Run on the GPU machine:
    python3 bench/attn_torch.py [--quick]
It needs PyTorch with CUDA; without a GPU it says so and exits 1."""
import argparse
import sys


def parse_list(s):
    return [int(x) for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 1,16,64 x context 1k,4k,16k")
    ap.add_argument("--batches", help="comma-separated batch sizes (default 1,2,...,256)")
    ap.add_argument("--contexts", help="comma-separated contexts (default 512,...,32768)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--max-kv-gib", type=float, default=24.0,
                    help="skip cases whose K+V is larger (the kvfleet bench's --max-kv)")
    ap.add_argument("--copy-max-gib", type=float, default=2.0)
    ap.add_argument("--no-l2-flush", action="store_true")
    ap.add_argument("--flush-mib", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=0.1, help="GPU time per case and side")
    ap.add_argument("--max-iters", type=int, default=200)
    a = ap.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"attn_torch.py: PyTorch is not installed ({e})", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("attn_torch.py: needs a GPU and torch.cuda.is_available() is false; nothing was "
              "measured", file=sys.stderr)
        return 1

    batches = parse_list(a.batches) if a.batches else (
        [1, 16, 64] if a.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256])
    ctxs = parse_list(a.contexts) if a.contexts else (
        [1024, 4096, 16384] if a.quick else [512, 1024, 2048, 4096, 8192, 16384, 32768])
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    es = torch.tensor([], dtype=dt).element_size()
    group = a.heads // a.kv_heads
    dev = torch.device("cuda")
    flush = None if a.no_l2_flush else torch.empty(a.flush_mib << 20, dtype=torch.uint8, device=dev)
    copy_max = int(a.copy_max_gib * (1 << 30)) // 256 * 256
    src = torch.empty(copy_max, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)

    # enable_gqa (PyTorch >= 2.5) reads each KV head once for its query heads; older versions
    # get K/V expanded to the query heads before timing (more bytes read than counted).
    try:
        F.scaled_dot_product_attention(
            torch.zeros(1, a.heads, 1, a.head_dim, dtype=dt, device=dev),
            torch.zeros(1, a.kv_heads, 8, a.head_dim, dtype=dt, device=dev),
            torch.zeros(1, a.kv_heads, 8, a.head_dim, dtype=dt, device=dev), enable_gqa=True)
        gqa = True
    except TypeError:
        gqa = False

    def timed(fn, iters):
        if flush is None:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                fn()
            e1.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1) / iters
        total = 0.0
        for i in range(iters):
            flush.fill_(i & 0xFF)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            total += e0.elapsed_time(e1)
        return total / iters

    def iters_for(fn):
        fn()  # warm-up: kernel selection, lazy initialisation
        torch.cuda.synchronize()
        est = timed(fn, 2)
        return int(min(a.max_iters, max(3, a.seconds * 1e3 / max(est, 1e-3))))

    name = torch.cuda.get_device_name(0)
    rows = []
    n_cases = len(batches) * len(ctxs)
    k = 0
    for b in batches:
        for c in ctxs:
            k += 1
            kv_bytes = 2 * b * c * a.kv_heads * a.head_dim * es
            if kv_bytes > a.max_kv_gib * (1 << 30):
                rows.append((b, c, kv_bytes, None, None))
                print(f"attn_torch: [{k}/{n_cases}] batch {b} ctx {c}: skipped", file=sys.stderr)
                continue
            q = torch.randn(b, a.heads, 1, a.head_dim, dtype=dt, device=dev)
            kk = torch.randn(b, a.kv_heads, c, a.head_dim, dtype=dt, device=dev)
            vv = torch.randn(b, a.kv_heads, c, a.head_dim, dtype=dt, device=dev)
            if gqa:
                def fn():
                    return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
            else:
                ke = kk.repeat_interleave(group, dim=1)
                ve = vv.repeat_interleave(group, dim=1)

                def fn():
                    return F.scaled_dot_product_attention(q, ke, ve)
            attn_ms = timed(fn, iters_for(fn))
            cb = min(kv_bytes, copy_max) // 256 * 256

            def cp():
                dst[:cb].copy_(src[:cb])
            copy_ms = timed(cp, iters_for(cp))
            rows.append((b, c, kv_bytes, attn_ms, (cb, copy_ms)))
            print(f"attn_torch: [{k}/{n_cases}] batch {b} ctx {c}: {attn_ms * 1e3:.1f} us",
                  file=sys.stderr)
            del q, kk, vv, fn
            if not gqa:
                del ke, ve
            torch.cuda.empty_cache()

    print(f"device: {name}")
    print(f"shape: {a.heads} query heads, {a.kv_heads} KV heads x {a.head_dim}, {a.dtype} KV, "
          f"contiguous [batch][kv_head][ctx][head_dim]; PyTorch {torch.__version__} "
          f"scaled_dot_product_attention ({'enable_gqa' if gqa else 'K/V expanded to the query heads'}); "
          f"L2 {'not flushed' if flush is None else 'flushed'} before every call")
    print("attn_GB/s = K+V bytes read / time; copy_GB/s = (read + written) / time of a "
          "device-to-device copy of min(KV bytes, --copy-max-gib)\n")
    print(f"{'batch':>7} {'ctx':>7} {'kv_MiB':>10} {'attn_us':>10} {'attn_GB/s':>10} "
          f"{'copy_GB/s':>10} {'ratio':>7}")
    min_r = min_all = None
    for b, c, kv_bytes, attn_ms, cpy in rows:
        if attn_ms is None:
            print(f"{b:>7} {c:>7} {kv_bytes / 2**20:>10.0f} {'skipped':>10} {'-':>10} {'-':>10} {'-':>7}")
            continue
        cb, copy_ms = cpy
        abw = kv_bytes / (attn_ms * 1e-3) / 1e9
        cbw = 2 * cb / (copy_ms * 1e-3) / 1e9
        r = abw / cbw
        print(f"{b:>7} {c:>7} {kv_bytes / 2**20:>10.1f} {attn_ms * 1e3:>10.1f} {abw:>10.0f} "
              f"{cbw:>10.0f} {r:>7.3f}")
        min_all = r if min_all is None else min(min_all, r)
        if c >= 4096:
            min_r = r if min_r is None else min(min_r, r)
    print(f"\nratio_vs_d2d_copy_min={min_all:.3f}" if min_all is not None else "\nratio_vs_d2d_copy_min=n/a")
    print(f"ratio_vs_d2d_copy_min_ctx4k={min_r:.3f}" if min_r is not None
          else "ratio_vs_d2d_copy_min_ctx4k=n/a (no context >= 4096 measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
