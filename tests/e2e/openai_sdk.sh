#!/usr/bin/env bash
# openai_sdk.sh: `kvfleet up` (1 prefill + 1 decode worker, a generated model with a tokenizer and
# a chat template, an API key, CORS for one origin with credentials) driven by the official
# `openai` npm client: tests/openai/sdk.mjs holds the cases (models, completions and chat plain
# and streamed, errors as the SDK's classes, /tokenize and /detokenize, CORS). Skips (77) when
# node or the SDK is missing: scripts/install-deps.sh installs it (npm ci in tests/openai).
# SDK_CASE=substring runs only the cases whose name has it. Every process is killed on exit.
source "$(dirname "$0")/../cli/lib.sh"
source "$(dirname "$0")/fleet.sh"
need_npm openai
SDK=$NODE_DIR
trap cleanup_up EXIT

# A tiny random model speaking Qwen3's tokenizer and chat template (the fixture's), so tools,
# tool messages and the hermes tool-call parser run through a real template.
M="$TMP/sdk-model"
"$KVF_BIN" gen-model --out "$M" --vocab-size 151936 >/dev/null 2>&1 || fail "gen-model"
cp "$KVF_SHARED/fixtures/tokenizers/qwen3/tokenizer.json" "$KVF_SHARED/fixtures/tokenizers/qwen3/tokenizer_config.json" "$M/" \
    || fail "the Qwen3 tokenizer fixture"
# The engine's own answers (kvfleet generate, one process, no router) for the cases that check
# the fleet honours issue 23's parameters exactly: {name: generate --json} in one file.
PIDS_GEN=(5,17,33,2,250,9,61,77)
gen() { # NAME FLAGS...
    local name=$1; shift
    printf '%s"%s":' "$SEP" "$name" >>"$TMP/gen.json"
    "$KVF_BIN" generate --model "$M" --prompt-ids "${PIDS_GEN[0]}" --max-tokens 10 --json "$@" 2>>"$TMP/gen.err" \
        >>"$TMP/gen.json" || { cat "$TMP/gen.err" >&2; fail "generate $name"; }
    SEP=,
}
SEP=; printf '{' >"$TMP/gen.json"
gen plain --logprobs 5 --prompt-logprobs
gen frequency --frequency-penalty 1.5
gen presence --presence-penalty 1.5
gen repetition --repetition-penalty 1.8
gen bias --logit-bias 7:100,9:-100
printf '}' >>"$TMP/gen.json"
export KVF_GEN_JSON="$TMP/gen.json" KVF_GEN_PROMPT="${PIDS_GEN[0]}" KVF_MODEL_DIR="$M"
KEY=sk-sdk-test-0123
ORIGIN=https://app.example.com
up_serve up --model "$M" --port 0 --prefill 1 --decode 1 --api-key "$KEY" --allowed-origins "$ORIGIN" --allow-credentials
echo "fleet at $URL"
node "$SDK/sdk.mjs" "$URL" sdk-model "$KEY" "$ORIGIN" "${SDK_CASE:-}" || { tail -20 "$TMP/up.err" >&2; fail "openai SDK cases"; }
grep -q "$KEY" "$TMP/up.err" && fail "the API key reached the log"
pass "openai SDK cases"
kill -TERM "$UP"
for _ in $(seq 600); do kill -0 "$UP" 2>/dev/null || break; sleep 0.1; done
wait "$UP" && rc=0 || rc=$?
expect_eq "kvfleet up stops with status 0 on SIGTERM" "$rc" 0
finish
