#!/usr/bin/env bash
# serve_cache.sh: `kvfleet bench serve`'s KV-cache workloads (issue 22) with the tiny fixture
# model: multiturn-tier and tenants start their fleets, print their sizing, every configuration
# either completes with no error or says it was not run (a flag this build's roles lack), and
# the summary lines print; bad --tenants and --think-s are refused. Timings are never asserted.
. "$(dirname "$0")/lib.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fx="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
[ -f "$fx/config.json" ] || fail "fixture model $fx is missing"

# expect_row OUT CONF REQUESTS: CONF's row has REQUESTS requests and 0 errors, or says "not run:"
expect_row() {
    local row nw pat
    pat=$(printf '%s' "$2" | sed 's/[+]/\\+/g')
    row=$(echo "$1" | grep -E "^  $pat +([0-9]|not run:)" | head -1)
    [ -n "$row" ] || fail "no row for $2"
    case "$row" in
    *"not run:"*) pass "$2 not run: ${row#*not run: }"; return;;
    esac
    nw=$(echo "$2" | wc -w)
    expect_eq "$2 requests" "$(echo "$row" | awk -v k=$((nw + 1)) '{print $k}')" "$3"
    expect_eq "$2 errors" "$(echo "$row" | awk -v k=$((nw + 2)) '{print $k}')" 0
}

out=$("$KVF_BIN" bench serve --model "$fx" --workload multiturn-tier --requests 2 --turns 2 --rate 4 \
      --think-s 0.2 --out-min 4 --out-max 8 --log-dir "$tmp/tier" 2>"$tmp/err") \
    || { cat "$tmp/err" >&2; fail "bench serve (multiturn-tier) exited $?"; }
echo "$out"
expect_contains "pool sizing" "$out" "pool: --kv-blocks="
expect_contains "tier sizing" "$out" "tier: --kv-host-memory="
expect_contains "tier summary" "$out" "serve: tier_vs_pool_hit="
expect_contains "tier summary ttft" "$out" "tier_vs_pool_ttft_p50="
expect_row "$out" "pool only" 4
expect_row "$out" "pool + host tier" 4
# the pool-only fleet really got the computed pool
blocks=$(echo "$out" | sed -n 's/.*pool: --kv-blocks=\([0-9]*\) .*/\1/p')
grep -q "pool $blocks blocks" "$tmp/tier/pool-only.log" || fail "pool-only.log: no 'pool $blocks blocks'"
pass "pool-only fleet has $blocks blocks"

out=$("$KVF_BIN" bench serve --model "$fx" --workload tenants --tenants 4 --requests 3 --rate 4 \
      --out-min 4 --out-max 8 --log-dir "$tmp/ten" 2>"$tmp/err") \
    || { cat "$tmp/err" >&2; fail "bench serve (tenants) exited $?"; }
echo "$out"
expect_contains "tenants sizing" "$out" "4 tenants, each a "
expect_contains "tenants summary" "$out" "serve: kv_vs_rr_ttft_p90="
expect_contains "tenants summary approx" "$out" "kv_vs_approx_ttft_p90="
expect_contains "tenants summary tok/s" "$out" "kv_vs_rr_tok_s="
expect_contains "ratio row" "$out" "kv / round-robin"
expect_row "$out" "round-robin" 3
expect_row "$out" "kv" 3
expect_row "$out" "kv approx" 3

set +e
err=$("$KVF_BIN" bench serve --model "$fx" --workload tenants --tenants 0 2>&1 >/dev/null); rc=$?
set -e
expect_eq "--tenants 0 exit code" "$rc" 2
expect_contains "--tenants 0 message" "$err" "--tenants=0 is out of range (1 to 64)"
set +e
err=$("$KVF_BIN" bench serve --model "$fx" --workload tenants --tenants 65 2>&1 >/dev/null); rc=$?
set -e
expect_eq "--tenants 65 exit code" "$rc" 2
expect_contains "--tenants 65 message" "$err" "--tenants=65 is out of range (1 to 64)"
set +e
err=$("$KVF_BIN" bench serve --model "$fx" --workload multiturn-tier --think-s -1 2>&1 >/dev/null); rc=$?
set -e
expect_eq "--think-s -1 exit code" "$rc" 2
expect_contains "--think-s -1 message" "$err" "--think-s=-1 is out of range (0 to 600)"
finish
