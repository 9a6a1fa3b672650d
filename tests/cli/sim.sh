#!/usr/bin/env bash
# sim.sh: `kvfleet sim` on a slice of a Mooncake trace: the JSON carries the fields the
# done-when table reads, the shared-cache reference (fleet-lru) hits at least as often as the kv
# policy, kv beats round-robin, and bad input is refused with a message.
. "$(dirname "$0")/lib.sh"
trace="${KVF_SHARED:-../shared}/data/mooncake/conversation_trace.jsonl"
[ -f "$trace" ] || fail "missing trace $trace"
sim() { "$KVF_BIN" sim --trace "$trace" --max-requests 1500 --workers 8 --capacity-blocks 1250 --json "$@"; }

kv=$(sim --policy kv)
for f in hit_rate_blocks hit_rate_tokens load_max_over_mean ttft_p50_s ttft_p99_s; do
  expect_eq "kv has $f" "$(json_get "$kv" "isinstance(j['$f'], float)")" True
done
expect_eq "kv requests" "$(json_get "$kv" "j['requests']")" 1500
fl=$(sim --policy fleet-lru)
rr=$(sim --policy round-robin)
expect_eq "fleet-lru >= kv hit rate" "$(json_get "$fl" "j['hit_rate_blocks'] >= $(json_get "$kv" "j['hit_rate_blocks']")")" True
expect_eq "kv > 2x round-robin hit rate" "$(json_get "$kv" "j['hit_rate_blocks'] > 2 * $(json_get "$rr" "j['hit_rate_blocks']")")" True
expect_eq "kv load balanced" "$(json_get "$kv" "j['load_max_over_mean'] <= 1.2")" True
expect_eq "p99 >= p50" "$(json_get "$kv" "j['ttft_p99_s'] >= j['ttft_p50_s'] > 0")" True

# the table form
out=$("$KVF_BIN" sim --trace "$trace" --max-requests 200 --policy sticky)
expect_contains "table hit rate" "$out" "hit rate: blocks"
expect_contains "table TTFT" "$out" "TTFT: p50"

# bad input
set +e
err=$("$KVF_BIN" sim --trace "$trace" --policy random 2>&1 >/dev/null); rc=$?
expect_eq "bad policy exit code" "$rc" 2
expect_contains "bad policy message" "$err" "--policy=random is not known"
err=$("$KVF_BIN" sim --policy kv 2>&1 >/dev/null); rc=$?
expect_contains "missing trace" "$err" "--trace FILE is required"
err=$("$KVF_BIN" sim --trace /nonexistent.jsonl 2>&1 >/dev/null); rc=$?
expect_eq "missing file exit code" "$rc" 1
expect_contains "missing file named" "$err" "/nonexistent.jsonl"
err=$("$KVF_BIN" sim --trace "$trace" --workers 65 --max-requests 10 2>&1 >/dev/null); rc=$?
expect_contains "too many workers" "$err" "--workers=65 is out of range"
set -e
"$KVF_BIN" sim --help | grep -q "prefill-a + prefill-b" || fail "sim --help states the time model"
pass "sim --help states the time model"
finish
