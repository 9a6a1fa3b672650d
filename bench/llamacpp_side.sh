#!/usr/bin/env bash
# bench/llamacpp_side.sh: kvfleet's CPU engine beside llama.cpp on this machine, on the same
# random weights, F32 weights and F32 KV, greedy, the same thread counts (issue 26).
#
#   bench/llamacpp_side.sh KVFLEET LLAMA_BIN_DIR [ROUNDS] [PRESETS]
#
# PHASES=engine or PHASES=server runs only those rows (default both).
# KVFLEET is a kvfleet binary; LLAMA_BIN_DIR holds llama-bench and llama-batched-bench of a
# llama.cpp built outside this repository (e.g. cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF; that
# snapshot's llama-bench needs "f32" added to its --cache-type-k/-v names if it lacks it).
# Each preset is written once by `kvfleet gen-model --dtype f32 --seed 1` and converted to GGUF
# by bench/st2gguf.py (ours, stdlib Python); `kvfleet bench engine --seed 1 --weights f32`
# regenerates the same matrices. Rounds alternate the two engines; the table gives medians
# and kvfleet / llama.cpp:
#   decode  batch-1 decode tok/s, 32 tokens after a 64-token context (llama-bench tg32 -d 64 |
#           bench engine batch 1)
#   prefill 64-token prompt tok/s (llama-bench pp64 | bench engine batch-1 prefill)
#   b8, b32 aggregate decode tok/s of 8 / 32 sequences (llama-batched-bench S_TG, 64-token
#           prompts, 32 new tokens | bench engine batch 8 / 32)
#   server  8 streaming clients, 4 requests each (48 random words, 64 tokens), aggregate
#           streamed tok/s (bench/stream_clients.py against llama-server --parallel 8 | kvfleet
#           up with one colocated decode worker); only where LLAMA_BIN_DIR has llama-server
set -euo pipefail
# the machine-wide OPENBLAS_CORETYPE some hosts set would pin OpenBLAS below this CPU: kvfleet picks
# its own core at start (cli/main.c) as it does for a user who sets nothing
unset OPENBLAS_CORETYPE
KVF=${1:?usage: llamacpp_side.sh KVFLEET LLAMA_BIN_DIR [ROUNDS] [PRESETS]}
LB=${2:?usage: llamacpp_side.sh KVFLEET LLAMA_BIN_DIR [ROUNDS] [PRESETS]}
ROUNDS=${3:-3}
PRESETS=${4:-small,medium}
HERE=$(cd "$(dirname "$0")" && pwd)
SERVER=0
[[ -x $LB/llama-server ]] && SERVER=1
for b in llama-bench llama-batched-bench; do
    [[ -x $LB/$b ]] || { echo "llamacpp_side: $LB/$b is missing (build llama.cpp's $b)" >&2; exit 2; }
done
T=$(mktemp -d /tmp/kvf-llside-XXXXXX)
trap 'jobs -p | xargs -r kill 2>/dev/null; rm -rf "$T"' EXIT
NT=$(nproc)
THREADS="1"; [[ $NT -gt 1 ]] && THREADS="1,$NT"
OUT=$T/results # lines: engine preset metric threads value
: >"$OUT"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# waits for URL to answer 200 while PID lives (a server that dies or never answers is an error)
wait_http() {
    local end=$((SECONDS + 300))
    until curl -sf -o /dev/null "$1"; do
        kill -0 "$2" 2>/dev/null || { echo "llamacpp_side: $3 died before it answered $1" >&2; exit 1; }
        [[ $SECONDS -lt $end ]] || { echo "llamacpp_side: $3 did not answer $1 within 300 s" >&2; exit 1; }
        sleep 0.2
    done
}
# the clients against the server on port $1 (model $2), recorded as engine $3 with $4 threads
clients() {
    python3 "$HERE/stream_clients.py" "127.0.0.1:$1" "$2" --clients 8 --requests 4 --prompt 48 \
        --max-tokens 64 | tee -a "$T/clients.log" | awk -v e="$3" -v p="$2" -v t="$4" '{
            for (i = 1; i <= NF; i++) if ($i ~ /^tok_s=/) { sub("tok_s=", "", $i); print e, p, "server", t, $i } }' >>"$OUT"
}

IFS=, read -ra PS <<<"$PRESETS"
for p in "${PS[@]}"; do
    echo "llamacpp_side: writing $p (f32, seed 1) and its GGUF" >&2
    "$KVF" gen-model --preset "$p" --dtype f32 --seed 1 --out "$T/$p" >/dev/null
    python3 "$HERE/st2gguf.py" "$T/$p" "$T/$p.gguf" 2>/dev/null
done

for r in $(seq "$ROUNDS"); do
    for p in "${PS[@]}"; do
      if [[ ${PHASES:-engine,server} == *engine* ]]; then
        echo "llamacpp_side: round $r/$ROUNDS, $p: kvfleet bench engine" >&2
        "$KVF" bench engine --presets "$p" --weights f32 --seed 1 --batches 1,8,32 --prompt 64 \
            --decode 32 --decode-medium 32 --threads "$NT" 2>/dev/null |
            awk -v p="$p" '$1==p && $2=="f32" && $4 ~ /^[0-9]+$/ {
                if ($4==1) { print "kvfleet", p, "prefill", $3, $5; print "kvfleet", p, "decode", $3, $6 }
                else print "kvfleet", p, "b" $4, $3, $6 }' >>"$OUT"
        echo "llamacpp_side: round $r/$ROUNDS, $p: llama-bench" >&2
        # prefill from an empty context; decode 32 tokens after 64 in context (-d 64), as bench
        # engine decodes after its 64-token prompt
        { "$LB/llama-bench" -m "$T/$p.gguf" -p 64 -n 0 -t "$THREADS" -ctk f32 -ctv f32 -r 1 -o jsonl 2>/dev/null
          "$LB/llama-bench" -m "$T/$p.gguf" -p 0 -n 32 -d 64 -t "$THREADS" -ctk f32 -ctv f32 -r 1 -o jsonl 2>/dev/null; } |
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
      fi
        for t in ${THREADS//,/ }; do
            [[ $SERVER == 1 && ${PHASES:-engine,server} == *server* ]] || break
            echo "llamacpp_side: round $r/$ROUNDS, $p: 8 streaming clients, $t thread(s)" >&2
            port=$(free_port)
            "$LB/llama-server" -m "$T/$p.gguf" --host 127.0.0.1 --port "$port" -t "$t" -tb "$t" \
                --parallel 8 -c 2048 -ctk f32 -ctv f32 >"$T/llama-server.log" 2>&1 &
            spid=$!
            wait_http "http://127.0.0.1:$port/health" "$spid" "llama-server"
            clients "$port" "$p" "llama.cpp" "$t"
            kill "$spid"; wait "$spid" 2>/dev/null || true
            port=$(free_port)
            "$KVF" up --model "$T/$p" --prefill 0 --decode 1 --threads "$t" --port "$port" \
                --kv-memory=512M >"$T/up.log" 2>&1 &
            spid=$!
            wait_http "http://127.0.0.1:$port/ready" "$spid" "kvfleet up"
            clients "$port" "$p" "kvfleet" "$t"
            kill -INT "$spid"; wait "$spid" 2>/dev/null || true
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
order = {"decode": 0, "prefill": 1, "b8": 2, "b32": 3, "server": 4}
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
if [[ -s $T/clients.log ]]; then
    echo "server runs, in order (llama.cpp then kvfleet per thread count; tokens: max_tokens per request ended on its length):"
    cat "$T/clients.log"
fi
