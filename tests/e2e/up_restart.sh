#!/usr/bin/env bash
# up_restart.sh: `kvfleet up --restart on-failure`: a decode worker killed with SIGKILL is started
# again on the gRPC port the router knows, the router sends it requests again, and so for the
# router itself; SIGTERM to up then stops the fleet with status 0 and no child left. With the
# default (--restart no) a dead worker stops the fleet with status 1, and a child that does not
# exit on SIGTERM (stopped) is killed once --drain-timeout-ms + 10 s have passed. Every process
# is killed on exit.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
M="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
trap cleanup_up EXIT

# wait_for FILE PATTERN SECONDS PID: FILE has a line matching PATTERN (grep -E) within SECONDS,
# failing early when PID has exited.
wait_for() {
    local end=$((SECONDS + $3))
    while [ "$SECONDS" -le "$end" ]; do
        grep -qE -- "$2" "$1" 2>/dev/null && return 0
        kill -0 "$4" 2>/dev/null || { grep -qE -- "$2" "$1" && return 0; cat "$TMP"/*.err >&2; fail "pid $4 exited before '$2' in $1"; }
        sleep 0.1
    done
    cat "$1" >&2
    fail "'$2' not in $1 within $3 s"
}
# wait_exit PID SECONDS: PID has exited within SECONDS; sets RC to its status.
wait_exit() {
    local end=$((SECONDS + $2))
    while kill -0 "$1" 2>/dev/null; do
        [ "$SECONDS" -le "$end" ] || fail "pid $1 still running $2 s on"
        sleep 0.1
    done
    wait "$1" && RC=0 || RC=$?
}
# children PID ROLE: the pids of PID's children that are `kvfleet ROLE ...` (their argv[1]).
children() {
    for p in $(pgrep -P "$1"); do
        [ "$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | sed -n 2p)" = "$2" ] && echo "$p"
    done
    return 0
}
# listen_ports PID: the TCP ports PID listens on.
listen_ports() { listeners "$1" | awk '{print $2}'; }
# complete URL ID: one greedy completion of the fixture's first case, tagged x-request-id ID;
# fails unless it answers 200 with the fixture's ids.
complete() {
    $PY - "$1" "$2" "$M/expected.json" <<'EOF' || fail "completion $2 through $1"
import json, sys, urllib.request
url, rid, path = sys.argv[1], sys.argv[2], sys.argv[3]
exp = json.load(open(path))
c = exp["cases"][0]
body = {"model": "tiny-gqa-f32", "prompt": c["prompt"], "max_tokens": exp["n_new"], "temperature": 0,
        "ignore_eos": True}
req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json", "x-request-id": rid})
ids = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["token_ids"]
assert ids == c["greedy"], (ids, c["greedy"])
EOF
}

# --- --restart on-failure: a decode worker and the router come back on their addresses ---------
"$KVF_BIN" up --model "$M" --prefill 0 --decode 2 --port 0 --policy round-robin \
    --restart on-failure --drain-timeout-ms 5000 >"$TMP/up.out" 2>"$TMP/up.err" &
UP=$!
PIDS+=("$UP")
wait_for "$TMP/up.out" "serving" 60 "$UP"
URL=$(sed -n 's/.*at \(http:[^ ]*\).*/\1/p' "$TMP/up.out" | head -1)
[ -n "$URL" ] || fail "kvfleet up printed no URL"
READY_S=30 wait_ready "$URL"
router=$(children "$UP" router)
[ -n "$router" ] || fail "no router child of kvfleet up"
if "$KVF_BIN" router --help 2>/dev/null | grep -q -- "--drain-timeout-ms"; then
    expect_contains "up gives the router its --drain-timeout-ms" "$(tr '\0' ' ' <"/proc/$router/cmdline")" "--drain-timeout-ms=5000"
fi
decoders=$(children "$UP" decode)
victim=$(echo "$decoders" | head -1)
[ "$(echo "$decoders" | wc -l)" = 2 ] || fail "want 2 decode children of kvfleet up, got: $decoders"
# the victim's gRPC port: the one of its listening ports the router was given (--decode=...)
rdec=$(tr '\0' '\n' <"/proc/$router/cmdline" | sed -n 's/^--decode=//p')
old_port=""
for p in $(listen_ports "$victim"); do
    case ",$rdec," in *",127.0.0.1:$p,"*) old_port=$p ;; esac
done
[ -n "$old_port" ] || fail "no listening port of decode pid $victim among the router's --decode=$rdec"
kill -9 "$victim"
wait_for "$TMP/up.err" "decode-[01] \\(pid $victim\\) was killed by signal 9; restarting it in 0\\.5 s on 127\\.0\\.0\\.1:$old_port \\(restart 1\\)" 15 "$UP"
pass "up logs the restart: worker, signal, backoff"
wait_for "$TMP/up.err" "decode-[01] \\(pid [0-9]+\\) is ready again at 127\\.0\\.0\\.1:$old_port\$" 30 "$UP"
new=""
for p in $(children "$UP" decode); do echo "$decoders" | grep -qx "$p" || new=$p; done
[ -n "$new" ] || fail "no new decode child after the restart"
expect_contains "the restarted worker listens on its old gRPC port" " $(listen_ports "$new" | tr '\n' ' ')" " $old_port "
READY_S=30 wait_ready "$URL"
# completions succeed again, and the router reaches the restarted worker (round-robin; its
# health check readmits it within a few seconds)
end=$((SECONDS + 60)); i=0
until grep -qE "req again-[0-9]+: .* -> decode 127\\.0\\.0\\.1:$old_port " "$TMP/up.err"; do
    [ "$SECONDS" -le "$end" ] || fail "no request reached the restarted worker within 60 s"
    complete "$URL" "again-$i"; i=$((i + 1))
done
for j in 1 2 3 4 5 6; do complete "$URL" "after-$j"; done
pass "completions succeed after the restart, the restarted worker serving ($i to reach it, then 6)"
n_to_it=$(grep -cE "req after-[0-9]: .* -> decode 127\\.0\\.0\\.1:$old_port " "$TMP/up.err" || true)
[ "$n_to_it" -ge 1 ] || fail "none of 6 round-robin requests went to the restarted worker"
pass "round-robin sends the restarted worker $n_to_it of 6"
# the router too: same URL
kill -9 "$router"
wait_for "$TMP/up.err" "router \\(pid $router\\) was killed by signal 9; restarting it in 0\\.5 s" 15 "$UP"
wait_for "$TMP/up.err" "router \\(pid [0-9]+\\) is ready again at ${URL#http://}\$" 30 "$UP"
READY_S=30 wait_ready "$URL"
complete "$URL" "after-router"
pass "the restarted router serves on the same URL"
# SIGTERM: status 0 within the drain bound (5 s + 10 s, and margin), no child left
kids=$(pgrep -P "$UP" | tr '\n' ' ')
kill -TERM "$UP"
wait_exit "$UP" 25
expect_eq "kvfleet up: exit status after SIGTERM" "$RC" 0
alive=0; for k in $kids; do kill -0 "$k" 2>/dev/null && alive=$((alive + 1)); done
expect_eq "kvfleet up: no child left after SIGTERM ($kids)" "$alive" 0

# --- --restart no (default): a dead worker stops the fleet; a stopped child is killed ---------
"$KVF_BIN" up --model "$M" --prefill 0 --decode 2 --port 0 --drain-timeout-ms 0 \
    >"$TMP/up2.out" 2>"$TMP/up2.err" &
UP2=$!
PIDS+=("$UP2")
wait_for "$TMP/up2.out" "serving" 60 "$UP2"
decoders=$(children "$UP2" decode)
victim=$(echo "$decoders" | head -1)
frozen=$(echo "$decoders" | tail -1)
[ -n "$victim" ] && [ "$victim" != "$frozen" ] || fail "want 2 decode children of kvfleet up, got: $decoders"
kids=$(pgrep -P "$UP2" | tr '\n' ' ')
kill -STOP "$frozen" # SIGTERM stays pending: up must SIGKILL it 0 + 10 s after SIGTERM
kill -9 "$victim"
wait_exit "$UP2" 25
expect_eq "kvfleet up: exit status after a worker died (no restart)" "$RC" 1
expect_contains "kvfleet up: says which child died" "$(cat "$TMP/up2.err")" "(pid $victim)"
expect_contains "kvfleet up: stops the fleet" "$(cat "$TMP/up2.err")" "was killed by signal 9; stopping the fleet"
expect_contains "kvfleet up: kills a child still running after the drain bound" "$(cat "$TMP/up2.err")" \
    "(pid $frozen) still running 10000 ms after SIGTERM; killing it"
grep -q "restarting" "$TMP/up2.err" && fail "kvfleet up restarted a worker without --restart on-failure"
alive=0; for k in $kids; do kill -0 "$k" 2>/dev/null && alive=$((alive + 1)); done
expect_eq "kvfleet up: no child left after a worker died ($kids)" "$alive" 0
finish
