#!/usr/bin/env bash
# log_format.sh: `--log-format json` on the router: every stderr line is one JSON object (a
# request refused for want of a decode worker carries its request_id); a bad value is refused
# naming the flag; the workers and `kvfleet up` take the flag too. Waits on the ready line, not
# on a clock.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
M="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
PY=/usr/bin/python3
TMP=$(mktemp -d)
RPID=
cleanup() {
    [ -n "$RPID" ] && kill -9 "$RPID" 2>/dev/null
    rm -rf "$TMP"
}
trap cleanup EXIT

# --- the router, a decode address nobody listens on ---------------------------------------
mkfifo "$TMP/out"
"$KVF_BIN" router --model "$M" --port 0 --decode 127.0.0.1:1 --log-level debug --log-format json \
    >"$TMP/out" 2>"$TMP/err" &
RPID=$!
exec 3<"$TMP/out"
read -r -t 30 line <&3 || { cat "$TMP/err" >&2; fail "the router printed no ready line"; }
URL=$(sed -n 's/.*ready http=\([^ ]*\).*/\1/p' <<<"$line")
[ -n "$URL" ] || fail "not a ready line: $line"
pass "router --log-format json: ready at $URL"
# a request with a known id: no decode worker can take it, and the router says so in its log
code=$(curl -s -o "$TMP/body" -w '%{http_code}' -H 'x-request-id: lf-1' -H 'Content-Type: application/json' \
    -d '{"model":"tiny-gqa-f32","prompt":[1,2,3],"max_tokens":2}' "http://$URL/v1/completions" || true)
[ "${code:0:1}" = 5 ] || fail "a request with no decode worker answered $code: $(cat "$TMP/body")"
kill -TERM "$RPID"
wait "$RPID" || true
RPID=
exec 3<&-
[ -s "$TMP/err" ] || fail "the router wrote no log lines"
$PY -c 'import json,sys; [json.loads(l) for l in sys.stdin]' <"$TMP/err" ||
    { cat "$TMP/err" >&2; fail "a stderr line is not JSON"; }
pass "router --log-format json: every stderr line parses ($(wc -l <"$TMP/err") lines)"
$PY - "$TMP/err" <<'EOF' || { cat "$TMP/err" >&2; fail "the JSON lines lack their fields"; }
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert all(set(j) >= {"ts", "level", "msg"} for j in lines), "ts, level, msg on every line"
assert all(j.get("component") == "router" for j in lines if j["msg"].startswith("router: "))
ids = {j.get("request_id") for j in lines}
assert "lf-1" in ids, f"no line with request_id lf-1 among {ids}"
EOF
pass "router --log-format json: ts, level, component and the request's request_id"

# --- bad values are refused naming the flag ----------------------------------------------
out=$("$KVF_BIN" router --model "$M" --port 0 --decode 127.0.0.1:1 --log-format yaml 2>&1 </dev/null) && rc=0 || rc=$?
[ "$rc" != 0 ] || fail "router --log-format yaml was accepted"
expect_contains "router --log-format yaml is refused" "$out" "--log-format=yaml (use text or json)"
for role in decode prefill; do
    out=$("$KVF_BIN" "$role" --model "$M" --log-format yaml 2>&1 </dev/null) && rc=0 || rc=$?
    [ "$rc" != 0 ] || fail "$role --log-format yaml was accepted"
    expect_contains "$role --log-format yaml is refused" "$out" "--log-format=yaml is not one of text, json"
done

# --- kvfleet up forwards it to every role: each child's lines are JSON ----------------------
mkfifo "$TMP/up.out"
"$KVF_BIN" up --model "$M" --prefill 1 --decode 1 --port 0 --log-format json >"$TMP/up.out" 2>"$TMP/up.err" &
RPID=$!
exec 3<"$TMP/up.out"
served=
while read -r -t 60 line <&3; do
    case $line in *serving*) served=1; break ;; esac
done
[ -n "$served" ] || { cat "$TMP/up.err" >&2; fail "kvfleet up --log-format json never served"; }
kill -INT "$RPID"
wait "$RPID" && rc=0 || rc=$?
RPID=
exec 3<&-
expect_eq "kvfleet up --log-format json: exit status after Ctrl-C" "$rc" 0
$PY - "$TMP/up.err" <<'EOF' || { cat "$TMP/up.err" >&2; fail "kvfleet up: a child's line is not JSON"; }
import json, sys
comps = set()
for l in open(sys.argv[1]):
    if l.startswith("{"):  # up's own lines stay text; its children's are JSON
        comps.add(json.loads(l).get("component"))
assert {"decode", "prefill"} <= comps, f"components seen: {comps}"
EOF
pass "kvfleet up --log-format json: the workers log JSON"
finish
