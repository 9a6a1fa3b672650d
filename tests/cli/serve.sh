#!/usr/bin/env bash
# serve.sh: `kvfleet bench serve` smoke run with the tiny fixture model: both workloads start
# their fleets, every request completes with no error, and the tables and summary lines print.
# Timings are never asserted.
. "$(dirname "$0")/lib.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fx="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
[ -f "$fx/config.json" ] || fail "fixture model $fx is missing"

out=$("$KVF_BIN" bench serve --model "$fx" --requests 4 --rate 4 --out-min 4 --out-max 8 --log-dir "$tmp/mixes" 2>"$tmp/err") \
    || { cat "$tmp/err" >&2; fail "bench serve (mixes) exited $?"; }
echo "$out"
expect_contains "short table" "$out" "short prompts"
expect_contains "long table" "$out" "long prompts"
expect_contains "ratio row" "$out" "disagg / colocated"
expect_contains "summary line" "$out" "serve: disagg_vs_coloc_ttft_p50="
# every configuration: 4 requests, 0 errors
for conf in "colocated short" "disagg short" "colocated long" "disagg long"; do
    row=$(echo "$out" | grep -E "^  $conf +[0-9]")
    expect_eq "$conf requests" "$(echo "$row" | awk '{print $3}')" 4
    expect_eq "$conf errors" "$(echo "$row" | awk '{print $4}')" 0
done

out=$("$KVF_BIN" bench serve --model "$fx" --workload multiturn --requests 2 --turns 2 --rate 4 --out-min 4 --out-max 8 --log-dir "$tmp/mt" 2>"$tmp/err") \
    || { cat "$tmp/err" >&2; fail "bench serve (multiturn) exited $?"; }
echo "$out"
expect_contains "multiturn summary" "$out" "serve: kv_vs_rr_hit="
for conf in round-robin kv; do
    row=$(echo "$out" | grep -E "^  $conf +[0-9]")
    expect_eq "$conf requests" "$(echo "$row" | awk '{print $2}')" 4
    expect_eq "$conf errors" "$(echo "$row" | awk '{print $3}')" 0
done

set +e
err=$("$KVF_BIN" bench serve --model "$fx" --workload nope 2>&1 >/dev/null); rc=$?
set -e
expect_eq "bad workload exit code" "$rc" 2
expect_contains "bad workload message" "$err" "--workload=nope is not known"
expect_contains "bad workload lists them all" "$err" "(use mixes, multiturn, multiturn-tier, tenants or secure)"
finish
