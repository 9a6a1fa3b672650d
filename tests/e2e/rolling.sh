#!/usr/bin/env bash
# rolling.sh: rolling updates drop nothing (issue 20). Two routers share two decode workers under
# a steady load of streams sent the way a load balancer would (only to routers whose /ready is
# 200, polled every 100 ms). Every decode worker is restarted in turn with SIGTERM (it drains:
# Health says DRAINING, the routers send it nothing new, its streams finish, it exits 0) and
# started again on its address; then each router the same (/ready 503 at once, then the listener
# closes, its streams finish, exit 0). Zero client errors, every stream ends with [DONE]. Both
# routers keep their own KV index from WatchKv: after the restarts a prompt sent through one
# router is found cached on its worker when sent through the other.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
m=tiny-gqa-f32
M="$KVF_SHARED/fixtures/models/$m"
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
DRAIN="--drain-delay-ms 1000 --drain-timeout-ms 30000"

declare -A WPORT WPID WADMIN RPORT RPID
start_worker() { # start_worker I
    start "dec$1" decode --model "$M" --listen "127.0.0.1:${WPORT[$1]}" $DRAIN
    WPID[$1]=$PID; WADMIN[$1]=$ADMIN
}
start_router() { # start_router I
    start "rt$1" router --model "$M" --port "${RPORT[$1]}" --decode "127.0.0.1:${WPORT[0]},127.0.0.1:${WPORT[1]}" \
        --policy kv --health-interval-ms 200 $DRAIN
    RPID[$1]=$PID
}
# n_up I: decode workers router I counts as up (0 when it does not answer)
n_up() { curl -s "http://127.0.0.1:${RPORT[$1]}/ready" | sed -n 's/^ready: \([0-9]*\) decode.*/\1/p'; }
wait_up() { # wait_up I N: router I sees N decode workers within 30 s
    for _ in $(seq 300); do [ "$(n_up "$1")" = "$2" ] && return 0; sleep 0.1; done
    fail "router $1 never saw $2 decode workers"
}
# stop_gracefully NAME PID READY_URL: SIGTERM; its /ready turns 503 while it drains (within its
# 1 s drain delay), then it must exit 0 within 60 s
stop_gracefully() {
    kill -TERM "$2"
    local code=""
    for _ in $(seq 100); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "$3/ready")
        [ "$code" = 503 ] && break
        sleep 0.01
    done
    [ "$code" = 503 ] || fail "$1: /ready said '$code' after SIGTERM, not 503"
    for _ in $(seq 600); do kill -0 "$2" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$2" 2>/dev/null && fail "$1 still running 60 s after SIGTERM"
    local rc=0; wait "$2" || rc=$?
    [ "$rc" = 0 ] || { tail -5 "$TMP/$1.err" >&2; fail "$1 exited $rc after SIGTERM"; }
    grep -q "drained" "$TMP/$1.err" || { tail -5 "$TMP/$1.err" >&2; fail "$1 did not drain"; }
    pass "$1: SIGTERM drained and exited 0"
}

for i in 0 1; do WPORT[$i]=$(free_port); RPORT[$i]=$(free_port); done
for i in 0 1; do start_worker $i; done
for i in 0 1; do start_router $i; done
for i in 0 1; do wait_up $i 2; done

# --- the load: streams through the ready routers until $TMP/stop appears -------------------------
$PY - "$TMP" "$m" "${RPORT[0]}" "${RPORT[1]}" > "$TMP/load.out" 2>&1 <<'PYEOF' &
import json, os, random, socket, sys, threading, time, http.client
tmp, model, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]]
ready = {p: False for p in ports}
lock = threading.Lock()
res = {"ok": 0, "errors": [], "by_port": {str(p): 0 for p in ports}}
stop = os.path.join(tmp, "stop")

def poll():  # the load balancer's readiness checks
    while not os.path.exists(stop):
        for p in ports:
            try:
                c = http.client.HTTPConnection("127.0.0.1", p, timeout=2)
                c.request("GET", "/ready")
                ready[p] = c.getresponse().status == 200
                c.close()
            except OSError:
                ready[p] = False
        time.sleep(0.1)

def one(p, k):
    body = {"model": model, "prompt": [3 + (k * 7 + i) % 300 for i in range(40)], "max_tokens": 24,
            "ignore_eos": True, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", p, timeout=60)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    if r.status != 200:
        raise RuntimeError("HTTP %d: %s" % (r.status, data[:200]))
    events = [l[6:] for l in data.splitlines() if l.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        raise RuntimeError("stream did not end with [DONE]: %r" % data[-200:])
    chunks = [json.loads(e) for e in events[:-1]]
    if sum(len(c["choices"][0].get("token_ids") or []) or bool(c["choices"][0].get("text")) for c in chunks) < 1:
        raise RuntimeError("a stream with no token: %r" % data[-200:])

def client(t):
    k = t
    while not os.path.exists(stop):
        up = [p for p in ports if ready[p]]
        if not up:
            time.sleep(0.02)
            continue
        p = up[k % len(up)]
        k += 1
        try:
            one(p, k)
            with lock:
                res["ok"] += 1
                res["by_port"][str(p)] += 1
        except Exception as e:
            with lock:
                res["errors"].append("port %d: %s" % (p, e))

threads = [threading.Thread(target=poll)] + [threading.Thread(target=client, args=(t,)) for t in range(4)]
for th in threads:
    th.start()
open(os.path.join(tmp, "load.started"), "w").close()
for th in threads:
    th.join()
json.dump(res, open(os.path.join(tmp, "load.json"), "w"))
PYEOF
LOADPID=$!
PIDS+=("$LOADPID")
for _ in $(seq 300); do [ -e "$TMP/load.started" ] && break; sleep 0.1; done
# done_streams: answers the two routers have sent so far (the load is flowing while it grows)
done_streams() {
    local t=0 i v
    for i in 0 1; do
        v=$(metric "127.0.0.1:${RPORT[$i]}" 'kvfleet_router_responses_total{code="2xx"}')
        v=${v:-0}
        t=$((t + ${v%.*}))
    done
    echo "$t"
}
# wait_more N: N more streams answered than now (the load is flowing), within 60 s
wait_more() {
    local base; base=$(done_streams)
    for _ in $(seq 600); do [ "$(done_streams)" -ge $((base + $1)) ] && return 0; sleep 0.1; done
    fail "the load stalled"
}
wait_more 10

# --- decode workers, one at a time ---------------------------------------------------------------
for i in 0 1; do
    stop_gracefully "dec$i" "${WPID[$i]}" "http://${WADMIN[$i]}"
    start_worker $i
    wait_up 0 2; wait_up 1 2
    wait_more 10
done

# --- routers, one at a time ----------------------------------------------------------------------
for i in 0 1; do
    stop_gracefully "rt$i" "${RPID[$i]}" "http://127.0.0.1:${RPORT[$i]}"
    grep -q "listener closed" "$TMP/rt$i.err" || fail "rt$i never closed its listener"
    start_router $i
    wait_up $i 2
    wait_more 10
done

touch "$TMP/stop"
for _ in $(seq 900); do kill -0 "$LOADPID" 2>/dev/null || break; sleep 0.1; done
[ -s "$TMP/load.json" ] || { cat "$TMP/load.out" >&2; fail "the load generator left no result"; }
res=$(cat "$TMP/load.json")
echo "load: $res" | cut -c1-600
expect_eq "zero client errors through the rolling restarts" "$(json_get "$res" "len(j['errors'])")" 0
[ "$(json_get "$res" "j['ok']")" -ge 60 ] || fail "too few streams: $res"
pass "$(json_get "$res" "j['ok']") streams, every one ended with [DONE]"

# --- two routers, one index each: a prompt sent through one is found through the other ----------
for k in 1 2 3 4; do
    prompt=$($PY -c "print([5 + (i * 11 + $k * 13) % 290 for i in range(64)])")
    body="{\"model\":\"$m\",\"prompt\":$prompt,\"max_tokens\":1}"
    curl -s -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:${RPORT[0]}/v1/completions" >/dev/null
    c=""
    for _ in $(seq 100); do # the other router learns of the blocks through WatchKv
        out=$(curl -s -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:${RPORT[1]}/v1/completions")
        c=$(json_get "$out" "j['usage']['prompt_tokens_details']['cached_tokens']")
        [ "$c" -gt 0 ] && break
        sleep 0.1
    done
    [ "$c" -ge 48 ] || fail "prompt $k through the second router: cached_tokens $c (not sent to the worker holding it)"
done
pass "the second router sent each of 4 prompts to the worker holding its blocks"
finish
