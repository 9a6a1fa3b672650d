#!/usr/bin/env bash
# tls_fleet.sh: the worker plane under mutual TLS. On a plaintext pair (today's default) an
# outsider's probe reaches Info (the decode pool's descriptor), Cancel and RemotePrefill aimed
# at that pool: the poisoning attack's way in. With --tls-cert/--tls-key/--tls-ca on every
# role, the same probe is refused at the handshake on every method, and so are a TLS client
# without a certificate and one with a certificate from another CA; a member's certificate
# gets in. The fleet serves the fixture's greedy ids before and after the attacks (cached
# prompts included), after a SIGHUP reload, and `kvfleet up --tls` serves them too. Bad flag
# combinations are refused naming the flag.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
: "${TLS_PROBE:?TLS_PROBE must name the tls_probe binary}"
source "$(dirname "$0")/fleet.sh"
m=tiny-gqa-f32
M="$KVF_SHARED/fixtures/models/$m"
C="$TMP/c"
"$KVF_BIN" gen-certs --out "$C" --members router,prefill,decode,member >/dev/null
"$KVF_BIN" gen-certs --out "$TMP/rogue" --members rogue >/dev/null

# --- today's plaintext pair: the attack surface ------------------------------------------------
start pre0 prefill --model "$M"; PRE0=$ADDR; K1=$PID
start dec0 decode --model "$M"; DEC0=$ADDR; K2=$PID
out=$("$TLS_PROBE" "$PRE0" "$DEC0")
expect_contains "plaintext: an outsider reads the decode pool's descriptor" "$out" "info reached"
expect_contains "plaintext: an outsider reaches Cancel" "$out" "cancel reached"
expect_contains "plaintext: an outsider's RemotePrefill reaches the prefill worker" "$out" "remote_prefill reached"
kill "$K1" "$K2"

# --- the same fleet with mutual TLS -------------------------------------------------------------
tls() { echo "--tls-cert=$C/$1.pem --tls-key=$C/$1.key --tls-ca=$C/ca.pem"; }
# shellcheck disable=SC2046
start pre prefill --model "$M" $(tls prefill); PRE=$ADDR; PPRE=$PID
# shellcheck disable=SC2046
start dec decode --model "$M" --local-prefill-max-tokens 0 $(tls decode); DEC=$ADDR; PDEC=$PID
# shellcheck disable=SC2046
start rt router --model "$M" --port 0 --decode "$DEC" --prefill "$PRE" $(tls router); RT=$ADDR; PRT=$PID
wait_ready "http://$RT"
check_fixture "http://$RT" "$m" 1 || fail "mTLS fleet: fixture"
pass "mTLS fleet: disaggregated greedy ids (decode calls prefill, router calls both, over mTLS)"

out=$("$TLS_PROBE" "$PRE" "$DEC")
expect_contains "plaintext outsider: Info refused" "$out" "info refused"
expect_contains "plaintext outsider: Cancel refused" "$out" "cancel refused"
expect_contains "plaintext outsider: RemotePrefill refused" "$out" "remote_prefill refused"
out=$("$TLS_PROBE" "$PRE" "$DEC" "" "" "$C/ca.pem" kvfleet)
case "$out" in *reached*) fail "a TLS client without a certificate got in: $out";; esac
pass "TLS client without a certificate: every method refused"
out=$("$TLS_PROBE" "$PRE" "$DEC" "$TMP/rogue/rogue.pem" "$TMP/rogue/rogue.key" "$C/ca.pem" kvfleet)
case "$out" in *reached*) fail "a certificate from another CA got in: $out";; esac
pass "certificate from another CA: every method refused"
out=$(KVF_PROBE_NO_PREFILL=1 "$TLS_PROBE" "$PRE" "$DEC" "$C/member.pem" "$C/member.key" "$C/ca.pem" kvfleet)
expect_contains "a fleet member's certificate gets in" "$out" "info reached"

# the cached prompts still decode to their fixture ids after the attempts
check_fixture "http://$RT" "$m" 0 || fail "mTLS fleet after the attacks: fixture"
pass "after the attacks: every (cached) prompt gives its fixture ids"

# SIGHUP: every role reloads its files (here the same ones) and goes on serving
kill -HUP "$PPRE" "$PDEC" "$PRT"
for p in "$PPRE" "$PDEC" "$PRT"; do kill -0 "$p" || fail "a process died on SIGHUP"; done
check_fixture "http://$RT" "$m" 1 || fail "after SIGHUP: fixture"
for f in pre dec rt; do grep -q "SIGHUP" "$TMP/$f.err" || fail "$f did not log the reload"; done
pass "SIGHUP: certificates reloaded, the fleet serves on"

# --- flags that do not go together ---------------------------------------------------------------
set +e
err=$("$KVF_BIN" decode --model "$M" --tls-cert "$C/decode.pem" 2>&1 >/dev/null); rc=$?
expect_eq "cert without key and CA: exit code" "$rc" 2
expect_contains "cert without key and CA: message" "$err" "missing: --tls-key --tls-ca"
err=$("$KVF_BIN" router --model "$M" --decode 127.0.0.1:1 --tls-cert "$C/router.pem" --tls-key "$C/router.key" --tls-ca /nonexistent/ca.pem 2>&1 >/dev/null); rc=$?
[ "$rc" -ne 0 ] || fail "router with a missing CA file started"
expect_contains "router with a missing CA file: message" "$err" "--tls-ca /nonexistent/ca.pem"
set -e

# --- kvfleet up --tls ----------------------------------------------------------------------------
"$KVF_BIN" up --tls --model "$M" --prefill 1 --decode 1 --port 0 >"$TMP/up.out" 2>"$TMP/up.err" &
UP=$!
PIDS+=("$UP")
for _ in $(seq 600); do grep -q "serving" "$TMP/up.out" && break; kill -0 "$UP" 2>/dev/null || break; sleep 0.1; done
URL=$(sed -n 's/.*at \(http:[^ ]*\).*/\1/p' "$TMP/up.out" | head -1)
[ -n "$URL" ] || { cat "$TMP/up.out" "$TMP/up.err" >&2; fail "kvfleet up --tls never served"; }
wait_ready "$URL"
check_fixture "$URL" "$m" 0 || fail "kvfleet up --tls: fixture"
pass "kvfleet up --tls serves the fixture's greedy ids"
kids=$(pgrep -P "$UP" | tr '\n' ' ')
n_tls=0
for k in $kids; do tr '\0' ' ' < "/proc/$k/cmdline" | grep -q -- "--tls-ca=" && n_tls=$((n_tls + 1)); done
expect_eq "kvfleet up --tls: every process has the TLS flags" "$n_tls" 3
dir=$(tr '\0' '\n' < "/proc/${kids%% *}/cmdline" | sed -n 's/^--tls-ca=\(.*\)\/ca.pem$/\1/p')
[ -d "$dir" ] || fail "kvfleet up --tls: no certificate folder"
kill -INT "$UP"
for _ in $(seq 150); do kill -0 "$UP" 2>/dev/null || break; sleep 0.1; done
[ -e "$dir" ] && fail "kvfleet up --tls left its certificates in $dir"
pass "kvfleet up --tls removes its certificates at exit"
finish
