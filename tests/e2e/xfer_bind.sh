#!/usr/bin/env bash
# xfer_bind.sh: every listener a worker opens binds only the address its flag names. Prefill and
# decode workers started with --listen 127.0.0.1:... (gRPC), the default --admin-listen
# (127.0.0.1) and each transfer backend that runs without a GPU (ucx with UCX's own choice of
# transports, ucx over tcp, ucx over shared memory, local) listen on loopback addresses only:
# the process's listening TCP sockets, from /proc/PID/net/tcp{,6} matched against the socket
# inodes in /proc/PID/fd, are all in 127.0.0.0/8 or ::1. Before --xfer-listen, UCX's tcp
# transport listened on every interface's address. The ucx-over-tcp pair serves the fixture
# disaggregated (KV really crosses the restricted transport); --xfer-listen with one of this
# host's other addresses moves the transfer plane there and nowhere else; kvfleet up's workers
# listen on loopback only; an address no interface holds is refused, naming it.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
m=tiny-gqa-f32
M="$KVF_SHARED/fixtures/models/$m"

# only_loopback WHAT MIN PID...: every listener of the processes is on a loopback address, and
# there are at least MIN of them (so an empty list cannot pass).
only_loopback() {
    local what=$1 min=$2; shift 2
    local l; l=$(listeners "$@")
    echo "$what: listening on:"; echo "$l" | sed 's/^/    /'
    local n; n=$(echo "$l" | grep -c . || true)
    [ "$n" -ge "$min" ] || fail "$what: $n listening sockets, expected at least $min"
    $PY - "$l" <<'EOF' || fail "$what: a listener is not on loopback (above)"
import ipaddress, sys
bad = []
for line in sys.argv[1].splitlines():
    a = ipaddress.ip_address(line.split()[0])
    mapped = getattr(a, "ipv4_mapped", None)
    if not (a.is_loopback or (mapped is not None and mapped.is_loopback)):
        bad.append(line)
for b in bad:
    print("not loopback:", b)
sys.exit(1 if bad else 0)
EOF
    pass "$what: $n listening sockets, all on loopback"
}

# metric_any ADMIN NAME: the value of the first sample of NAME (labels allowed).
metric_any() { { curl -s "http://$1/metrics" || true; } | awk -v n="$2" 'index($1, n) == 1 {print $2; exit}'; }

# kv_crossed WHAT PRE_ADMIN DEC_ADMIN URL: every fixture prompt through the router (each answer
# of n_new tokens; the ids themselves are checked by check_fixture where the backend is exact),
# and decode took every prompt's KV from the prefill worker over the transport: prefill sent
# bytes, decode prefilled remotely and never fell back to a local prefill.
kv_crossed() {
    local what=$1 pre_admin=$2 dec_admin=$3 url=$4
    $PY - "$url" "$m" "$KVF_SHARED/fixtures/models/$m/expected.json" <<'EOF' || fail "$what: requests through the router"
import json, sys, urllib.request
url, model, path = sys.argv[1:4]
exp = json.load(open(path))
for c in exp["cases"]:
    body = {"model": model, "prompt": c["prompt"], "max_tokens": exp["n_new"], "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        j = json.load(r)
    assert j["usage"]["completion_tokens"] == exp["n_new"], j["usage"]
EOF
    local sent remote fellback
    sent=$(metric_any "$pre_admin" kvfleet_prefill_kv_bytes_sent_total)
    remote=$(metric_any "$dec_admin" kvfleet_decode_remote_prefills_total)
    fellback=$(metric_any "$dec_admin" kvfleet_decode_prefill_fallbacks_total)
    [ "${fellback:-x}" = 0 ] && awk -v s="${sent:-0}" -v r="${remote:-0}" 'BEGIN {exit !(s + 0 > 0 && r + 0 > 0)}' ||
        fail "$what: prefill sent ${sent:-?} KV bytes, decode prefilled remotely ${remote:-?} times and fell back ${fellback:-?} times (want > 0, > 0, 0)"
    pass "$what: every prompt's KV crossed the transport ($sent bytes, $remote remote prefills, no fallback)"
}

# --- KVF_XFER_BIND_GPU="cuda_ipc nccl": the GPU backends instead (e2e_xfer_bind_emu: kvfleet_emu,
# kvfleet on the emulated CUDA runtime and NCCL; or kvfleet on a GPU). Their notice channel is
# the third listener; the pair serves the fixture disaggregated over it.
if [ -n "${KVF_XFER_BIND_GPU:-}" ]; then
    for backend in $KVF_XFER_BIND_GPU; do
        start "pre-$backend" prefill --model "$M" --device cuda --kv-blocks 64 --listen 127.0.0.1:0 \
            --xfer-backend "$backend"
        PRE=$ADDR; PPRE=$PID
        start "dec-$backend" decode --model "$M" --device cuda --kv-blocks 64 --listen 127.0.0.1:0 \
            --xfer-backend "$backend" --local-prefill-max-tokens 0
        DEC=$ADDR; PDEC=$PID
        only_loopback "prefill, --device cuda --xfer-backend $backend" 3 "$PPRE"
        only_loopback "decode, --device cuda --xfer-backend $backend" 3 "$PDEC"
        PADM=$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$TMP/pre-$backend.out")
        DADM=$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$TMP/dec-$backend.out")
        start "r-$backend" router --model "$M" --port 0 --decode "$DEC" --prefill "$PRE"; R=$ADDR; PR=$PID
        wait_ready "http://$R"
        kv_crossed "$backend, loopback only" "$PADM" "$DADM" "http://$R"
        # after the transfers (nccl: the pair's communicator is up): still loopback only
        only_loopback "prefill after transfers, --xfer-backend $backend" 3 "$PPRE"
        only_loopback "decode after transfers, --xfer-backend $backend" 3 "$PDEC"
        kill "$PPRE" "$PDEC" "$PR"
    done
    # a notice channel asked to listen outside --xfer-listen is refused, naming both
    b=${KVF_XFER_BIND_GPU%% *}
    out=$("$KVF_BIN" decode --model "$M" --device cuda --kv-blocks 64 --xfer-backend "$b" \
          --xfer-listen 127.0.0.1 --xfer-notice-host 127.0.0.2 2>&1 </dev/null) && rc=0 || rc=$?
    [ "$rc" != 0 ] || fail "--xfer-notice-host 127.0.0.2 with --xfer-listen 127.0.0.1 was accepted"
    expect_contains "$b: --xfer-notice-host outside --xfer-listen: refused" "$out" \
        "--xfer-notice-host=127.0.0.2 is not the transfer plane's address --xfer-listen=127.0.0.1"
    finish
    exit 0
fi

# --- each CPU transport: a prefill and a decode worker on loopback ---------------------------
# MIN: gRPC and admin per worker (2), plus UCX's tcp listener where tcp is among its transports
for cfg in "ucx:auto:3" "ucx:tcp:3" "ucx:sm:2" "local:auto:2"; do
    IFS=: read -r backend transport min <<<"$cfg"
    name="$backend-$transport"
    start "pre-$name" prefill --model "$M" --listen 127.0.0.1:0 --xfer-backend "$backend" \
        --xfer-transport "$transport"
    PRE=$ADDR; PPRE=$PID
    start "dec-$name" decode --model "$M" --listen 127.0.0.1:0 --xfer-backend "$backend" \
        --xfer-transport "$transport" --local-prefill-max-tokens 0
    DEC=$ADDR; PDEC=$PID
    only_loopback "prefill, --xfer-backend $backend --xfer-transport $transport" "$min" "$PPRE"
    only_loopback "decode, --xfer-backend $backend --xfer-transport $transport" "$min" "$PDEC"
    if [ "$name" = ucx-tcp ]; then
        start "r-$name" router --model "$M" --port 0 --decode "$DEC" --prefill "$PRE"; R=$ADDR
        wait_ready "http://$R"
        check_fixture "http://$R" "$m" 1 || fail "ucx over tcp on loopback only: fixture"
        pass "ucx over tcp, loopback only: disaggregated greedy ids"
        kv_crossed "ucx over tcp, loopback only" "$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$TMP/pre-$name.out")" \
            "$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' "$TMP/dec-$name.out")" "http://$R"
    fi
    kill "$PPRE" "$PDEC"
done

# --- --xfer-listen names another of this host's addresses: the transfer plane moves there -----
OTHER=$($PY -c "
import socket, subprocess, ipaddress
out = subprocess.run(['ip', '-o', '-4', 'addr', 'show'], capture_output=True, text=True).stdout
for line in out.splitlines():
    a = line.split()[3].split('/')[0]
    if not ipaddress.ip_address(a).is_loopback:
        print(a); break
" 2>/dev/null || true)
if [ -n "$OTHER" ]; then
    start "dec-other" decode --model "$M" --listen 127.0.0.1:0 --xfer-listen "$OTHER" \
        --xfer-transport tcp
    l=$(listeners "$PID")
    echo "decode --xfer-listen $OTHER: listening on:"; echo "$l" | sed 's/^/    /'
    $PY - "$l" "$OTHER" <<'EOF' || fail "--xfer-listen $OTHER: listeners (above)"
import ipaddress, sys
addrs = [ipaddress.ip_address(line.split()[0]) for line in sys.argv[1].splitlines()]
other = ipaddress.ip_address(sys.argv[2])
def loop(a):
    m = getattr(a, "ipv4_mapped", None)
    return a.is_loopback or (m is not None and m.is_loopback)
stray = [a for a in addrs if not loop(a) and a != other]
sys.exit(1 if stray or other not in addrs else 0)
EOF
    pass "--xfer-listen $OTHER: UCX's tcp listener on $OTHER, nothing on any other address"
    kill "$PID"
else
    echo "(no non-loopback IPv4 address here: the --xfer-listen move is not checked)"
fi

# --- kvfleet up: its workers (and router) listen on loopback only ------------------------------
"$KVF_BIN" up --model "$M" --prefill 1 --decode 1 --port 0 >"$TMP/up.out" 2>"$TMP/up.err" &
UP=$!
PIDS+=("$UP")
for _ in $(seq 600); do grep -q "serving" "$TMP/up.out" && break; sleep 0.1; done
grep -q "serving" "$TMP/up.out" || { cat "$TMP/up.out" "$TMP/up.err" >&2; fail "kvfleet up never served"; }
kids=$(pgrep -P "$UP" | tr '\n' ' ')
# router (1: HTTP), prefill and decode (3 each: gRPC, admin, UCX's tcp listener)
# shellcheck disable=SC2086
only_loopback "kvfleet up (children $kids)" 7 $kids
kill -INT "$UP"

# --- an address no interface holds is refused, naming it ----------------------------------------
out=$("$KVF_BIN" decode --model "$M" --xfer-listen 198.51.100.77 2>&1 </dev/null) && rc=0 || rc=$?
[ "$rc" != 0 ] || fail "--xfer-listen 198.51.100.77 was accepted"
expect_contains "--xfer-listen with no such interface: refused" "$out" "no network interface has the address 198.51.100.77"
out=$("$KVF_BIN" decode --model "$M" --xfer-listen 127.0.0.1 --xfer-net-devices lo,eth0 2>&1 </dev/null) && rc=0 || rc=$?
if ip link show eth0 >/dev/null 2>&1; then
    [ "$rc" != 0 ] || fail "--xfer-net-devices lo,eth0 with --xfer-listen 127.0.0.1 was accepted"
    expect_contains "--xfer-net-devices naming another interface: refused" "$out" "would let UCX's tcp transport listen on 'eth0'"
fi
finish
