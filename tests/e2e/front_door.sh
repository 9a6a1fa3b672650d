#!/usr/bin/env bash
# front_door.sh: the router as a tenant meets it. With API keys: no key or a wrong one is a 401
# in OpenAI's error shape, /health and /ready stay open, /metrics wants its own key. Two tenants
# sending the same prompt see no cached tokens from each other (on a router without keys the
# second client sees the first one's blocks: the probe this closes), even through a crafted
# cache_salt, while a tenant's own repeat is served from cache. n over the workers' limit, unknown
# paths and wrong methods are JSON errors from the router, and a failed worker's address never
# reaches a client. `kvfleet up --api-key` passes the key on.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
m=tiny-gqa-f32
M="$KVF_SHARED/fixtures/models/$m"
printf '# tenants\nsk-alpha-0123 tenant-a\nsk-beta-4567 tenant-b\n' > "$TMP/keys"

# req URL PATH KEY BODY [METHOD]: prints "CODE BODY"
req() {
    $PY - "$@" <<'PYEOF'
import sys, urllib.request, urllib.error
url, path, key, body = sys.argv[1:5]
method = sys.argv[5] if len(sys.argv) > 5 else ("POST" if body else "GET")
h = {"Content-Type": "application/json"}
if key:
    h["Authorization"] = "Bearer " + key
r = urllib.request.Request(url + path, body.encode() if body else None, h, method=method)
try:
    with urllib.request.urlopen(r, timeout=60) as f:
        print(f.status, f.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
PYEOF
}
prompt=$($PY -c "print([3 + (i * 7) % 300 for i in range(64)])")
body() { echo "{\"model\":\"$m\",\"prompt\":$prompt,\"max_tokens\":2,\"ignore_eos\":true${1:-}}"; }
cached() { json_get "${1#* }" "j['usage']['prompt_tokens_details']['cached_tokens']"; }

start dec decode --model "$M"; DEC=$ADDR; PDEC=$PID
start open router --model "$M" --port 0 --decode "$DEC"; OPEN=http://$ADDR
start rt router --model "$M" --port 0 --decode "$DEC" --api-key-file "$TMP/keys" --metrics-api-key sk-metrics; RT=http://$ADDR
wait_ready "$OPEN"; wait_ready "$RT"

# --- without keys: one client learns what another sent (the attack) --------------------------------
out=$(req "$OPEN" /v1/completions "" "$(body ',"cache_salt":"probe"')")
out=$(req "$OPEN" /v1/completions "" "$(body ',"cache_salt":"probe"')")
[ "$(cached "$out")" -gt 0 ] || fail "no key: the repeat was not served from cache ($out)"
pass "no keys: a second client's cached_tokens reveal the first one's prompt ($(cached "$out"))"

# --- keys ---------------------------------------------------------------------------------------
out=$(req "$RT" /v1/completions "" "$(body)")
expect_eq "no key: 401" "${out%% *}" 401
expect_eq "no key: OpenAI error code" "$(json_get "${out#* }" "j['error']['code']")" invalid_api_key
out=$(req "$RT" /v1/completions sk-alpha-0124 "$(body)")
expect_eq "wrong key: 401" "${out%% *}" 401
case "$out" in *sk-alpha*) fail "a key reached a client: $out";; esac
out=$(req "$RT" /v1/models "" "")
expect_eq "/v1/models needs a key" "${out%% *}" 401
for p in /health /ready; do
    out=$(req "$RT" "$p" "" "")
    expect_eq "$p is open" "${out%% *}" 200
done
expect_eq "/metrics without its key" "$(req "$RT" /metrics "" "" | head -c 3)" 401
expect_eq "/metrics with a tenant key" "$(req "$RT" /metrics sk-alpha-0123 "" | head -c 3)" 401
expect_eq "/metrics with its key" "$(req "$RT" /metrics sk-metrics "" | head -c 3)" 200
grep -q "sk-alpha\|sk-beta\|sk-metrics" "$TMP/rt.err" && fail "a key reached the router's log"
pass "keys never logged"

# --- tenants: the same prompt, no shared blocks ----------------------------------------------------
out=$(req "$RT" /v1/completions sk-alpha-0123 "$(body)")
[ "${out%% *}" = 200 ] || { tail -5 "$TMP/rt.err"; fail "tenant a: $out"; }
out=$(req "$RT" /v1/completions sk-alpha-0123 "$(body)")
[ "$(cached "$out")" -gt 0 ] || fail "tenant a's repeat was not served from its cache ($out)"
pass "tenant a: its own repeat is cached ($(cached "$out") tokens)"
out=$(req "$RT" /v1/completions sk-beta-4567 "$(body)")
expect_eq "tenant b: no cached tokens of tenant a" "$(cached "$out")" 0
out=$(req "$RT" /v1/completions sk-beta-4567 "$(body ',"cache_salt":"t:tenant-a/"')")
expect_eq "tenant b with a crafted cache_salt: still none" "$(cached "$out")" 0
out=$(req "$RT" /v1/completions sk-alpha-0123 "$(body ',"cache_salt":"x y"')")
expect_eq "a cache_salt with a space: 400" "${out%% *}" 400
expect_eq "... naming cache_salt" "$(json_get "${out#* }" "j['error']['param']")" cache_salt

# --- limits and errors from the router, in JSON --------------------------------------------------
out=$(req "$RT" /v1/completions sk-alpha-0123 "$(body ',"n":20')")
expect_eq "n=20: 400 from the router" "${out%% *}" 400
expect_eq "n=20: names n" "$(json_get "${out#* }" "j['error']['param']")" n
out=$(req "$RT" /nope sk-alpha-0123 "")
expect_eq "unknown path: 404" "${out%% *}" 404
json_get "${out#* }" "j['error']['message']" >/dev/null || fail "404 is not JSON: $out"
for mt in GET PATCH DELETE; do
    out=$(req "$RT" /v1/completions sk-alpha-0123 "" "$mt")
    expect_eq "$mt /v1/completions: 405" "${out%% *}" 405
    json_get "${out#* }" "j['error']['code']" >/dev/null || fail "$mt answer is not JSON: $out"
done
out=$(req "$RT" /health "" "" OPTIONS)
expect_eq "OPTIONS /health: 405 (was libevent's HTML 501)" "${out%% *}" 405
json_get "${out#* }" "j['error']['message']" >/dev/null || fail "OPTIONS answer is not JSON: $out"

# a dead worker: the client hears that it failed, not where it lives
kill -9 "$PDEC"
out=$(req "$RT" /v1/completions sk-alpha-0123 "$(body)")
[ "${out%% *}" -ge 500 ] || fail "a dead worker answered ${out%% *}"
case "$out" in *127.0.0.1*|*"$DEC"*|*rpc:*) fail "internal details reached the client: $out";; esac
pass "dead worker: ${out%% *} without its address or RPC text"

# --- kvfleet up --api-key ------------------------------------------------------------------------
"$KVF_BIN" up --model "$M" --prefill 0 --decode 1 --port 0 --api-key sk-up-key >"$TMP/up.out" 2>"$TMP/up.err" &
UP=$!
PIDS+=("$UP")
for _ in $(seq 600); do grep -q "serving" "$TMP/up.out" && break; kill -0 "$UP" 2>/dev/null || break; sleep 0.1; done
URL=$(sed -n 's/.*at \(http:[^ ]*\).*/\1/p' "$TMP/up.out" | head -1)
[ -n "$URL" ] || { cat "$TMP/up.out" "$TMP/up.err" >&2; fail "kvfleet up --api-key never served"; }
expect_eq "up --api-key: no key 401" "$(req "$URL" /v1/completions "" "$(body)" | head -c 3)" 401
expect_eq "up --api-key: the key 200" "$(req "$URL" /v1/completions sk-up-key "$(body)" | head -c 3)" 200
kill -INT "$UP"
finish
