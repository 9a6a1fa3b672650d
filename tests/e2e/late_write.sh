#!/usr/bin/env bash
# late_write.sh: a client cancels request A while the prefill worker is still computing it; the
# prefill worker then writes A's KV into the decode worker's blocks anyway (shared-memory puts
# cannot be recalled). Request B, served locally on the same decode worker at once, and C and D
# (B's prompt again, and B's prompt + its output: prefix-cache hits on B's blocks) after A's
# write has landed, must give exactly `kvfleet generate`'s tokens; the held-blocks gauge is
# above 0 while A's prefill runs, back to 0 after its answer, and the pool is whole again.
# Then E: a remote prefill that times out falls back locally and its hold ends by its deadline.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
M="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
DELAY_MS=${DELAY_MS:-3000} # the prefill worker sleeps this long before computing A

# sm: puts land straight in the decode pool (over tcp the receiver drops bytes it no longer
# expects, which would hide the bug); the decode pool is small, and hands out the blocks freed
# last first, so B takes A's blocks when nothing holds them
start pre prefill --model "$M" --xfer-transport sm --fault-delay-ms "$DELAY_MS"; PADMIN=$ADMIN; PRE=$ADDR
start dec decode --model "$M" --xfer-transport sm --kv-blocks 64 --prefill-timeout-ms 20000; DADMIN=$ADMIN; DEC=$ADDR
start rt router --model "$M" --port 0 --decode "$DEC" --prefill "$PRE"; RT=$ADDR
wait_ready "http://$RT"

# A: 160 prompt tokens (10 blocks, above --local-prefill-max-tokens: remote), streamed; the
# client goes away after 0.5 s, long before the prefill worker starts computing it
$PY - "$RT" <<'EOF' || fail "request A could not be sent"
import json, socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
body = json.dumps({"model": "tiny-gqa-f32", "prompt": [3 + (i * 7) % 300 for i in range(160)],
                   "max_tokens": 8, "ignore_eos": True, "stream": True}).encode()
s = socket.create_connection((host, int(port)))
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n" % len(body) + body)
time.sleep(0.5)
s.close()
EOF
for _ in $(seq 100); do
    c=$(metric "$DADMIN" 'kvfleet_decode_cancelled_total{role="decode"}')
    [ "${c%.*}" -ge 1 ] 2>/dev/null && break
    sleep 0.05
done
[ "${c%.*}" -ge 1 ] 2>/dev/null || fail "the decode worker never saw A cancelled ('$c')"
pass "A cancelled by its client while the prefill worker was still computing it"
held_during=$(metric "$DADMIN" 'kvfleet_decode_held_blocks{role="decode"}')
failed0=$(metric "$PADMIN" 'kvfleet_prefill_failed_total{role="prefill"}')
[ "${failed0%.*}" = 0 ] || fail "the prefill worker answered A before the checks could start ($failed0)"

# ask IDS MAX: greedy ids from the fleet (non-streamed); want IDS MAX: from kvfleet generate
ask() {
    $PY - "$RT" "$1" "$2" <<'EOF'
import json, sys, urllib.request
body = {"model": "tiny-gqa-f32", "prompt": [int(x) for x in sys.argv[2].split(",")], "max_tokens": int(sys.argv[3]),
        "temperature": 0, "ignore_eos": True}
req = urllib.request.Request("http://" + sys.argv[1] + "/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    print(",".join(map(str, json.load(r)["choices"][0]["token_ids"])))
EOF
}
want() {
    local out
    out=$(timeout 30 "$KVF_BIN" generate --model "$M" --prompt-ids "$1" --max-tokens "$2" --ignore-eos --json 2>/dev/null)
    json_get "$out" "','.join(map(str, j['output_ids']))"
}

# B: 20 tokens, prefilled locally; 48 new tokens fill its blocks (5 of them)
B=$($PY -c "print(','.join(str(5 + (i * 11) % 290) for i in range(20)))")
got_b=$(ask "$B" 48) || fail "request B failed"
want_b=$(want "$B" 48)
expect_eq "B (served at once, locally) equals kvfleet generate" "$got_b" "$want_b"

# wait for A's prefill to end: its write has landed (or been refused) and it answered
for _ in $(seq $(((DELAY_MS + 15000) / 100))); do
    f=$(metric "$PADMIN" 'kvfleet_prefill_failed_total{role="prefill"}')
    k=$(metric "$PADMIN" 'kvfleet_prefill_computed_tokens_total{role="prefill"}')
    [ "${f%.*}" -ge 1 ] 2>/dev/null && break
    [ "${k%.*}" -ge 1 ] 2>/dev/null && break
    sleep 0.1
done
[ "${f%.*}" -ge 1 ] 2>/dev/null || [ "${k%.*}" -ge 1 ] 2>/dev/null || fail "A's prefill never ended"
pass "A's prefill ended on the prefill worker (failed $f, computed tokens $k)"

# C: B's prompt again (one cached block of B's); D: B's prompt and output (four cached blocks)
got_c=$(ask "$B" 24) || fail "request C failed"
expect_eq "C (B's prompt, after A's late write) equals kvfleet generate" "$got_c" "$(want "$B" 24)"
D="$B,$got_b"
got_d=$(ask "$D" 16) || fail "request D failed"
expect_eq "D (B's prompt and output, after A's late write) equals kvfleet generate" "$got_d" "$(want "$D" 16)"

# the hold: blocks held while A's prefill ran, none once it answered, the pool whole again
[ "${held_during%.*}" -ge 10 ] 2>/dev/null || fail "A's 10 blocks were not held after the cancel ('$held_during')"
pass "A's blocks were held after the cancel ($held_during)"
for _ in $(seq 50); do
    [ "$(metric "$DADMIN" 'kvfleet_decode_held_blocks{role="decode"}')" = 0 ] &&
        [ "$(metric "$DADMIN" 'kvfleet_kv_used_blocks{role="decode"}')" = 0 ] && break
    sleep 0.1
done
expect_eq "held blocks back to 0" "$(metric "$DADMIN" 'kvfleet_decode_held_blocks{role="decode"}')" 0
expect_eq "decode pool whole again (no block in use)" "$(metric "$DADMIN" 'kvfleet_kv_used_blocks{role="decode"}')" 0
expect_eq "the hold ended by the prefill worker's answer" \
    "$(metric "$DADMIN" 'kvfleet_decode_holds_released_total{role="decode",by="answer"}')" 1
expect_eq "no hold ended by its deadline" \
    "$(metric "$DADMIN" 'kvfleet_decode_holds_released_total{role="decode",by="deadline"}')" 0
[ "$(grep -c "holding 10 blocks" "$TMP/dec.err")" = 1 ] || fail "no single INFO line for the hold in the decode log"
pass "the hold was logged once at INFO"

# E: the remote prefill times out (2 s, the prefill worker sleeps 5 s): decode falls back to a
# local prefill and holds the reserved blocks until the deadline plus 0.5 s, since no answer
# has come; the prefill worker's answer (deadline passed, nothing written) comes later
start pre2 prefill --model "$M" --xfer-transport sm --fault-delay-ms 5000; PRE2=$ADDR
start dec2 decode --model "$M" --xfer-transport sm --prefill-timeout-ms 2000 --late-write-grace-ms 500; DADMIN2=$ADMIN; DEC2=$ADDR
start rt2 router --model "$M" --port 0 --decode "$DEC2" --prefill "$PRE2"; RT=$ADDR
wait_ready "http://$RT"
E=$($PY -c "print(','.join(str(3 + (i * 7) % 300) for i in range(160)))")
got_e=$(ask "$E" 8) || fail "request E failed"
expect_eq "E (fallback after the timeout) equals kvfleet generate" "$got_e" "$(want "$E" 8)"
for _ in $(seq 50); do
    [ "$(metric "$DADMIN2" 'kvfleet_decode_holds_released_total{role="decode",by="deadline"}')" = 1 ] && break
    sleep 0.1
done
expect_eq "E's hold ended by its deadline" \
    "$(metric "$DADMIN2" 'kvfleet_decode_holds_released_total{role="decode",by="deadline"}')" 1
expect_eq "E: held blocks back to 0" "$(metric "$DADMIN2" 'kvfleet_decode_held_blocks{role="decode"}')" 0
for _ in $(seq 50); do
    [ "$(metric "$DADMIN2" 'kvfleet_kv_used_blocks{role="decode"}')" = 0 ] && break
    sleep 0.1
done
expect_eq "E: decode pool whole again" "$(metric "$DADMIN2" 'kvfleet_kv_used_blocks{role="decode"}')" 0
finish
