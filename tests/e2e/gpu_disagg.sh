#!/usr/bin/env bash
# gpu_disagg.sh (label gpu): two worker processes on one GPU: `kvfleet prefill --device cuda`
# writes KV blocks straight into `kvfleet decode --device cuda`'s device pool over CUDA IPC, and
# the tokens streamed through the router equal colocated `generate --device cuda`, CPU generate
# and the fixture, up to the fixture margin rule. Exits 77 (skipped) when kvfleet has no GPU.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
START_S=60 # CUDA start-up
READY_S=30

# KVF_E2E_DEVICE=cpu runs the same script on the CPU over ucx (a host check of the script
# itself; the test proper is cuda). KVF_BIN may be kvfleet_emu (e2e_gpu_disagg_emu: the same
# kvfleet on the emulated CUDA runtime, IPC between the two workers included); KVF_E2E_STRICT=1
# then also requires the disaggregated tokens to equal generate --device cuda's at every step
# (the emulator is deterministic; cuBLAS on a GPU does not promise it across batch shapes) and
# decode to have fallen back to a local prefill for no prompt.
DEV=${KVF_E2E_DEVICE:-cuda}
POOL="KV pool in GPU memory, transport cuda_ipc"
[ "$DEV" = cpu ] && POOL="KV pool in host memory, transport ucx"
# KVF_E2E_XFER=nccl: both workers on --xfer-backend nccl (e2e_gpu_disagg_nccl_emu: the NCCL
# emulation inside kvfleet_emu; on GPUs NCCL wants two of them). Unset: the backend's default.
# KVF_E2E_KV_BLOCKS: both pools' blocks (default 64, every prompt in fresh blocks, so one
# contiguous run each); a few blocks make prompts reuse evicted ones, so a transfer spans several
# runs (the transports' gather and scatter paths).
KV_BLOCKS=${KVF_E2E_KV_BLOCKS:-64}
XFER=()
if [ -n "${KVF_E2E_XFER:-}" ]; then
    XFER=(--xfer-backend "$KVF_E2E_XFER")
    POOL="KV pool in GPU memory, transport $KVF_E2E_XFER"
fi

# --- a GPU first: generate --device cuda says why it cannot run (no device, no CUDA build) ---
M0="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
if [ "$DEV" = cuda ] && ! why=$(timeout 120 "$KVF_BIN" generate --model "$M0" --prompt-ids 1 --max-tokens 1 \
             --device cuda --json 2>&1 >/dev/null); then
    case "$why" in
    *"--device cuda: no CUDA device"* | *"--device cuda: this kvfleet was built without CUDA"*)
        echo "skipped: ${why#kvfleet: }"
        exit 77 ;;
    esac
    fail "generate --device cuda failed for another reason: $why"
fi

# metric ADMIN NAME: the value of the first sample of NAME (labels allowed).
metric() { { curl -s "http://$1/metrics" || true; } | awk -v n="$2" 'index($1, n) == 1 {print $2; exit}'; }

for m in tiny-gqa-f32 tiny-mha-tied-f32; do
    M="$KVF_SHARED/fixtures/models/$m"
    EXP="$M/expected.json"
    N_NEW=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['n_new'])" "$EXP")
    start "pre-$m" prefill --model "$M" --device "$DEV" --kv-blocks "$KV_BLOCKS" "${XFER[@]}"; PRE=$ADDR; PRE_ADMIN=$ADMIN
    start "dec-$m" decode --model "$M" --device "$DEV" --kv-blocks "$KV_BLOCKS" --local-prefill-max-tokens 0 "${XFER[@]}"
    DEC=$ADDR; DEC_ADMIN=$ADMIN
    grep -q "$POOL" "$TMP/pre-$m.err" || fail "$m: prefill did not log \"$POOL\": $(cat "$TMP/pre-$m.err")"
    grep -q "$POOL" "$TMP/dec-$m.err" || fail "$m: decode did not log \"$POOL\""
    pass "$m: both workers: $POOL"
    start "r-$m" router --model "$M" --port 0 --decode "$DEC" --prefill "$PRE"; R=$ADDR
    wait_ready "http://$R"

    # every case: streamed through the router (disaggregated), generate --device cuda, CPU generate
    n_cases=$($PY -c "import json,sys; print(len(json.load(open(sys.argv[1]))['cases']))" "$EXP")
    : >"$TMP/$m.ids"
    for i in $(seq 0 $((n_cases - 1))); do
        ids=$($PY -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['cases'][int(sys.argv[2])]['prompt'])))" "$EXP" "$i")
        gpu=$(timeout 120 "$KVF_BIN" generate --model "$M" --prompt-ids "$ids" --max-tokens "$N_NEW" \
                --ignore-eos --device "$DEV" --json 2>/dev/null) || fail "$m case $i: generate --device $DEV"
        cpu=$(timeout 120 "$KVF_BIN" generate --model "$M" --prompt-ids "$ids" --max-tokens "$N_NEW" \
                --ignore-eos --json 2>/dev/null) || fail "$m case $i: CPU generate"
        echo "$(json_get "$gpu" "','.join(map(str, j['output_ids']))") $(json_get "$cpu" "','.join(map(str, j['output_ids']))")" >>"$TMP/$m.ids"
    done
    $PY - "http://$R" "$m" "$EXP" "$TMP/$m.ids" <<'EOF' || fail "$m: tokens differ (above)"
# The margin rule (tests/unit/cuda/test_models.c): on the GPU the f32 fixture runs with bf16
# weights, so tokens must agree up to the first step whose fixture margin is within twice the
# bf16 tolerance (3e-2) of the case's largest first-step logit; later steps may differ.
import json, os, sys, urllib.request
url, model, path, ids_path = sys.argv[1:5]
exact = os.environ.get("KVF_E2E_STRICT") == "1"
exp = json.load(open(path))
gen = [tuple(l.split()) for l in open(ids_path)]
TOL_BF16 = 3e-2
bad = compared = 0
for ci, c in enumerate(exp["cases"]):
    body = {"model": model, "prompt": c["prompt"], "max_tokens": exp["n_new"], "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    streamed = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    streamed += ch["token_ids"]
    gpu = [int(x) for x in gen[ci][0].split(",")]
    cpu = [int(x) for x in gen[ci][1].split(",")]
    if len(streamed) != exp["n_new"]:
        print(f"{model} {c['name']}: streamed {len(streamed)} tokens, want {exp['n_new']}")
        bad += 1
        continue
    if cpu != c["greedy"]:  # f32 on the CPU: the fixture exactly
        print(f"{model} {c['name']}: CPU generate {cpu}, fixture {c['greedy']}")
        bad += 1
    scale = max(abs(x) for x in c["logits_first_step"])
    for i in range(exp["n_new"]):
        if c["margins"][i] <= 2 * TOL_BF16 * scale:
            break
        compared += 1
        if not (streamed[i] == gpu[i] == cpu[i] == c["greedy"][i]):
            print(f"{model} {c['name']}: step {i}: disaggregated {streamed[i]}, generate --device cuda "
                  f"{gpu[i]}, CPU {cpu[i]}, fixture {c['greedy'][i]} (margin {c['margins'][i]:.3g})")
            bad += 1
            break
    if streamed != gpu:  # same kernels, same shapes: expected equal, but not required past the rule
        print(f"{'' if exact else 'note: '}{model} {c['name']}: disaggregated and colocated GPU tokens "
              f"differ after step {next(i for i in range(len(gpu)) if streamed[i] != gpu[i])}")
        bad += exact
print(f"{model}: {compared} steps compared under the margin rule"
      + (f", all {len(exp['cases']) * exp['n_new']} equal to generate --device cuda" if exact and not bad else ""))
if compared == 0:
    print(f"{model}: no step had a margin large enough to compare")
    bad += 1
sys.exit(1 if bad else 0)
EOF
    pass "$m: disaggregated ($DEV) = generate --device $DEV = CPU = fixture (margin rule)"
    sent=$(metric "$PRE_ADMIN" kvfleet_prefill_kv_bytes_sent_total)
    awk -v v="${sent:-0}" 'BEGIN {exit !(v + 0 > 0)}' || fail "$m: the prefill worker sent no KV bytes ($sent)"
    pass "$m: prefill wrote $sent KV bytes into decode's pool"
    if [ "${KVF_E2E_STRICT:-}" = 1 ]; then
        remote=$(metric "$DEC_ADMIN" kvfleet_decode_remote_prefills_total)
        fellback=$(metric "$DEC_ADMIN" kvfleet_decode_prefill_fallbacks_total)
        [ "${fellback:-x}" = 0 ] && awk -v v="${remote:-0}" 'BEGIN {exit !(v + 0 > 0)}' ||
            fail "$m: decode prefilled remotely ${remote:-?} times and fell back to a local prefill ${fellback:-?} times (want > 0 and 0)"
        pass "$m: decode took every prompt's KV from the prefill worker ($remote remote prefills, no fallback)"
    fi
    if [ "$DEV" = cuda ]; then # the GPU gauges (read every 500 ms or so): memory in use, graphs replayed
        for _ in $(seq 1 30); do
            used=$(metric "$DEC_ADMIN" kvfleet_gpu_memory_used_bytes)
            replays=$(metric "$DEC_ADMIN" kvfleet_cuda_graph_replays_total)
            awk -v u="${used:-0}" -v r="${replays:-0}" 'BEGIN {exit !(u + 0 > 0 && r + 0 > 0)}' && break
            sleep 0.2
        done
        awk -v u="${used:-0}" -v r="${replays:-0}" 'BEGIN {exit !(u + 0 > 0 && r + 0 > 0)}' ||
            fail "$m: decode's /metrics: kvfleet_gpu_memory_used_bytes ${used:-absent}, kvfleet_cuda_graph_replays_total ${replays:-absent} (want both > 0)"
        pass "$m: decode's /metrics: $used bytes of GPU memory in use, $replays decode steps replayed from CUDA graphs"
    fi
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
done
finish
