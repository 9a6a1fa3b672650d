#!/usr/bin/env bash
# plan.sh: `kvfleet plan` reproduces the KV sizing figures of the foundation issue and rejects
# bad input with a message naming what was wrong.
. "$(dirname "$0")/lib.sh"
cfg=examples/llama-3.1-70b/config.json

out=$("$KVF_BIN" plan --config "$cfg" --memory 40G --context 8192 --json)
expect_eq "fp16 bytes/token" "$(json_get "$out" "[d for d in j['dtypes'] if d['dtype']=='f16'][0]['bytes_per_token']")" 327680
expect_eq "fp8 bytes/token" "$(json_get "$out" "[d for d in j['dtypes'] if d['dtype']=='fp8-e4m3'][0]['bytes_per_token']")" 163840
expect_eq "fp8 seqs of 8192 in 40 GiB" "$(json_get "$out" "[d for d in j['dtypes'] if d['dtype']=='fp8-e4m3'][0]['max_seqs']")" 32
out=$("$KVF_BIN" plan --config "$cfg" --memory 40G --context 8193 --dtype fp8 --json)
expect_eq "fp8 seqs of 8193 in 40 GiB" "$(json_get "$out" "j['dtypes'][0]['max_seqs']")" 31

# the same shape given by flags and through the environment
out=$("$KVF_BIN" plan --layers 80 --kv-heads 8 --head-dim 128 --memory 40G --dtype f16 --json)
expect_eq "shape by flags" "$(json_get "$out" "j['dtypes'][0]['bytes_per_token']")" 327680
out=$(KVFLEET_LAYERS=80 KVFLEET_KV_HEADS=8 KVFLEET_HEAD_DIM=128 KVFLEET_DTYPE=f16 "$KVF_BIN" plan --json)
expect_eq "shape by environment" "$(json_get "$out" "j['dtypes'][0]['bytes_per_token']")" 327680
out=$(KVFLEET_LAYERS=80 KVFLEET_KV_HEADS=8 KVFLEET_HEAD_DIM=128 KVFLEET_DTYPE=f16 "$KVF_BIN" plan --layers 40 --json)
expect_eq "flag beats environment" "$(json_get "$out" "j['dtypes'][0]['bytes_per_token']")" 163840

# the table form says the same
out=$("$KVF_BIN" plan --config examples/llama-3.1-70b --memory 40G)
expect_contains "table has fp16 row" "$out" "327680"

# bad input: a message and exit code 2, nothing on stdout
set +e
err=$("$KVF_BIN" plan --layers 80 --kv-heads 8 --head-dim 128 --dtype int4 2>&1 >/dev/null); rc=$?
expect_eq "bad dtype exit code" "$rc" 2
expect_contains "bad dtype message" "$err" "--dtype=int4 is not a KV dtype"
err=$("$KVF_BIN" plan --memory lots 2>&1 >/dev/null); rc=$?
expect_eq "bad size exit code" "$rc" 2
expect_contains "bad size message" "$err" "--memory='lots' is not valid"
err=$("$KVF_BIN" plan --frobnicate 2>&1 >/dev/null); rc=$?
expect_contains "unknown flag" "$err" "unknown flag '--frobnicate'"
err=$("$KVF_BIN" plan 2>&1 >/dev/null); rc=$?
expect_contains "missing shape" "$err" "give --config"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo '{"num_hidden_layers": 80, "num_attention_heads": "many"}' > "$tmp/config.json"
err=$("$KVF_BIN" plan --config "$tmp" 2>&1 >/dev/null); rc=$?
[ "$rc" -ne 0 ] || fail "bad config exit code"; pass "bad config exit code"
expect_contains "bad config names field" "$err" '"num_attention_heads" is a string, expected an integer'
err=$("$KVF_BIN" plan --config "$tmp/missing.json" 2>&1 >/dev/null); rc=$?
expect_contains "missing config names file" "$err" "missing.json"
err=$("$KVF_BIN" plan --layers 80 --kv-heads 8 --head-dim 128 --block-size 24 2>&1 >/dev/null); rc=$?
expect_contains "bad block size" "$err" "block_size 24 is not supported"
set -e
"$KVF_BIN" --help | grep -q "plan" || fail "--help lists plan"; pass "--help lists plan"
"$KVF_BIN" plan --help | grep -q -- "--memory" || fail "plan --help lists --memory"; pass "plan --help"
finish
