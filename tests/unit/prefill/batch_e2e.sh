#!/usr/bin/env bash
# batch_e2e.sh: a prefill worker batching concurrent RemotePrefill calls, with real processes on
# 127.0.0.1: N concurrent distinct prompts through a disaggregated fleet give exactly the tokens of
# `kvfleet generate`; the prefill worker ran more than one prompt in one forward step; its pool
# is back to free/cached afterwards; a call whose deadline passes while it is queued is answered
# with an error (decode falls back to a local prefill) and leaks no block; shutdown is clean; a
# pool too small for two prompts makes the second wait for blocks instead of failing; a prefill
# worker stopped with calls queued answers them all and exits holding no block.
source "$(dirname "$0")/../../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/../../e2e/fleet.sh"
# wait_metric ADMIN NAME WANT: polls (5 s) until the metric equals WANT; prints the last value
wait_metric() {
    local v
    for _ in $(seq 50); do
        v=$(metric "$1" "$2")
        [ "$v" = "$3" ] && break
        sleep 0.1
    done
    echo "$v"
}
# int VALUE: the integer part of a metric value ("" -> -1)
int() { local v=${1%.*}; echo "${v:--1}"; }

M="$KVF_SHARED/fixtures/models/small-gqa-bf16-theta5e5"

# field_ids FILE KEY I: entry I of KEY ("prompts" or "got") in a client's JSON, comma-separated
# ("" for a prompt left unanswered).
field_ids() {
    $PY -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))[sys.argv[2]][int(sys.argv[3])] or [])))" "$1" "$2" "$3"
}
# generate_ids IDS: the 8 tokens `kvfleet generate` gives for prompt IDS.
generate_ids() {
    "$KVF_BIN" generate --model "$M" --threads 1 --prompt-ids "$1" --max-tokens 8 --ignore-eos --json 2>/dev/null | $PY -c "import json,sys; print(','.join(map(str, json.load(sys.stdin)['output_ids'])))"
}
# count_bad FILE N: sets bad to how many of prompts 0..N-1 in FILE the fleet answered otherwise
# than `kvfleet generate` (each named on stderr).
count_bad() {
    local i ids want got
    bad=0
    for i in $(seq 0 $(($2 - 1))); do
        ids=$(field_ids "$1" prompts "$i")
        want=$(generate_ids "$ids")
        got=$(field_ids "$1" got "$i")
        [ "$got" = "$want" ] || { echo "prompt $i: fleet $got, generate $want" >&2; bad=$((bad + 1)); }
    done
}
W=(--model "$M" --threads 1 --log-level warn)
# (decode workers that must not fall back get a 60 s prefill timeout: a loaded machine is slow)
P='role="prefill"'

# --- N concurrent distinct prompts, disaggregated, against kvfleet generate --------------------
start pre prefill "${W[@]}"; PRE=$ADDR; PADM=$ADMIN; PPRE=$PID
start dec decode "${W[@]}" --local-prefill-max-tokens 0 --prefill-timeout-ms 60000; DEC=$ADDR; DADM=$ADMIN; PDEC=$PID
start rt router --model "$M" --port 0 --decode "$DEC" --prefill "$PRE"; RT=$ADDR; PRT=$PID
wait_ready "http://$RT"
N=12
$PY - "http://$RT" "$N" "$TMP/prompts.json" <<'PYEOF' || fail "$N concurrent requests through the router"
import json, random, sys, threading, urllib.request
url, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(7)
# distinct prompts (no shared first block), 20..300 tokens: several chunks' worth in one step
prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(20, 300))] for _ in range(n)]
got = [None] * n
barrier = threading.Barrier(n)
def one(i):
    body = {"model": "small-gqa-bf16-theta5e5", "prompt": prompts[i], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "x-request-id": f"batch-{i}"})
    barrier.wait()
    with urllib.request.urlopen(req, timeout=120) as r:
        got[i] = json.load(r)["choices"][0]["token_ids"]
ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
[t.start() for t in ts]
[t.join() for t in ts]
json.dump({"prompts": prompts, "got": got}, open(out, "w"))
sys.exit(0 if all(g is not None and len(g) == 8 for g in got) else 1)
PYEOF
pass "$N concurrent distinct prompts answered through the disaggregated fleet"
count_bad "$TMP/prompts.json" "$N"
expect_eq "every concurrent answer equals kvfleet generate" "$bad" 0
expect_eq "no prefill fell back to decode" "$(int "$(metric "$DADM" "kvfleet_decode_prefill_fallbacks_total{role=\"decode\"}")")" 0
r=$(int "$(metric "$PADM" "kvfleet_prefill_requests_total{$P}")")
[ "$r" -ge "$N" ] || fail "prefill saw $r RemotePrefill calls, want >= $N"
expect_eq "no RemotePrefill failed" "$(int "$(metric "$PADM" "kvfleet_prefill_failed_total{$P}")")" 0
mx=$(int "$(metric "$PADM" "kvfleet_prefill_step_seqs_max{$P}")")
steps=$(int "$(metric "$PADM" "kvfleet_prefill_steps_total{$P}")")
[ "$mx" -ge 2 ] || fail "the prefill worker never ran two prompts in one step (max $mx, $steps steps)"
pass "the prefill worker batched up to $mx prompts in one step ($steps steps for $r calls)"
# no leaked block: nothing held by a sequence, free + cached == total
expect_eq "prefill pool: no block held after the burst" "$(wait_metric "$PADM" "kvfleet_kv_used_blocks{$P}" 0)" 0
fr=$(int "$(metric "$PADM" "kvfleet_kv_free_blocks{$P}")"); ca=$(int "$(metric "$PADM" "kvfleet_kv_cached_blocks{$P}")")
to=$(int "$(metric "$PADM" "kvfleet_kv_total_blocks{$P}")")
expect_eq "prefill pool: free ($fr) + cached ($ca) == total" "$((fr + ca))" "$to"
[ "$ca" -gt 0 ] || fail "prefill kept no prompt block cached ($ca)"
expect_eq "decode pool: no block held after the burst" "$(wait_metric "$DADM" 'kvfleet_kv_used_blocks{role="decode"}' 0)" 0
h=$(curl -s "http://$PADM/health")
expect_contains "prefill load: nothing running or waiting" "$h" '"running":0,"waiting":0'
kill "$PRT"; wait "$PRT" 2>/dev/null || true
kill "$PDEC"; wait "$PDEC" 2>/dev/null || true
kill "$PPRE"; rc=0; wait "$PPRE" || rc=$?
expect_eq "prefill worker exits cleanly on SIGTERM" "$rc" 0

# --- a call whose deadline passes while it is queued ------------------------------------------
# The prefill worker sleeps 1 s on admitting each call (fault flag), blocking its loop. Call A
# (deadline 20 s) is admitted first; call B (deadline 300 ms, from a second decode worker) arrives
# 100 ms later and waits behind it: its deadline passes in the queue. B is refused, decode falls
# back to a local prefill, and both answers are still right.
start pre2 prefill "${W[@]}" --fault-delay-ms 1000; PRE2=$ADDR; PADM2=$ADMIN
start d1 decode "${W[@]}" --local-prefill-max-tokens 0 --prefill-timeout-ms 20000; D1=$ADDR; D1ADM=$ADMIN
start d2 decode "${W[@]}" --local-prefill-max-tokens 0 --prefill-timeout-ms 300; D2=$ADDR; D2ADM=$ADMIN
start r1 router --model "$M" --port 0 --decode "$D1" --prefill "$PRE2"; R1=$ADDR
start r2 router --model "$M" --port 0 --decode "$D2" --prefill "$PRE2"; R2=$ADDR
wait_ready "http://$R1"; wait_ready "http://$R2"
$PY - "http://$R1" "http://$R2" "$TMP/dl.json" <<'PYEOF' || fail "requests A and B"
import json, random, sys, threading, time, urllib.request
r1, r2, out = sys.argv[1], sys.argv[2], sys.argv[3]
rng = random.Random(11)
prompts = [[rng.randrange(3, 1000) for _ in range(60)] for _ in range(2)]
got = [None, None]
def one(i, url):
    body = {"model": "small-gqa-bf16-theta5e5", "prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "x-request-id": "dl-" + "AB"[i]})
    with urllib.request.urlopen(req, timeout=60) as r:
        got[i] = json.load(r)["choices"][0]["token_ids"]
a = threading.Thread(target=one, args=(0, r1)); a.start()
time.sleep(0.1)
b = threading.Thread(target=one, args=(1, r2)); b.start()
a.join(); b.join()
json.dump({"prompts": prompts, "got": got}, open(out, "w"))
sys.exit(0 if all(g is not None and len(g) == 8 for g in got) else 1)
PYEOF
for i in 0 1; do
    want=$(generate_ids "$(field_ids "$TMP/dl.json" prompts "$i")")
    got=$(field_ids "$TMP/dl.json" got "$i")
    expect_eq "deadline test: request $i equals kvfleet generate" "$got" "$want"
done
ex=0
for _ in $(seq 50); do
    ex=$(int "$(metric "$PADM2" "kvfleet_prefill_expired_queued_total{$P}")")
    [ "$ex" -ge 1 ] && break
    sleep 0.1
done
[ "$ex" -ge 1 ] || fail "no call expired while queued ($ex)"
pass "the short-deadline call expired while queued and was refused"
[ "$(int "$(metric "$D2ADM" 'kvfleet_decode_prefill_fallbacks_total{role="decode"}')")" -ge 1 ] || fail "decode 2 did not fall back"
expect_eq "the long-deadline call was prefilled remotely" "$(int "$(metric "$D1ADM" 'kvfleet_decode_remote_prefills_total{role="decode"}')")" 1
expect_eq "prefill pool: no block held after the expiry" "$(wait_metric "$PADM2" "kvfleet_kv_used_blocks{$P}" 0)" 0
fr=$(int "$(metric "$PADM2" "kvfleet_kv_free_blocks{$P}")"); ca=$(int "$(metric "$PADM2" "kvfleet_kv_cached_blocks{$P}")")
to=$(int "$(metric "$PADM2" "kvfleet_kv_total_blocks{$P}")")
expect_eq "prefill pool: free + cached == total after the expiry" "$((fr + ca))" "$to"
# --- a pool too small for two prompts at once: the second waits for blocks, it does not fail --
# 32 blocks (the least the model's 512 positions allow); each 300-token prompt takes 19.
start pre3 prefill "${W[@]}" --kv-blocks 32; PRE3=$ADDR; PADM3=$ADMIN
start d3 decode "${W[@]}" --local-prefill-max-tokens 0 --prefill-timeout-ms 60000; D3=$ADDR; D3ADM=$ADMIN
start r3 router --model "$M" --port 0 --decode "$D3" --prefill "$PRE3"; R3=$ADDR
wait_ready "http://$R3"
$PY - "http://$R3" "$TMP/full.json" <<'PYEOF' || fail "requests on a small prefill pool"
import json, random, sys, threading, urllib.request
url, out = sys.argv[1], sys.argv[2]
rng = random.Random(13)
prompts = [[rng.randrange(3, 1000) for _ in range(300)] for _ in range(4)]
got = [None] * 4
barrier = threading.Barrier(4)
def one(i):
    body = {"model": "small-gqa-bf16-theta5e5", "prompt": prompts[i], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "x-request-id": f"full-{i}"})
    barrier.wait()
    with urllib.request.urlopen(req, timeout=120) as r:
        got[i] = json.load(r)["choices"][0]["token_ids"]
ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
json.dump({"prompts": prompts, "got": got}, open(out, "w"))
sys.exit(0 if all(g is not None and len(g) == 8 for g in got) else 1)
PYEOF
count_bad "$TMP/full.json" 4
expect_eq "small pool: every answer equals kvfleet generate" "$bad" 0
expect_eq "small pool: no RemotePrefill failed (they waited for blocks)" "$(int "$(metric "$PADM3" "kvfleet_prefill_failed_total{$P}")")" 0
expect_eq "small pool: no prefill fell back to decode" "$(int "$(metric "$D3ADM" 'kvfleet_decode_prefill_fallbacks_total{role="decode"}')")" 0
expect_eq "small pool: one prompt at a time fitted" "$(int "$(metric "$PADM3" "kvfleet_prefill_step_seqs_max{$P}")")" 1
expect_eq "small pool: no block held afterwards" "$(wait_metric "$PADM3" "kvfleet_kv_used_blocks{$P}" 0)" 0
# --- shutdown with calls queued and admitted: every call answered, every block back ----------
# The prefill worker sleeps 1.5 s admitting each call and admits one at a time (--max-seqs 1),
# and SIGTERM comes once all four calls have arrived, so one call is being admitted and three
# wait (a fixed sleep before the signal let a loaded machine deliver all four at once, admit
# them all in one 6 s pass and leave none queued). It must exit 0 with no block held; decode
# prefills locally instead.
start pre4 prefill --model "$M" --threads 1 --log-level info --fault-delay-ms 1500 --max-seqs 1 --drain-delay-ms 0 --drain-timeout-ms 0 # SIGTERM stops at once
PRE4=$ADDR; PP4=$PID; PADM4=$ADMIN
start d4 decode "${W[@]}" --local-prefill-max-tokens 0 --prefill-timeout-ms 20000; D4=$ADDR; D4ADM=$ADMIN
start r4 router --model "$M" --port 0 --decode "$D4" --prefill "$PRE4"; R4=$ADDR
wait_ready "http://$R4"
$PY - "http://$R4" "$TMP/shut.json" <<'PYEOF' &
import json, random, sys, threading, urllib.request
url, out = sys.argv[1], sys.argv[2]
rng = random.Random(17)
prompts = [[rng.randrange(3, 1000) for _ in range(40 + 20 * i)] for i in range(4)]
got = [None] * 4
def one(i):
    body = {"model": "small-gqa-bf16-theta5e5", "prompt": prompts[i], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "x-request-id": f"shut-{i}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        got[i] = json.load(r)["choices"][0]["token_ids"]
ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
json.dump({"prompts": prompts, "got": got}, open(out, "w"))
PYEOF
CL=$!
expect_eq "prefill stopped mid-burst: all four calls arrived" "$(int "$(wait_metric "$PADM4" "kvfleet_prefill_requests_total{$P}" 4)")" 4
kill -TERM "$PP4"; rc=0; wait "$PP4" || rc=$?
expect_eq "prefill stopped mid-burst exits cleanly" "$rc" 0
expect_contains "prefill stopped mid-burst holds no block" "$(cat "$TMP/pre4.err")" "prefill: stopped; 0 of"
expect_contains "prefill stopped mid-burst answered its queued calls" "$(cat "$TMP/pre4.err")" "prefill: shutting down"
wait "$CL" || fail "requests while the prefill worker stopped"
count_bad "$TMP/shut.json" 4
expect_eq "prefill stopped mid-burst: every answer still equals kvfleet generate" "$bad" 0
finish
