#!/usr/bin/env bash
# tokenize.sh: `kvfleet tokenize` encodes and decodes with the shared Qwen3 and Mistral 7B
# tokenizers (expected ids from their cases.json), prints --json, reads stdin, and names bad
# input and bad files.
. "$(dirname "$0")/lib.sh"
: "${KVF_SHARED:=../shared}"
T="$KVF_SHARED/fixtures/tokenizers"

# expected ids straight from the fixtures
case_field() { /usr/bin/python3 -c "import json,sys; c=[c for c in json.load(open(sys.argv[1]))['cases'] if c['id']==sys.argv[2]][0]; v=c[sys.argv[3]]; print(','.join(map(str,v)) if isinstance(v,list) else v, end='')" "$@"; }

text=$(case_field "$T/qwen3/cases.json" qwen3-050 text)
out=$("$KVF_BIN" tokenize --model "$T/qwen3" --text "$text")
expect_eq "qwen3 chatml text" "$out" "$(case_field "$T/qwen3/cases.json" qwen3-050 ids)"

text=$(case_field "$T/mistral7b/cases.json" mistral7b-002 text)
out=$("$KVF_BIN" tokenize --tokenizer "$T/mistral7b/tokenizer.json" --text "$text" --special)
expect_eq "mistral7b with BOS" "$out" "$(case_field "$T/mistral7b/cases.json" mistral7b-002 ids_with_special)"
out=$("$KVF_BIN" tokenize --model "$T/mistral7b" --text "$text")
expect_eq "mistral7b without BOS" "$out" "$(case_field "$T/mistral7b/cases.json" mistral7b-002 ids)"

# decode, plain and --json
out=$("$KVF_BIN" tokenize --model "$T/mistral7b" --ids 1,22557)
expect_eq "mistral7b decode keeps <s>" "$out" "<s> Hello"
out=$("$KVF_BIN" tokenize --model "$T/mistral7b" --ids 1,22557 --skip-special)
expect_eq "mistral7b decode skips <s>" "$out" "Hello"
out=$("$KVF_BIN" tokenize --model "$T/qwen3" --ids "9707, 1879" --json)
expect_eq "qwen3 decode json text" "$(json_get "$out" "j['text']")" "Hello world"
expect_eq "qwen3 decode json ids" "$(json_get "$out" "j['ids']")" "[9707, 1879]"
out=$("$KVF_BIN" tokenize --model "$T/qwen3" --text "Hello world" --json)
expect_eq "qwen3 encode json" "$(json_get "$out" "j['ids']")" "[9707, 1879]"
out=$(printf 'Hello world' | "$KVF_BIN" tokenize --model "$T/qwen3" --text -)
expect_eq "text from stdin" "$out" "9707,1879"

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# bad input: a message naming it, exit code 2 for usage, 1 for a bad file
set +e
err=$("$KVF_BIN" tokenize --model "$T/qwen3" --ids 1,x 2>&1 >/dev/null); rc=$?
expect_eq "bad id exit code" "$rc" 2
expect_contains "bad id message" "$err" "'x' is not a token id"
err=$("$KVF_BIN" tokenize --model "$T/qwen3" --ids 999999 2>&1 >/dev/null); rc=$?
expect_contains "id out of range" "$err" "id 999999"
err=$("$KVF_BIN" tokenize --text hi 2>&1 >/dev/null); rc=$?
expect_eq "no tokenizer exit code" "$rc" 2
expect_contains "no tokenizer message" "$err" "--model DIR and --tokenizer FILE"
err=$("$KVF_BIN" tokenize --model "$T/qwen3" 2>&1 >/dev/null); rc=$?
expect_contains "neither text nor ids" "$err" "--text TEXT"
echo '{"model": {"type": "Unigram", "vocab": []}}' > "$tmp/tokenizer.json"
err=$("$KVF_BIN" tokenize --model "$tmp" --text hi 2>&1 >/dev/null); rc=$?
expect_eq "unsupported file exit code" "$rc" 1
expect_contains "unsupported file names it" "$err" "$tmp/tokenizer.json"
expect_contains "unsupported file says what" "$err" '"model.type" is "Unigram"'
err=$("$KVF_BIN" tokenize --model "$T/qwen3" --text $'bad \xff byte' 2>&1 >/dev/null); rc=$?
expect_contains "invalid UTF-8 text" "$err" "not valid UTF-8 at byte 4"
set -e
"$KVF_BIN" tokenize --help | grep -q -- "--skip-special" || fail "tokenize --help"; pass "tokenize --help"
finish
