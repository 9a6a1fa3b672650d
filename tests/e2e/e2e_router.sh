#!/usr/bin/env bash
# e2e_router.sh: the router end to end with real processes on 127.0.0.1 (ephemeral ports):
# fixture greedy ids through the router in colocated and disaggregated mode and from
# `kvfleet generate`; 64 concurrent streams (read on stream wake-ups); a client that
# disconnects mid-stream (the decode pool returns to idle); a decode worker dead before the
# first token (retried elsewhere);
# `kvfleet up` serving and stopping cleanly. Every process is killed on exit.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"

# --- fixtures: colocated, disaggregated, and single-process generate -----------------------
for m in tiny-gqa-f32 tiny-mha-tied-f32 tiny-mqa-bf16 small-gqa-bf16-theta5e5; do
    M="$KVF_SHARED/fixtures/models/$m"
    start "colo-$m" decode --model "$M"; COLO=$ADDR; P1=$PID
    start "pre-$m" prefill --model "$M"; PRE=$ADDR; P2=$PID
    start "dec-$m" decode --model "$M" --local-prefill-max-tokens 0; DEC=$ADDR; P3=$PID
    start "rc-$m" router --model "$M" --port 0 --decode "$COLO"; RC=$ADDR; P4=$PID
    start "rd-$m" router --model "$M" --port 0 --decode "$DEC" --prefill "$PRE"; RD=$ADDR; P5=$PID
    wait_ready "http://$RC"; wait_ready "http://$RD"
    check_fixture "http://$RC" "$m" 0 || fail "$m colocated"
    pass "$m: greedy ids through the router, colocated"
    check_fixture "http://$RD" "$m" 1 || fail "$m disaggregated (streaming)"
    pass "$m: greedy ids through the router, disaggregated, streamed"
    # the first case with kvfleet generate
    read -r ids greedy < <($PY -c "import json,sys; c=json.load(open(sys.argv[1]))['cases'][0]; print(','.join(map(str,c['prompt'])), ','.join(map(str,c['greedy'])))" "$M/expected.json")
    out=$("$KVF_BIN" generate --model "$M" --prompt-ids "$ids" --max-tokens 24 --ignore-eos --json 2>/dev/null)
    got=$(json_get "$out" "','.join(map(str, j['output_ids']))")
    expect_eq "$m: kvfleet generate" "$got" "$greedy"
    if [ "$m" = tiny-gqa-f32 ]; then
        # 64 concurrent streams with mixed lengths through the disaggregated router
        $PY - "http://$RD" "$m" "$M/expected.json" <<'EOF' || fail "64 concurrent streams"
import json, sys, threading, urllib.request
url, model, path = sys.argv[1], sys.argv[2], sys.argv[3]
cases = json.load(open(path))["cases"]
ok = [False] * 64
def one(i):
    c = cases[i % len(cases)]
    n = 1 + (i * 7) % 24
    body = {"model": model, "prompt": c["prompt"], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    ids, done = [], False
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for ch in json.loads(line[6:])["choices"]:
                    ids += ch["token_ids"]
    ok[i] = done and ids == c["greedy"][:n]
ts = [threading.Thread(target=one, args=(i,)) for i in range(64)]
[t.start() for t in ts]
[t.join() for t in ts]
print(sum(ok), "of 64 correct")
sys.exit(0 if all(ok) else 1)
EOF
        pass "64 concurrent streaming requests, mixed lengths, all correct"
        # the router read those streams when they said they had something, not on a clock
        w=$(metric "$RD" 'kvfleet_router_loop_wakeups_total{cause="stream"}')
        [ "${w%.*}" -gt 0 ] 2>/dev/null || fail "the router streamed without a stream wake-up ('$w')"
        pass "the router's loop woke on stream messages ($w passes)"
        # a client that disconnects after the first event: the decode pool returns to idle
        dadmin=$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$TMP/dec-$m.out")
        $PY - "$RD" "$m" <<'EOF'
import json, socket, sys
host, port = sys.argv[1].rsplit(":", 1)
body = json.dumps({"model": sys.argv[2], "prompt": [1], "max_tokens": 250, "ignore_eos": True,
                   "stream": True}).encode()
s = socket.create_connection((host, int(port)))
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n" % len(body) + body)
buf = b""
while b"data: " not in buf:
    buf += s.recv(4096)
s.close()
EOF
        for _ in $(seq 100); do
            [ "$(metric "$dadmin" 'kvfleet_kv_used_blocks{role="decode"}')" = 0 ] && [ "$(metric "$RD" kvfleet_router_requests_in_flight)" = 0 ] && break
            sleep 0.1
        done
        expect_eq "disconnect: decode pool back to idle" "$(metric "$dadmin" 'kvfleet_kv_used_blocks{role="decode"}')" 0
        expect_eq "disconnect: router saw the client go" "$(metric "$RD" kvfleet_router_client_disconnects_total)" 1
        c=$(metric "$dadmin" 'kvfleet_decode_cancelled_total{role="decode"}')
        [ "${c%.*}" -ge 1 ] || fail "disconnect: the decode worker saw no cancel ($c)"
        pass "disconnect: the Generate call was cancelled on the decode worker"
    fi
    kill "$P1" "$P2" "$P3" "$P4" "$P5"
    wait "$P1" "$P2" "$P3" "$P4" "$P5" 2>/dev/null || true
done

# --- a decode worker dead before the first token: the router retries on the other ------------
M="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
start d-a decode --model "$M"; DA=$ADDR; PA=$PID
start d-b decode --model "$M"; DB=$ADDR
start r-retry router --model "$M" --port 0 --decode "$DA,$DB" --health-interval-ms 60000
RR=$ADDR
wait_ready "http://$RR"
for _ in $(seq 50); do [ "$(metric "$RR" 'kvfleet_router_healthy_workers{role="decode"}')" = 2 ] && break; sleep 0.1; done
kill -9 "$PA"; wait "$PA" 2>/dev/null || true
check_fixture "http://$RR" tiny-gqa-f32 0 || fail "requests after a decode worker died"
r=$(metric "$RR" kvfleet_router_retries_total)
[ "${r%.*}" -ge 1 ] || fail "no retry counted ($r)"
pass "decode worker killed: requests retried on the other ($r retries), all correct"

# --- kv policy: WatchKv events steer a shared prefix to the worker that holds it ---------------
start d-k1 decode --model "$M"; DK1=$ADDR
start d-k2 decode --model "$M"; DK2=$ADDR
start r-kv router --model "$M" --port 0 --decode "$DK1,$DK2" --policy kv
RK=$ADDR
wait_ready "http://$RK"
for _ in $(seq 50); do [ "$(metric "$RK" 'kvfleet_router_healthy_workers{role="decode"}')" = 2 ] && break; sleep 0.1; done
$PY - "http://$RK" "$M/expected.json" <<'EOF' || fail "kv policy requests"
import json, sys, time, urllib.request
url, path = sys.argv[1], sys.argv[2]
cases = {c["name"]: c for c in json.load(open(path))["cases"]}
for rid, name in [("kv-h1", "hundred"), ("kv-a", "shared-prefix-a"), ("kv-b", "shared-prefix-b"),
                  ("kv-h2", "hundred")]:
    c = cases[name]
    body = {"model": "tiny-gqa-f32", "prompt": c["prompt"], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "x-request-id": rid})
    j = json.load(urllib.request.urlopen(req, timeout=60))
    assert j["choices"][0]["token_ids"] == c["greedy"], name
    time.sleep(0.5)  # the STORED events reach the router
EOF
dest() { sed -n "s/.*req $1: .* -> decode \([^ ]*\) (\([0-9]*\) blocks.*/\1 \2/p" "$TMP/r-kv.err"; }
read -r a_w _ < <(dest kv-a); read -r b_w b_ov < <(dest kv-b)
read -r h1_w _ < <(dest kv-h1); read -r h2_w h2_ov < <(dest kv-h2)
expect_eq "kv policy: shared-prefix-b follows shared-prefix-a" "$b_w" "$a_w"
expect_eq "kv policy: 2 cached blocks seen for shared-prefix-b" "$b_ov" 2
expect_eq "kv policy: a repeated prompt returns to its worker" "$h2_w" "$h1_w"
expect_eq "kv policy: 6 cached blocks seen for the repeat" "$h2_ov" 6

# --- a restarted kv router rebuilds its index from the workers' snapshots before it is ready --
kill -9 "$PID"
start r-kv2 router --model "$M" --port 0 --decode "$DK1,$DK2" --policy kv
RK2=$ADDR
wait_ready "http://$RK2"
blocks=$(metric "$RK2" 'kvfleet_router_index_blocks{role="decode"}')
[ "${blocks%.*}" -ge 6 ] || fail "restarted router: index holds ${blocks:-nothing} blocks at ready"
pass "restarted router: ready with ${blocks%.*} blocks from the snapshots"
live=$(metric "$RK2" 'kvfleet_router_index_workers{role="decode",state="live"}')
expect_eq "restarted router: both decode workers live in the index" "$live" 2
$PY - "http://$RK2" "$M/expected.json" <<'EOF2' || fail "restarted router request"
import json, sys, urllib.request
url, path = sys.argv[1], sys.argv[2]
c = {c["name"]: c for c in json.load(open(path))["cases"]}["hundred"]
body = {"model": "tiny-gqa-f32", "prompt": c["prompt"], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json", "x-request-id": "kv-h3"})
assert json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["token_ids"] == c["greedy"]
EOF2
read -r h3_w h3_ov < <(sed -n "s/.*req kv-h3: .* -> decode \([^ ]*\) (\([0-9]*\) blocks.*/\1 \2/p" "$TMP/r-kv2.err")
expect_eq "restarted router: the repeat still goes to the worker holding it" "$h3_w" "$h1_w"
expect_eq "restarted router: 6 cached blocks seen for it" "$h3_ov" 6

# --- kvfleet up ----------------------------------------------------------------------------
"$KVF_BIN" up --model "$M" --prefill 1 --decode 1 --port 0 >"$TMP/up.out" 2>"$TMP/up.err" &
UP=$!
PIDS+=("$UP")
for _ in $(seq 300); do grep -q "serving" "$TMP/up.out" && break; sleep 0.1; done
URL=$(sed -n 's/.*at \(http:[^ ]*\).*/\1/p' "$TMP/up.out" | head -1)
[ -n "$URL" ] || { cat "$TMP/up.out" "$TMP/up.err" >&2; fail "kvfleet up never served"; }
wait_ready "$URL"
check_fixture "$URL" tiny-gqa-f32 0 || fail "kvfleet up: fixture"
pass "kvfleet up: serves the fixture's greedy ids"
kids=$(pgrep -P "$UP" | tr '\n' ' ')
[ -n "$kids" ] || fail "kvfleet up has no children"
kill -INT "$UP"
for _ in $(seq 100); do kill -0 "$UP" 2>/dev/null || break; sleep 0.1; done
kill -0 "$UP" 2>/dev/null && fail "kvfleet up still running 10 s after Ctrl-C"
wait "$UP" && rc=0 || rc=$?
expect_eq "kvfleet up: exit status after Ctrl-C" "$rc" 0
alive=0; for k in $kids; do kill -0 "$k" 2>/dev/null && alive=$((alive + 1)); done
expect_eq "kvfleet up: no child left ($kids)" "$alive" 0
# --- kvfleet up: a child that dies stops the fleet, saying which ------------------------------
"$KVF_BIN" up --model "$M" --prefill 0 --decode 2 --port 0 >"$TMP/up2.out" 2>"$TMP/up2.err" &
UP2=$!
PIDS+=("$UP2")
for _ in $(seq 300); do grep -q "serving" "$TMP/up2.out" && break; sleep 0.1; done
grep -q "serving" "$TMP/up2.out" || fail "kvfleet up (2 decode) never served"
victim=$(pgrep -P "$UP2" -f "kvfleet decode" | head -1)
[ -n "$victim" ] || victim=$(for p in $(pgrep -P "$UP2"); do grep -q decode "/proc/$p/cmdline" && echo "$p"; done | head -1)
[ -n "$victim" ] || fail "no decode child of kvfleet up found"
kids=$(pgrep -P "$UP2" | tr '\n' ' ')
kill -9 "$victim"
for _ in $(seq 150); do kill -0 "$UP2" 2>/dev/null || break; sleep 0.1; done
kill -0 "$UP2" 2>/dev/null && fail "kvfleet up still running 15 s after a worker died"
wait "$UP2" && rc=0 || rc=$?
expect_eq "kvfleet up: exit status after a worker died" "$rc" 1
expect_contains "kvfleet up: says which child died" "$(cat "$TMP/up2.err")" "was killed by signal 9; stopping the fleet"
alive=0; for k in $kids; do kill -0 "$k" 2>/dev/null && alive=$((alive + 1)); done
expect_eq "kvfleet up: no child left after a worker died ($kids)" "$alive" 0
finish
