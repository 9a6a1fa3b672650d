#!/usr/bin/env bash
# sim_mooncake.sh: the router's done-when table: `kvfleet sim` on both Mooncake traces and on the
# skewed synthetic trace (`--synth zipf`: a Zipf choice among 8 long shared prefixes) with 8
# workers at a total cache of 2,500, 10,000 and 40,000 trace blocks (512 tokens), for fleet-lru
# (one shared LRU: the reference), kv, kv without its bounded-load rule (kv-unbounded), kv in
# approximate mode, round-robin, least-loaded and sticky. Prints hit rates, load max/mean and
# TTFT, then kv / fleet-lru per row and whether kv meets its targets (block hit rate >= 0.95 x
# fleet-lru, load max/mean <= 1.2).
# Usage: bench/sim_mooncake.sh [kvfleet binary] [extra sim flags...]
set -euo pipefail
bin=${1:-${KVF_BIN:-build/kvfleet}}
shift || true
shared=${KVF_SHARED:-../shared}
workers=8
py=/usr/bin/python3
results=$(mktemp)
trap 'rm -f "$results"' EXIT

for trace in conversation synthetic zipf; do
  src=(--trace "$shared/data/mooncake/${trace}_trace.jsonl")
  [ "$trace" = zipf ] && src=(--synth zipf)
  for total in 2500 10000 40000; do
    cap=$($py -c "print($total / $workers)")
    for policy in fleet-lru kv kv-unbounded kv-approx round-robin least-loaded sticky; do
      flags=(--policy "$policy")
      [ "$policy" = kv-approx ] && flags=(--policy kv --approx)
      [ "$policy" = kv-unbounded ] && flags=(--policy kv --load-bound 0)
      [ -t 2 ] && printf '%s total %s %s ...\n' "$trace" "$total" "$policy" >&2
      json=$("$bin" sim "${src[@]}" --workers $workers \
             --capacity-blocks "$cap" "${flags[@]}" --json "$@")
      echo "$trace $total $policy $json" >> "$results"
    done
  done
done

$py - "$results" <<'PY'
import json, sys
rows = []
for line in open(sys.argv[1]):
    trace, total, policy, js = line.split(" ", 3)
    rows.append((trace, int(total), policy, json.loads(js)))
print(f"{'trace':<13}{'total':>7} {'policy':<13}{'hit_blk':>8}{'hit_tok':>8}{'hit_512':>8}"
      f"{'load':>7}{'ttft50':>8}{'ttft99':>8}{'vs_fleet':>9}")
ok = True
ref = {}
for trace, total, policy, j in rows:
    if policy == "fleet-lru":
        ref[(trace, total)] = j["hit_rate_blocks"]
    r = j["hit_rate_blocks"] / ref[(trace, total)] if ref.get((trace, total)) else float("nan")
    print(f"{trace:<13}{total:>7} {policy:<13}{j['hit_rate_blocks']:>8.4f}{j['hit_rate_tokens']:>8.4f}"
          f"{j['hit_rate_trace_blocks']:>8.4f}{j['load_max_over_mean']:>7.3f}{j['ttft_p50_s']:>8.3f}"
          f"{j['ttft_p99_s']:>8.3f}{r:>9.3f}")
print()
print("kv policy against the targets (hit rate >= 0.95 x fleet-lru, load max/mean <= 1.2);")
print("kv-unbounded (the bounded-load rule off) for comparison, not a target:")
for trace, total, policy, j in rows:
    if policy not in ("kv", "kv-unbounded"):
        continue
    r = j["hit_rate_blocks"] / ref[(trace, total)]
    good = r >= 0.95 and j["load_max_over_mean"] <= 1.2
    if policy == "kv":
        ok &= good
    print(f"  {trace:<13} total {total:>6} {policy:<13}: ratio {r:.3f}  load {j['load_max_over_mean']:.3f}  "
          f"{'ok' if good else 'MISSED'}")
print("all targets met" if ok else "some targets missed")
PY
