#!/usr/bin/env bash
# bench/llamacpp_side.sh: kvfleet's CPU engine beside llama.cpp on this machine, on the same
# random weights, F32 weights and F32 KV, greedy, the same thread counts (issue 26).
#
#   bench/llamacpp_side.sh KVFLEET LLAMA_BIN_DIR [ROUNDS] [PRESETS]
#
# KVFLEET is a kvfleet binary; LLAMA_BIN_DIR holds llama-bench and llama-batched-bench of a
# llama.cpp built outside this repository (e.g. cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF; that
# snapshot's llama-bench needs "f32" added to its --cache-type-k/-v names if it lacks it).
# Each preset is written once by `kvfleet gen-model --dtype f32 --seed 1` and converted to GGUF
# by bench/st2gguf.py (ours, stdlib Python); `kvfleet bench engine --seed 1 --weights f32`
# regenerates the same matrices. Rounds alternate the two engines; the table gives medians
# and kvfleet / llama.cpp:
#   decode  batch-1 decode tok/s (llama-bench tg32 | bench engine batch 1)
#   prefill 64-token prompt tok/s (llama-bench pp64 | bench engine batch-1 prefill)
#   b8, b32 aggregate decode tok/s of 8 / 32 sequences (llama-batched-bench S_TG, 64-token
#           prompts, 32 new tokens | bench engine batch 8 / 32)
set -euo pipefail
KVF=${1:?usage: llamacpp_side.sh KVFLEET LLAMA_BIN_DIR [ROUNDS] [PRESETS]}
LB=${2:?usage: llamacpp_side.sh KVFLEET LLAMA_BIN_DIR [ROUNDS] [PRESETS]}
ROUNDS=${3:-3}
PRESETS=${4:-small,medium}
HERE=$(cd "$(dirname "$0")" && pwd)
for b in llama-bench llama-batched-bench; do
    [[ -x $LB/$b ]] || { echo "llamacpp_side: $LB/$b is missing (build llama.cpp's $b)" >&2; exit 2; }
done
T=$(mktemp -d /tmp/kvf-llside-XXXXXX)
trap 'rm -rf "$T"' EXIT
NT=$(nproc)
THREADS="1"; [[ $NT -gt 1 ]] && THREADS="1,$NT"
OUT=$T/results # lines: engine preset metric threads value
: >"$OUT"

IFS=, read -ra PS <<<"$PRESETS"
for p in "${PS[@]}"; do
    echo "llamacpp_side: writing $p (f32, seed 1) and its GGUF" >&2
    "$KVF" gen-model --preset "$p" --dtype f32 --seed 1 --out "$T/$p" >/dev/null
    python3 "$HERE/st2gguf.py" "$T/$p" "$T/$p.gguf" 2>/dev/null
done

for r in $(seq "$ROUNDS"); do
    for p in "${PS[@]}"; do
        echo "llamacpp_side: round $r/$ROUNDS, $p: kvfleet bench engine" >&2
        "$KVF" bench engine --presets "$p" --weights f32 --seed 1 --batches 1,8,32 --prompt 64 \
            --decode 32 --decode-medium 32 --threads "$NT" 2>/dev/null |
            awk -v p="$p" '$1==p && $2=="f32" && $4 ~ /^[0-9]+$/ {
                if ($4==1) { print "kvfleet", p, "prefill", $3, $5; print "kvfleet", p, "decode", $3, $6 }
                else print "kvfleet", p, "b" $4, $3, $6 }' >>"$OUT"
        echo "llamacpp_side: round $r/$ROUNDS, $p: llama-bench" >&2
        "$LB/llama-bench" -m "$T/$p.gguf" -p 64 -n 32 -t "$THREADS" -ctk f32 -ctv f32 -r 1 -o jsonl 2>/dev/null |
            python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    m = "prefill" if d["n_prompt"] else "decode"
    print("llama.cpp", sys.argv[1], m, d["n_threads"], d["avg_ts"])' "$p" >>"$OUT"
        for t in ${THREADS//,/ }; do
            echo "llamacpp_side: round $r/$ROUNDS, $p: llama-batched-bench, $t thread(s)" >&2
            "$LB/llama-batched-bench" -m "$T/$p.gguf" -c 4096 -npp 64 -ntg 32 -npl 8,32 -ctk f32 -ctv f32 \
                -t "$t" --output-format jsonl 2>/dev/null | grep '^{' |
                python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    if "speed_tg" in d:
        print("llama.cpp", sys.argv[1], "b%d" % d["pl"], sys.argv[2], d["speed_tg"])' "$p" "$t" >>"$OUT"
        done
    done
done

echo
echo "kvfleet vs llama.cpp ($(basename "$LB")), $ROUNDS rounds, medians, tok/s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" <<'EOF'
import statistics, sys
vals = {}
for line in open(sys.argv[1]):
    eng, p, m, t, v = line.split()
    vals.setdefault((p, m, int(t)), {}).setdefault(eng, []).append(float(v))
print("%-8s %-8s %7s %12s %12s %7s" % ("preset", "what", "threads", "llama.cpp", "kvfleet", "ratio"))
order = {"decode": 0, "prefill": 1, "b8": 2, "b32": 3}
worst = None
for (p, m, t) in sorted(vals, key=lambda k: (k[0], order.get(k[1], 9), k[2])):
    e = vals[(p, m, t)]
    if "llama.cpp" not in e or "kvfleet" not in e:
        continue
    a, b = statistics.median(e["llama.cpp"]), statistics.median(e["kvfleet"])
    r = b / a if a > 0 else float("nan")
    worst = r if worst is None else min(worst, r)
    print("%-8s %-8s %7d %12.1f %12.1f %6.2fx" % (p, m, t, a, b, r))
print("\nllamacpp_side: min_ratio=%.2f (kvfleet / llama.cpp; the aim is >= 1.0, >= 2.0 for b32)" % (worst or float("nan")))
EOF
