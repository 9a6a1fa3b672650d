# netns.sh: a fleet of "hosts" on one machine for the multihost tests: a bridge, one network
# namespace per host with a veth into the bridge and its own address, /etc/hosts per namespace
# (ip netns exec bind-mounts /etc/netns/NS/hosts), and kvfleet processes started inside them.
# Source it after tests/cli/lib.sh. Everything it creates carries the prefix kvfmh<PID> and is
# removed by mh_cleanup (trapped on EXIT, INT, TERM), also when the test fails. Needs root.
#
#   mh_need_root                 exit 77 (skip) with the reason unless namespaces can be made
#   mh_watchdog SECONDS          fail (and clean up) past SECONDS, before ctest's TIMEOUT would kill
#   mh_net_up NAME...            bridge + one namespace per NAME; sets NS[NAME], IP[NAME], DEV[NAME]
#                                (first removing what runs that no longer exist left behind)
#   mh_hosts NAME "IP name"...   /etc/hosts of NAME's namespace
#   mh_x NAME CMD...             CMD inside NAME's namespace
#   mh_start TAG NAME ARGS...    `kvfleet ARGS` inside NAME (UCX_TLS=tcp, UCX_NET_DEVICES=its veth)
#                                up to its ready line; sets ADDR, ADMIN, PID; logs in $TMP/TAG.*
#   mh_metric NAME ADMIN METRIC  one sample's value, read from inside NAME
#   mh_wait_ready NAME URL       /ready answers 200 (READY_S, default 30 s)
# MH_LOGS=DIR keeps a copy of the temporary folder (logs, results) there.
PY=/usr/bin/python3
MH_ID=$$
MH_PFX=kvfmh$MH_ID
TMP=$(mktemp -d)
PIDS=()
declare -A NS IP DEV
MH_NAMES=()
MH_BR=""

mh_cleanup() {
    local rc=$?
    set +e
    [ -n "${MH_WATCHDOG:-}" ] && kill "$MH_WATCHDOG" 2>/dev/null
    for p in "${PIDS[@]}"; do kill -CONT "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; done
    # anything else still running in our namespaces was started by this test
    for n in "${MH_NAMES[@]}"; do
        for p in $(ip netns pids "${NS[$n]}" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    done
    wait 2>/dev/null
    for n in "${MH_NAMES[@]}"; do
        ip netns del "${NS[$n]}" 2>/dev/null
        rm -rf "/etc/netns/${NS[$n]}"
    done
    # the namespaces' veth ends take the host ends with them; these are for a half-made fleet
    # exactly this run's names (kvfmh12 must not match kvfmh123's links)
    ip -o link show 2>/dev/null | sed -n "s/^[0-9]*: \(${MH_PFX}[bhn][0-9]*\)[:@].*/\1/p" | while read -r l; do
        ip link del "$l" 2>/dev/null
    done
    [ -n "$MH_BR" ] && ip link del "$MH_BR" 2>/dev/null
    if [ "$rc" != 0 ] && [ -z "${MH_KEEP_QUIET:-}" ]; then
        for f in "$TMP"/*.err; do
            [ -s "$f" ] || continue
            echo "--- $f (last lines)" >&2
            tail -15 "$f" >&2
        done
    fi
    [ -n "${MH_LOGS:-}" ] && mkdir -p "$MH_LOGS" && cp -r "$TMP"/. "$MH_LOGS"/
    rm -rf "$TMP"
    exit "$rc"
}
trap mh_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mh_need_root() {
    if [ "$(id -u)" != 0 ]; then
        echo "skip: tests/multihost needs root (ip netns, veth, bridge); run ctest -L multihost as root"
        exit 77
    fi
    if ! ip netns add "$MH_PFX-probe" 2>/dev/null; then
        echo "skip: cannot create a network namespace here (ip netns add failed)"
        exit 77
    fi
    ip netns del "$MH_PFX-probe"
}

# mh_subnet: 10.77.K.0/24, K from the PID, moved on while any host address uses it
# mh_sweep: namespaces, links and /etc/netns files of earlier runs whose process is gone (a run
# killed outright, as ctest does at its timeout, cannot run its trap); other runs are left alone
mh_sweep() {
    local ns pid l
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^kvfmh[0-9]+-'); do
        pid=${ns#kvfmh}; pid=${pid%%-*}
        kill -0 "$pid" 2>/dev/null && continue
        echo "removing $ns, left by run $pid" >&2
        for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    for l in $(ip -o link show 2>/dev/null | sed -n 's/^[0-9]*: \(kvfmh[0-9]*[bhn][0-9]*\)[:@].*/\1/p'); do
        pid=${l#kvfmh}; pid=${pid%%[bhn]*}
        kill -0 "$pid" 2>/dev/null || ip link del "$l" 2>/dev/null || true
    done
}

# mh_watchdog SECONDS: past this the test fails on its own (before ctest's TIMEOUT kills it and
# its trap with it): the processes in its namespaces die, so the shell's foreground command ends
# and the EXIT trap cleans up
mh_watchdog() {
    set -- "${MH_LIMIT_S:-$1}"
    ( trap 'kill "$sp" 2>/dev/null; exit 0' TERM
      sleep "$1" & sp=$!
      wait "$sp"
      trap '' TERM # from here it ends by itself (the cleanup's kill must not cut it midway)
      echo "FAIL: the test ran past its own bound of $1 s" >&2
      kill -TERM "$MH_ID" 2>/dev/null
      for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$MH_PFX-"); do
          for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
      done ) &
    MH_WATCHDOG=$!
}

mh_subnet() {
    local k=$((MH_ID % 200 + 20)) i
    for i in $(seq 200); do
        ip -4 addr | grep -q "inet 10\.77\.$k\." || { echo "10.77.$k"; return 0; }
        k=$(((k + 1) % 200 + 20))
    done
    fail "no free 10.77.K.0/24 subnet"
}

mh_net_up() {
    local net i=0 n
    mh_sweep
    net=$(mh_subnet)
    MH_BR="${MH_PFX}b"
    ip link add "$MH_BR" type bridge || fail "ip link add $MH_BR type bridge"
    ip link set "$MH_BR" up
    for n in "$@"; do
        i=$((i + 1))
        NS[$n]="$MH_PFX-$n"
        IP[$n]="$net.$i"
        DEV[$n]="${MH_PFX}n$i"
        MH_NAMES+=("$n")
        ip netns add "${NS[$n]}" || fail "ip netns add ${NS[$n]}"
        ip link add "${MH_PFX}h$i" type veth peer name "${DEV[$n]}" || fail "veth for $n"
        ip link set "${MH_PFX}h$i" master "$MH_BR"
        ip link set "${MH_PFX}h$i" up
        ip link set "${DEV[$n]}" netns "${NS[$n]}"
        ip -n "${NS[$n]}" addr add "${IP[$n]}/24" dev "${DEV[$n]}"
        ip -n "${NS[$n]}" link set "${DEV[$n]}" up
        ip -n "${NS[$n]}" link set lo up
    done
    # reachable once a TCP connect to a closed port is refused (an RST came back); no ping here
    local last=$n first=$1
    for i in $(seq 100); do
        ip netns exec "${NS[$first]}" $PY -c 'import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=1)
except ConnectionRefusedError:
    sys.exit(0)
except OSError:
    sys.exit(1)' "${IP[$last]}" && return 0
        sleep 0.1
    done
    fail "namespaces ${NS[$first]} and ${NS[$last]} cannot reach each other"
}

mh_hosts() {
    local n=$1; shift
    mkdir -p "/etc/netns/${NS[$n]}"
    { echo "127.0.0.1 localhost"; printf '%s\n' "$@"; } >"/etc/netns/${NS[$n]}/hosts"
}

mh_x() {
    local n=$1; shift
    ip netns exec "${NS[$n]}" "$@"
}

mh_start() {
    local tag=$1 n=$2; shift 2
    ip netns exec "${NS[$n]}" env UCX_TLS=tcp UCX_NET_DEVICES="${DEV[$n]}" \
        "$KVF_BIN" "$@" >"$TMP/$tag.out" 2>"$TMP/$tag.err" &
    PID=$!
    PIDS+=("$PID")
    for _ in $(seq $((${START_S:-60} * 10))); do
        if grep -q "ready" "$TMP/$tag.out" 2>/dev/null; then
            ADDR=$(sed -n 's/.*ready \(grpc\|http\)=\([^ ]*\).*/\2/p' "$TMP/$tag.out" | head -1)
            ADMIN=$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$TMP/$tag.out" | head -1)
            return 0
        fi
        kill -0 "$PID" 2>/dev/null || { cat "$TMP/$tag.err" >&2; fail "$tag died before ready"; }
        sleep 0.1
    done
    fail "$tag not ready in ${START_S:-60} s"
}

mh_metric() {
    ip netns exec "${NS[$1]}" curl -s -m 5 "http://$2/metrics" | awk -v m="$3" '$1 == m {print $2}'
}

mh_wait_ready() {
    for _ in $(seq $((${READY_S:-30} * 10))); do
        [ "$(mh_x "$1" curl -s -m 2 -o /dev/null -w '%{http_code}' "$2/ready")" = 200 ] && return 0
        sleep 0.1
    done
    fail "$2/ready never said 200"
}

# mh_wait_metric NAME ADMIN METRIC VALUE [SECONDS]: until the sample equals VALUE
mh_wait_metric() {
    local v
    for _ in $(seq $((${5:-30} * 10))); do
        v=$(mh_metric "$1" "$2" "$3")
        [ "${v%.*}" = "$4" ] && return 0
        sleep 0.1
    done
    fail "$3 at $2 is '$v', not $4 within ${5:-30} s"
}
