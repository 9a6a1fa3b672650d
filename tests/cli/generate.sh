#!/usr/bin/env bash
# generate.sh: `kvfleet generate` runs through the engine: a seed fixes sampled tokens, another
# seed changes them, temperature 0 reproduces a fixture's greedy list (also with --profile, whose
# tables it checks), and bad sampling flags are refused with a message.
. "$(dirname "$0")/lib.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$KVF_BIN" gen-model --out "$tmp/m" --preset tiny >/dev/null

a=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hello there" --max-tokens 16 --ignore-eos --temperature 0.9 --seed 7 --json 2>/dev/null)
b=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hello there" --max-tokens 16 --ignore-eos --temperature 0.9 --seed 7 --json 2>/dev/null)
c=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hello there" --max-tokens 16 --ignore-eos --temperature 0.9 --seed 8 --json 2>/dev/null)
expect_eq "same seed, same tokens" "$(json_get "$a" "j['output_ids']")" "$(json_get "$b" "j['output_ids']")"
[ "$(json_get "$a" "j['output_ids']")" != "$(json_get "$c" "j['output_ids']")" ] || fail "another seed changes the tokens"
pass "another seed changes the tokens"
expect_eq "16 tokens" "$(json_get "$a" "len(j['output_ids'])")" 16

fx="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
ids=$(json_get "$(cat "$fx/expected.json")" "','.join(map(str, j['cases'][0]['prompt']))")
want=$(json_get "$(cat "$fx/expected.json")" "j['cases'][0]['greedy']")
n=$(json_get "$(cat "$fx/expected.json")" "j['n_new']")
got=$("$KVF_BIN" generate --model "$fx" --prompt-ids "$ids" --max-tokens "$n" --ignore-eos --temperature 0 --json 2>/dev/null)
expect_eq "greedy equals the fixture" "$(json_get "$got" "j['output_ids']")" "$want"

# --profile: the same tokens, and a table per kind of step on stderr
# (case 1: a 5-token prompt, so one step has a prefill chunk)
ids1=$(json_get "$(cat "$fx/expected.json")" "','.join(map(str, j['cases'][1]['prompt']))")
want1=$(json_get "$(cat "$fx/expected.json")" "j['cases'][1]['greedy']")
prof=$("$KVF_BIN" generate --model "$fx" --prompt-ids "$ids1" --max-tokens "$n" --ignore-eos --temperature 0 --json --profile 2>"$tmp/prof.err")
expect_eq "profiled greedy equals the fixture" "$(json_get "$prof" "j['output_ids']")" "$want1"
perr=$(cat "$tmp/prof.err")
expect_contains "profile of the decode steps" "$perr" "kvfleet: profile of $((n - 1)) decode steps on cpu, op by op"
expect_contains "profile of the prefill" "$perr" "kvfleet: profile of 1 step with prefill chunks on cpu"
grep -Eq "^  attention +2\.0 +[0-9.]+ +[0-9.]+% +[0-9.]+$" "$tmp/prof.err" || fail "profile: an attention row, 2 calls a step (2 layers)"
pass "profile: an attention row"

# text streams to a terminal-less stdout too, ending with a newline
out=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hi" --max-tokens 4 --ignore-eos 2>/dev/null)
[ -n "$out" ] || fail "text output"; pass "text output"

set +e
err=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hi" --top-p 1.5 2>&1 >/dev/null); rc=$?
expect_eq "bad top-p exit code" "$rc" 2
expect_contains "bad top-p message" "$err" "--top-p (1.5) in (0, 1]"
err=$("$KVF_BIN" generate --model "$tmp/m" --prompt-ids 1,99999 2>&1 >/dev/null); rc=$?
expect_contains "token outside vocabulary" "$err" "outside the vocabulary"
set -e
finish
