#!/usr/bin/env bash
# faults_test.sh: the first fault scenarios of issue 21 through a namespaced fleet (router, two
# prefill and two decode workers, and two fault proxies in a sixth namespace). The router
# finds decode workers by the name decode.kvf, which its /etc/hosts maps to d1 and to the proxy,
# which forwards to d2: the router's gRPC to d2 crosses the proxy, everything else is direct.
# Each scenario sends at least 100 greedy requests (tiny model, 120-250 tokens, mixed prompt lengths,
# streamed and plain, 16 at a time, at most 100 a second, on until a second after the fault healed)
# and injects its fault once streams are under way:
#   baseline     no fault (the latencies the others are compared with)
#   reset        the proxy RSTs every router<->d2 connection mid-stream
#   blackhole    the proxy stops forwarding router<->d2 (no RST, no FIN) past the router's
#                deadline, then passes again
#   link-down    d1's veth goes down mid-stream past the router's deadline, then up
#   link-flap    d1's veth goes down and up five times, 300 ms each
#   sigstop      d1 is stopped past the router's deadline, then continued
#   kill         d1 is killed (-9) mid-stream, then started again on its address
#   partition    d1 drops every packet from and to p1 and p2 (iptables in d1's namespace) past
#                the decode workers' --prefill-timeout-ms: RemotePrefill and KV transfers stall,
#                d1 falls back to local prefills; then healed
#   prefill-delay, prefill-throttle   a second proxy in front of p2 (decode.kvf's twin
#                prefill.kvf names p1 and it) adds 200 ms to every chunk, or caps each
#                direction at 1 MB/s, for 3 s: RemotePrefill calls, Health and WatchKv slow down
#                (the KV itself goes p2 -> decode over UCX, beside the proxy)
#   prefill-reset, prefill-blackhole  the same proxy RSTs its connections, or goes silent past
#                the decode workers' --prefill-timeout-ms (they fall back to a local prefill)
# Every request must end with the reference tokens (kvfleet generate) or a clean HTTP/SSE error
# within its deadline: none lost (hung, cut off), none wrong; the router must move requests off
# the decode worker at fault (reset, blackhole, link-down, sigstop, kill), and under blackhole,
# link-down and sigstop none may fail (the worker goes silent: its attempts move once its health
# checks go unanswered, not at their deadline). After each scenario every worker's
# pool returns to idle (kvfleet_kv_used_blocks 0, kvfleet_decode_held_blocks 0). A table at the
# end; MH_SCENARIOS (space-separated) picks scenarios.
source "$(dirname "$0")/../cli/lib.sh"
: "${FAULTPROXY:?FAULTPROXY must name the faultproxy binary}"
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/netns.sh"
mh_need_root
mh_watchdog 280

TIMEOUT_MS=10000  # the router's deadline of one attempt (--request-timeout-ms): past the
                  # 3 late Health answers in a row (1 s each) that count a worker out
ATTEMPTS=3        # its --max-attempts
HOLD_S=11         # how long blackhole, link-down and sigstop last: past the deadline
PREFILL_TIMEOUT_MS=2000 # the decode workers' remote prefill deadline before a local fallback
DEADLINE_S=$((ATTEMPTS * TIMEOUT_MS / 1000 + HOLD_S + 10)) # the client's, per request
N=${MH_N:-100}
SCENARIOS=${MH_SCENARIOS:-"baseline reset blackhole link-down link-flap sigstop kill partition prefill-delay prefill-throttle prefill-reset prefill-blackhole"}

M="$TMP/tiny"
"$KVF_BIN" gen-model --preset tiny --out "$M" >/dev/null 2>&1 || fail "gen-model"

# --- references: 8 prompts of mixed lengths, 250 greedy tokens each from kvfleet generate ----
$PY - "$TMP/prompts" <<'EOF'
import random, sys
rnd = random.Random(21)
with open(sys.argv[1], "w") as f:
    for n in (1, 5, 17, 33, 64, 100, 150, 220):
        print(",".join(str(rnd.randrange(3, 512)) for _ in range(n)), file=f)
EOF
echo "[" >"$TMP/refs.json"
sep=""
while read -r ids; do
    out=$("$KVF_BIN" generate --model "$M" --prompt-ids "$ids" --max-tokens 250 --ignore-eos --json --threads 1 2>/dev/null)
    g=$(json_get "$out" "','.join(map(str, j['output_ids']))")
    echo "$sep{\"prompt\": [$ids], \"greedy\": [$g]}" >>"$TMP/refs.json"
    sep=","
done <"$TMP/prompts"
echo "]" >>"$TMP/refs.json"
pass "references: 8 prompts (1 to 220 tokens), 250 greedy tokens each from kvfleet generate"

# --- the fleet ------------------------------------------------------------------------------
mh_net_up r p1 p2 d1 d2 px
mh_hosts r "${IP[d1]} decode.kvf" "${IP[px]} decode.kvf" \
           "${IP[p1]} prefill.kvf" "${IP[px]} prefill.kvf"
wargs() { echo --model "$M" --listen "${IP[$1]}:$2" --admin-listen "${IP[$1]}:9100" --threads 1 \
               --xfer-backend ucx --xfer-transport tcp --xfer-net-devices "${DEV[$1]}"; }
declare -A WPID
start_decode() {
    # shellcheck disable=SC2046
    mh_start "$1-$(date +%s%N)" "$1" decode --local-prefill-max-tokens 0 \
        --prefill-timeout-ms $PREFILL_TIMEOUT_MS $(wargs "$1" 7001)
    WPID[$1]=$PID
}
for p in p1 p2; do
    # shellcheck disable=SC2046
    mh_start "$p" "$p" prefill $(wargs "$p" 7002); WPID[$p]=$PID
done
start_decode d1
start_decode d2
# fp: router -> d2 (gRPC Generate, Health, WatchKv); fpp: router and decode -> p2 (RemotePrefill,
# Health, WatchKv; the KV itself goes p2 -> decode over UCX, not through it)
for f in "fp ${IP[px]}:7001 ${IP[d2]}:7001" "fpp ${IP[px]}:7002 ${IP[p2]}:7002"; do
    read -r tag from to <<<"$f"
    mh_x px "$FAULTPROXY" serve "$from" "$to" "$TMP/$tag.ctl" >"$TMP/$tag.out" 2>"$TMP/$tag.err" &
    PIDS+=($!)
    for _ in $(seq 100); do grep -q "faultproxy: listening" "$TMP/$tag.out" && break; sleep 0.1; done
    grep -q "faultproxy: listening" "$TMP/$tag.out" || fail "the fault proxy $from -> $to did not listen"
done
mh_start router r router --model "$M" --host "${IP[r]}" --port 8000 --policy round-robin \
    --decode-dns decode.kvf:7001 --prefill-dns prefill.kvf:7002 --resolve-interval-ms 1000 \
    --health-interval-ms 500 --request-timeout-ms $TIMEOUT_MS --max-attempts $ATTEMPTS
R="${IP[r]}:8000"
mh_wait_ready r "http://$R"
mh_wait_metric r "$R" 'kvfleet_router_healthy_workers{role="decode"}' 2
mh_wait_metric r "$R" 'kvfleet_router_healthy_workers{role="prefill"}' 2
pass "fleet up: router, p1, p2, d1, d2 (router->d2 and everyone->p2 through the proxies)"

# every pool idle: no block in use or held on any worker, nothing in flight at the router
pools_idle() {
    local w role
    for w in p1 p2 d1 d2; do
        role=prefill; [ "${w#d}" != "$w" ] && role=decode
        mh_wait_metric "$w" "${IP[$w]}:9100" "kvfleet_kv_used_blocks{role=\"$role\"}" 0 30
        [ $role = decode ] && mh_wait_metric "$w" "${IP[$w]}:9100" 'kvfleet_decode_held_blocks{role="decode"}' 0 30
    done
    mh_wait_metric r "$R" kvfleet_router_requests_in_flight 0 30
}

# fallbacks: "D1 D2", remote prefills each decode worker gave up for a local one ("-": no answer)
fallbacks() {
    local d v out=""
    for d in d1 d2; do
        v=$(mh_metric $d "${IP[$d]}:9100" 'kvfleet_decode_prefill_fallbacks_total{role="decode"}')
        out+="${v:--} "
    done
    echo "$out"
}
# fallbacks_delta "BEFORE" "AFTER": the sum over workers that answered both times with no restart
fallbacks_delta() {
    local -a b=($1) a=($2)
    local i sum=0
    for i in 0 1; do
        [ "${b[$i]}" != - ] && [ "${a[$i]}" != - ] && [ "${a[$i]%.*}" -ge "${b[$i]%.*}" ] &&
            sum=$((sum + ${a[$i]%.*} - ${b[$i]%.*}))
    done
    echo $sum
}

# partition_cmd -A|-D: the command that cuts (-A) or heals (-D) d1 from both prefill workers in
# both directions (iptables inside d1's namespace only): RemotePrefill and the KV path alike
partition_cmd() {
    local c="" p
    for p in p1 p2; do
        c+="ip netns exec ${NS[d1]} iptables $1 INPUT -s ${IP[$p]} -j DROP && "
        c+="ip netns exec ${NS[d1]} iptables $1 OUTPUT -d ${IP[$p]} -j DROP && "
    done
    echo "${c}true"
}

# run_scenario NAME FAULT HEAL HEAL_AFTER_S
declare -A RES
run_scenario() {
    local name=$1 fault=$2 heal=$3 after=$4 out
    local args=(--host "${IP[r]}" --port 8000 --model tiny --refs "$TMP/refs.json" --n "$N" --tag "$name"
                --conc 16 --deadline "$DEADLINE_S" --min-tokens 120 --max-tokens 250 --pace 0.01)
    [ -n "$fault" ] && args+=(--fault "$fault" --heal "$heal" --heal-after "$after")
    local r0 m0
    r0=$(mh_metric r "$R" kvfleet_router_retries_total)
    m0=$(grep -cE "failed after [1-9][0-9]* tokens" "$TMP/router.err" || true)
    local f0 f1
    f0=$(fallbacks)
    out=$(mh_x r $PY "$HERE/load.py" "${args[@]}") || fail "$name: the client failed: $out"
    # moved: requests the router moved to another decode worker; mid: attempts that failed after
    # at least one token (moved on, or answered with an error)
    out=$($PY -c 'import json, sys; j = json.loads(sys.argv[1]); j["moved"] = int(float(sys.argv[2])); j["mid"] = int(sys.argv[3]); print(json.dumps(j))' \
          "$out" "$(( $(mh_metric r "$R" kvfleet_router_retries_total | cut -d. -f1) - ${r0%.*} ))" \
          "$(( $(grep -cE "failed after [1-9][0-9]* tokens" "$TMP/router.err" || true) - m0 ))")
    f1=$(fallbacks)
    out=$($PY -c 'import json, sys; j = json.loads(sys.argv[1]); j["fallbacks"] = int(sys.argv[2]); print(json.dumps(j))' \
          "$out" "$(fallbacks_delta "$f0" "$f1")")
    RES[$name]=$out
    echo "$out" >"$TMP/res-$name.json"
    $PY - "$out" "$name" <<'EOF'
import json, sys
j, name = json.loads(sys.argv[1]), sys.argv[2]
print(f"  {name}: {j['n']} requests in {j['wall_s']} s: {j['correct']} correct, {j['error']} errors, "
      f"{j['lost']} lost, {j['wrong']} wrong")
for f in j["faults"]:
    print(f"    fault: {f['cmd']} -> rc {f['rc']} {f['out']}")
for p in j["problems"]:
    print(f"    req {p['i']}: {p['outcome']}: {p['why']}" + (f" got {p['got']} want {p['want']}" if p["got"] else ""))
EOF
}

for s in $SCENARIOS; do
    case $s in
    baseline)  run_scenario baseline "" "" 0 ;;
    reset)     run_scenario reset "$FAULTPROXY ctl $TMP/fp.ctl reset" "" 0 ;;
    blackhole) run_scenario blackhole "$FAULTPROXY ctl $TMP/fp.ctl blackhole" \
                   "$FAULTPROXY ctl $TMP/fp.ctl pass" $HOLD_S ;;
    link-down) run_scenario link-down "ip -n ${NS[d1]} link set ${DEV[d1]} down" \
                   "ip -n ${NS[d1]} link set ${DEV[d1]} up" $HOLD_S ;;
    link-flap) run_scenario link-flap "for k in 1 2 3 4 5; do ip -n ${NS[d1]} link set ${DEV[d1]} down; sleep 0.3; ip -n ${NS[d1]} link set ${DEV[d1]} up; sleep 0.3; done" "" 0 ;;
    partition) run_scenario partition "$(partition_cmd -A)" "$(partition_cmd -D)" $HOLD_S ;;
    prefill-delay)     run_scenario $s "$FAULTPROXY ctl $TMP/fpp.ctl delay 200" \
                           "$FAULTPROXY ctl $TMP/fpp.ctl pass" 3 ;;
    prefill-throttle)  run_scenario $s "$FAULTPROXY ctl $TMP/fpp.ctl throttle 1000000" \
                           "$FAULTPROXY ctl $TMP/fpp.ctl pass" 3 ;;
    prefill-reset)     run_scenario $s "$FAULTPROXY ctl $TMP/fpp.ctl reset" "" 0 ;;
    prefill-blackhole) run_scenario $s "$FAULTPROXY ctl $TMP/fpp.ctl blackhole" \
                           "$FAULTPROXY ctl $TMP/fpp.ctl pass" $HOLD_S ;;
    sigstop)   run_scenario sigstop "kill -STOP ${WPID[d1]}" "kill -CONT ${WPID[d1]}" $HOLD_S ;;
    kill)      run_scenario kill "kill -9 ${WPID[d1]}" "" 0
               kill -9 "${WPID[d1]}" 2>/dev/null || true # if the fault never fired
               wait "${WPID[d1]}" 2>/dev/null || true
               start_decode d1
               mh_wait_metric r "$R" 'kvfleet_router_healthy_workers{role="decode"}' 2 30 ;;
    *) fail "unknown scenario $s" ;;
    esac
    # every worker process is still there (d1 was started again after kill)
    for w in p1 p2 d1 d2; do kill -0 "${WPID[$w]}" 2>/dev/null || fail "$s: worker $w died"; done
    pools_idle
    mh_wait_metric r "$R" 'kvfleet_router_healthy_workers{role="decode"}' 2 30
    mh_wait_metric r "$R" 'kvfleet_router_healthy_workers{role="prefill"}' 2 30
    pass "$s: every pool back to idle, every worker healthy again"
done

# --- the table ------------------------------------------------------------------------------
$PY - "$TMP" $SCENARIOS <<'EOF' || fail "lost or wrong answers (table above)"
import json, math, os, sys
tmp, names = sys.argv[1], sys.argv[2:]
res = {n: json.load(open(f"{tmp}/res-{n}.json")) for n in names}
def p99(ms):
    return ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)] if ms else float("nan")
base = p99(res["baseline"]["ms"]) if "baseline" in res else 0.0
print(f"{'scenario':<17} {'requests':>8} {'correct':>8} {'clean err':>9} {'lost':>5} {'wrong':>6} {'p99 added ms':>13} {'moved':>6} {'cut mid-stream':>15} {'fallbacks':>10}")
tot = {"lost": 0, "wrong": 0}
bad = False
for n in names:
    j = res[n]
    print(f"{n:<17} {j['n']:>8} {j['correct']:>8} {j['error']:>9} {j['lost']:>5} {j['wrong']:>6} "
          f"{p99(j['ms']) - base:>13.0f} {j['moved']:>6} {j['mid']:>15} {j['fallbacks']:>10}")
    tot["lost"] += j["lost"]; tot["wrong"] += j["wrong"]
    if n != "baseline" and not j["faults"]:
        print(f"{n}: the fault never fired"); bad = True
    elif n in ("reset", "blackhole", "link-down", "sigstop", "kill") and j["moved"] == 0:
        print(f"{n}: the router moved no request off the decode worker at fault"); bad = True
    # a silent decode worker's attempts move as soon as its health checks go unanswered,
    # long before their deadline: none of them may end in an error
    if n in ("blackhole", "link-down", "sigstop") and j["error"]:
        print(f"{n}: {j['error']} requests failed instead of moving off the silent worker"); bad = True
    if any(f["rc"] != 0 for f in j["faults"]):
        print(f"{n}: a fault command failed"); bad = True
    if j["n"] < int(os.environ.get("MH_N", 100)) or j["correct"] + j["error"] + j["lost"] + j["wrong"] != j["n"]:
        bad = True
print(f"lost={tot['lost']} wrong={tot['wrong']}")
sys.exit(1 if bad or tot["lost"] or tot["wrong"] or res.get("baseline", {"correct": 100})["correct"] != res.get("baseline", {"n": 100})["n"] else 0)
EOF
pass "every request correct or a clean error: lost=0 wrong=0"
finish
