#!/usr/bin/env bash
# chat_template.sh: `kvfleet chat-template` renders every qwen3 chat case of ../shared exactly
# (plain and --json with ids), falls back to a built-in family, passes extra keys as variables,
# and names bad input: missing flags, bad files, a template that raises.
. "$(dirname "$0")/lib.sh"
: "${KVF_SHARED:=../shared}"
Q="$KVF_SHARED/fixtures/tokenizers/qwen3"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# one --messages file per case, and its expected prompt and ids, straight from the fixture
n=$(/usr/bin/python3 - "$Q/chat_cases.json" "$tmp" <<'PY'
import json, sys
cases = json.load(open(sys.argv[1]))['cases']
for i, c in enumerate(cases):
    conv = {'messages': c['messages'], 'add_generation_prompt': c['add_generation_prompt']}
    if 'tools' in c:
        conv['tools'] = c['tools']
    conv.update(c.get('extra_context', {}))
    json.dump(conv, open('%s/case%d.json' % (sys.argv[2], i), 'w'))
    open('%s/case%d.want' % (sys.argv[2], i), 'wb').write(c['rendered'].encode())
    open('%s/case%d.ids' % (sys.argv[2], i), 'w').write(','.join(map(str, c['ids'])))
print(len(cases))
PY
)
[ "$n" -ge 6 ] || fail "expected at least 6 chat cases, found $n"
for ((i = 0; i < n; i++)); do
    "$KVF_BIN" chat-template --model "$Q" --messages "$tmp/case$i.json" > "$tmp/case$i.got"
    cmp -s "$tmp/case$i.got" "$tmp/case$i.want" || fail "case $i: prompt differs: $(cat "$tmp/case$i.got")"
    pass "qwen3 case $i prompt"
done
# --json adds the ids (loading the 11 MB tokenizer.json is the slow part: two cases here, all
# of them in tests/unit/model/test_chat_template.c)
for i in 0 $((n - 1)); do
    out=$("$KVF_BIN" chat-template --model "$Q" --messages "$tmp/case$i.json" --json)
    expect_eq "qwen3 case $i ids" "$(json_get "$out" "','.join(map(str, j['ids']))")" "$(cat "$tmp/case$i.ids")"
    expect_eq "qwen3 case $i json prompt" "$(json_get "$out" "j['prompt'] == open('$tmp/case$i.want', encoding='utf-8').read()")" True
done

# standard input, and extra keys as template variables (enable_thinking)
echo '{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true, "enable_thinking": false}' |
    "$KVF_BIN" chat-template --model "$Q" --messages - > "$tmp/stdin.got"
printf '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n' > "$tmp/stdin.want"
cmp -s "$tmp/stdin.got" "$tmp/stdin.want" || fail "stdin + enable_thinking: got $(cat "$tmp/stdin.got")"
pass "stdin + enable_thinking"

# OpenAI text parts: as given, the Qwen3 template cannot use them; joined, it can
echo '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}' > "$tmp/parts.json"
"$KVF_BIN" chat-template --model "$Q" --messages "$tmp/parts.json" --join-text-parts > "$tmp/parts.got"
printf '<|im_start|>user\na\nb<|im_end|>\n' > "$tmp/parts.want"
cmp -s "$tmp/parts.got" "$tmp/parts.want" || fail "joined text parts: got $(cat "$tmp/parts.got")"
pass "joined text parts"

# a model with no template of its own: the family of config.json, or a forced one
mkdir "$tmp/m"
echo '{"model_type": "mistral"}' > "$tmp/m/config.json"
echo '{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}' > "$tmp/conv.json"
expect_eq "built-in mistral" "$("$KVF_BIN" chat-template --model "$tmp/m" --messages "$tmp/conv.json")" "<s>[INST] S

U [/INST]"
out=$("$KVF_BIN" chat-template --model "$Q" --messages "$tmp/conv.json" --family chatml --force-family)
expect_eq "forced chatml" "$out" "<|im_start|>system
S<|im_end|>
<|im_start|>user
U<|im_end|>"

# Mistral 7B ships no template: its family's built-in, its own BOS, its own tokenizer
M="$KVF_SHARED/fixtures/tokenizers/mistral7b"
echo '{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true}' > "$tmp/hi.json"
out=$("$KVF_BIN" chat-template --model "$M" --messages "$tmp/hi.json" --family mistral --json)
expect_eq "mistral7b prompt" "$(json_get "$out" "j['prompt']")" "<s>[INST] hi [/INST]"
expect_eq "mistral7b ids start with BOS" "$(json_get "$out" "j['ids'][0]")" 1
expect_eq "mistral7b ids as tokenize gives" "$(json_get "$out" "','.join(map(str, j['ids']))")" \
    "$("$KVF_BIN" tokenize --model "$M" --text "<s>[INST] hi [/INST]")"

# bad input: a message naming what was wrong, nothing on stdout
set +e
err=$("$KVF_BIN" chat-template --model "$M" --messages "$tmp/hi.json" 2>&1 >/dev/null); rc=$?
expect_contains "no template, no family" "$err" "name a family"
err=$("$KVF_BIN" chat-template --model "$Q" 2>&1 >/dev/null); rc=$?
expect_eq "missing --messages exit code" "$rc" 2
expect_contains "missing --messages" "$err" "missing --messages"
echo '{"messages": "hi"}' > "$tmp/bad.json"
err=$("$KVF_BIN" chat-template --model "$Q" --messages "$tmp/bad.json" 2>&1 >/dev/null); rc=$?
expect_eq "messages not a list exit code" "$rc" 2
expect_contains "messages not a list" "$err" '"messages" must be an array'
echo '{"messages": [' > "$tmp/broken.json"
err=$("$KVF_BIN" chat-template --model "$Q" --messages "$tmp/broken.json" 2>&1 >/dev/null); rc=$?
expect_contains "broken json names the file" "$err" "broken.json"
err=$("$KVF_BIN" chat-template --model "$tmp/m" --messages "$tmp/conv.json" --family gpt2 --force-family 2>&1 >/dev/null); rc=$?
expect_contains "unknown family" "$err" "'gpt2' is not built in"
echo '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}' > "$tmp/twice.json"
out=$("$KVF_BIN" chat-template --model "$tmp/m" --messages "$tmp/twice.json" 2>"$tmp/err"); rc=$?
expect_eq "raise exit code" "$rc" 2
expect_eq "raise prints nothing" "$out" ""
expect_contains "raise message" "$(cat "$tmp/err")" "Conversation roles must alternate"
printf '{"chat_template": "{%% for m in messages %%}\\n{{ m.content | nofilter }}{%% endfor %%}"}' > "$tmp/m/tokenizer_config.json"
err=$("$KVF_BIN" chat-template --model "$tmp/m" --messages "$tmp/conv.json" 2>&1 >/dev/null); rc=$?
expect_eq "template error exit code" "$rc" 1
expect_contains "template error position" "$err" "line 2 col 14: unknown filter 'nofilter'"
set -e
"$KVF_BIN" chat-template --help | grep -q -- "--messages" || fail "--help lists --messages"; pass "--help"
finish
