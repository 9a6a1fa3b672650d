#!/usr/bin/env bash
# structured.sh: constrained decoding end to end (issue 24). `kvfleet up` (1 prefill + 1 decode
# worker, every prompt prefilled remotely) on a random-weight model speaking Qwen3's tokenizer;
# tests/openai/structured.mjs sends the requests and validates JSON with ajv; pcre2_match checks
# every guided_regex answer with PCRE2; greedy decoding under a schema must give the same text
# through the fleet as `kvfleet generate --json-schema`. Skips (77) without node or ajv.
source "$(dirname "$0")/../cli/lib.sh"
source "$(dirname "$0")/fleet.sh"
need_npm ajv
[ -x "${PCRE2_MATCH:-}" ] || fail "PCRE2_MATCH (the pcre2_match tool) is not set"
trap cleanup_up EXIT

M="$TMP/model"
"$KVF_BIN" gen-model --out "$M" --vocab-size 151936 >/dev/null 2>&1 || fail "gen-model"
cp "$KVF_SHARED/fixtures/tokenizers/qwen3/tokenizer.json" "$KVF_SHARED/fixtures/tokenizers/qwen3/tokenizer_config.json" "$M/" \
    || fail "the Qwen3 tokenizer fixture"
# the model ends where Qwen3's tokenizer does (<|im_end|>, <|endoftext|>), as a real Qwen3 does
"$PY" - "$M" <<'PYEOF' || fail "config.json's eos"
import json, sys
p = sys.argv[1] + "/config.json"
c = json.load(open(p))
c["eos_token_id"] = [151645, 151643]
json.dump(c, open(p, "w"))
PYEOF

# greedy under a schema: kvfleet generate in one process, no router
SCHEMA="$TMP/nested.json"
"$PY" - "$SCHEMA" <<'PYEOF' || fail "the schema file"
import json, sys
schema = {"type": "object", "properties": {
    "id": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["id", "tags", "address"], "additionalProperties": False}
json.dump(schema, open(sys.argv[1], "w"))
PYEOF
"$KVF_BIN" generate --model "$M" --prompt-ids 5,17,33 --max-tokens 200 --json-schema "@$SCHEMA" --json \
    >"$TMP/gen.json" 2>"$TMP/gen.err" || { cat "$TMP/gen.err" >&2; fail "generate --json-schema"; }

up_serve up --model "$M" --port 0 --prefill 1 --decode 1 --local-prefill-max-tokens 0
echo "fleet at $URL"
mkdir -p "$TMP/out"
node "$NODE_DIR/structured.mjs" "$URL" model "$TMP/out" || { tail -20 "$TMP/up.err" >&2; fail "structured output cases"; }
pass "structured output cases"

# every guided_regex answer matches its regex under PCRE2
for re in "$TMP"/out/regex-*.re; do
    txt="${re%.re}.txt"
    "$PCRE2_MATCH" "$(cat "$re")" "$txt" 100 >"$TMP/pcre2.out" || { cat "$TMP/pcre2.out" >&2; fail "PCRE2: $(cat "$re")"; }
    pass "PCRE2: $(tail -1 "$TMP/pcre2.out")"
done

# greedy: the fleet's text is generate's tokens, detokenized by the router
ids=$("$PY" -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["output_ids"]))' "$TMP/gen.json")
curl -s "$URL/detokenize" -H 'Content-Type: application/json' -d "{\"model\":\"model\",\"tokens\":$ids}" >"$TMP/detok.json"
want=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["prompt"], end="")' "$TMP/detok.json")
got=$(cat "$TMP/out/greedy.txt")
# generate's ids end with the end token the guide allowed; the fleet's text leaves it out
want=${want%<|im_end|>}; want=${want%<|endoftext|>}
expect_eq "greedy under a schema: the fleet's text is kvfleet generate's" "$got" "$want"

kill -TERM "$UP"
for _ in $(seq 600); do kill -0 "$UP" 2>/dev/null || break; sleep 0.1; done
wait "$UP" && rc=0 || rc=$?
expect_eq "kvfleet up stops with status 0 on SIGTERM" "$rc" 0
finish
