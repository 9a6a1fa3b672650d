#!/usr/bin/env bash
# sim_tiers.sh: issue 22's tier goal: `kvfleet sim` (policy kv) on both full Mooncake traces with
# 8 workers, for pools of P trace blocks per worker (default 312.5 and 1250): pool-only P, P with
# a host tier of 4P, P with host 4P and disk 16P, and pool-only 5P (as much memory as pool + host).
# Prints hit rates (all, per tier), load max/mean and TTFT, then per trace and P the ratio
# hit(P + host 4P) / hit(pool 5P) (goal >= 0.95) and TTFT p50 of P + host 4P against pool-only P
# (goal: lower). Progress goes to stderr when it is a terminal.
# Usage: bench/sim_tiers.sh [kvfleet binary] [extra sim flags...]   (KVF_POOLS="312.5 1250")
set -euo pipefail
bin=${1:-${KVF_BIN:-build/kvfleet}}
shift || true
shared=${KVF_SHARED:-../shared}
pools=${KVF_POOLS:-312.5 1250}
py=/usr/bin/python3
results=$(mktemp)
trap 'rm -f "$results"' EXIT

for trace in conversation synthetic; do
  for p in $pools; do
    for setup in pool host4 host4-disk16 pool5; do
      case $setup in
        pool) flags=(--capacity-blocks "$p") ;;
        host4) flags=(--capacity-blocks "$p" --host-capacity-blocks "$($py -c "print($p * 4)")") ;;
        host4-disk16) flags=(--capacity-blocks "$p" --host-capacity-blocks "$($py -c "print($p * 4)")"
                             --disk-capacity-blocks "$($py -c "print($p * 16)")") ;;
        pool5) flags=(--capacity-blocks "$($py -c "print($p * 5)")") ;;
      esac
      [ -t 2 ] && printf '%s P=%s %s ...\n' "$trace" "$p" "$setup" >&2
      json=$("$bin" sim --trace "$shared/data/mooncake/${trace}_trace.jsonl" --workers 8 \
             "${flags[@]}" --json "$@")
      echo "$trace $p $setup $json" >> "$results"
    done
  done
done

$py - "$results" <<'PY'
import json, sys
rows = [l.split(" ", 3) for l in open(sys.argv[1])]
rows = [(t, p, s, json.loads(j)) for t, p, s, j in rows]
print(f"{'trace':<13}{'P':>7} {'setup':<13}{'hit_blk':>8}{'pool':>7}{'host':>7}{'disk':>7}"
      f"{'load':>7}{'ttft50':>8}{'ttft99':>8}{'wall_s':>7}")
for t, p, s, j in rows:
    print(f"{t:<13}{p:>7} {s:<13}{j['hit_rate_blocks']:>8.4f}{j['hit_rate_pool']:>7.4f}"
          f"{j['hit_rate_host']:>7.4f}{j['hit_rate_disk']:>7.4f}{j['load_max_over_mean']:>7.3f}"
          f"{j['ttft_p50_s']:>8.3f}{j['ttft_p99_s']:>8.3f}{j['wall_s']:>7.1f}")
print()
print("host tier 4P against pool 5P (hit ratio >= 0.95) and against pool-only P (TTFT p50 lower):")
by = {(t, p, s): j for t, p, s, j in rows}
ok = True
for t, p in sorted({(t, p) for t, p, _, _ in rows}, key=lambda k: (k[0], float(k[1]))):
    h, p5, p1 = by[(t, p, "host4")], by[(t, p, "pool5")], by[(t, p, "pool")]
    ratio = h["hit_rate_blocks"] / p5["hit_rate_blocks"]
    good = ratio >= 0.95 and h["ttft_p50_s"] < p1["ttft_p50_s"]
    ok &= good
    print(f"  {t:<13} P {p:>7}: hit ratio {ratio:.3f}  TTFT p50 {h['ttft_p50_s']:.3f} s vs "
          f"{p1['ttft_p50_s']:.3f} s pool-only ({h['ttft_p50_s'] / p1['ttft_p50_s']:.2f}x)  "
          f"{'ok' if good else 'MISSED'}")
print("all tier goals met" if ok else "some tier goals missed")
PY
