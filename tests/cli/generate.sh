#!/usr/bin/env bash
# generate.sh: `kvfleet generate` runs through the engine: a seed fixes sampled tokens, another
# seed changes them, temperature 0 reproduces a fixture's greedy list (also with --profile, whose
# tables it checks), and bad sampling flags are refused with a message. Issue 23's flags: per-token
# logprobs (the greedy token is the top one, with its own logprob), prompt logprobs (one a prompt
# token, the first null), a repeatable --logit-bias that forces a token, penalties that change a
# repeating greedy run, and their bad values named.
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

# --logprobs N and --prompt-logprobs: the greedy tokens are unchanged, each is its step's top
# entry (same logprob), N entries sorted; a row per prompt token, the first null
lp=$("$KVF_BIN" generate --model "$fx" --prompt-ids "$ids1" --max-tokens "$n" --ignore-eos --json --logprobs 3 --prompt-logprobs 2>/dev/null)
expect_eq "logprobs keep the greedy tokens" "$(json_get "$lp" "j['output_ids']")" "$want1"
expect_eq "greedy token is the top logprob" "$(json_get "$lp" "all(e['top'][0]['token'] == e['token'] and e['top'][0]['logprob'] == e['logprob'] and len(e['top']) == 3 and e['top'][0]['logprob'] >= e['top'][1]['logprob'] >= e['top'][2]['logprob'] and e['logprob'] < 0 for e in j['logprobs'])")" True
expect_eq "a logprob per token" "$(json_get "$lp" "len(j['logprobs']) == len(j['output_ids'])")" True
expect_eq "prompt logprobs" "$(json_get "$lp" "j['prompt_logprobs'][0] is None and len(j['prompt_logprobs']) == len(j['prompt_ids']) and all(e['token'] == t for e, t in zip(j['prompt_logprobs'][1:], j['prompt_ids'][1:]))")" True
# --logit-bias, repeated: +100 forces a token, the other entry is parsed too
forced=$(( ($(json_get "$lp" "j['output_ids'][0]") + 37) % 320 ))
lb=$("$KVF_BIN" generate --model "$fx" --prompt-ids "$ids1" --max-tokens 4 --ignore-eos --json --logit-bias "$forced:100" --logit-bias 3:-100,4:2 2>/dev/null)
expect_eq "logit-bias forces a token" "$(json_get "$lp" "[$forced] * 4")" "$(json_get "$lb" "j['output_ids']")"
# penalties change a run whose greedy list repeats (the fixture's single-token case)
ids0=$(json_get "$(cat "$fx/expected.json")" "','.join(map(str, j['cases'][0]['prompt']))")
pen=$("$KVF_BIN" generate --model "$fx" --prompt-ids "$ids0" --max-tokens "$n" --ignore-eos --json --frequency-penalty 1.5 --presence-penalty 0.5 --repetition-penalty 1.2 2>/dev/null)
[ "$(json_get "$pen" "j['output_ids']")" != "$want" ] || fail "penalties change a repeating run"
pass "penalties change a repeating run"

# text streams to a terminal-less stdout too, ending with a newline
out=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hi" --max-tokens 4 --ignore-eos 2>/dev/null)
[ -n "$out" ] || fail "text output"; pass "text output"

set +e
err=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hi" --top-p 1.5 2>&1 >/dev/null); rc=$?
expect_eq "bad top-p exit code" "$rc" 2
expect_contains "bad top-p message" "$err" "--top-p (1.5) in (0, 1]"
err=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hi" --logprobs 21 2>&1 >/dev/null); rc=$?
expect_eq "bad logprobs exit code" "$rc" 2
expect_contains "bad logprobs message" "$err" "--logprobs=21 is not allowed (0 to 20"
err=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hi" --logit-bias 5 2>&1 >/dev/null)
expect_contains "bad logit-bias message" "$err" "--logit-bias=5 is not allowed (use ID:BIAS"
err=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hi" --presence-penalty 3 2>&1 >/dev/null)
expect_contains "bad presence-penalty message" "$err" "presence_penalty 3 is not allowed (-2 to 2)"
err=$("$KVF_BIN" generate --model "$tmp/m" --prompt "Hi" --min-p 1.5 2>&1 >/dev/null)
expect_contains "bad min-p message" "$err" "min_p 1.5 is not allowed (0 to 1)"
err=$("$KVF_BIN" generate --model "$tmp/m" --prompt-ids 1,99999 2>&1 >/dev/null); rc=$?
expect_contains "token outside vocabulary" "$err" "outside the vocabulary"
set -e
finish
