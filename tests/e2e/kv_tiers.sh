#!/usr/bin/env bash
# kv_tiers.sh: `kvfleet up --kv-host-memory --kv-disk-dir` with a 16-block pool (the least the
# fixture allows): a long prompt, then two others that push its blocks out of the decode
# worker's pool, then the long prompt again: its prefix comes back from the tiers (the tier hit
# metric rises), and every answer equals `kvfleet generate`'s greedy tokens. Each worker gets its
# own disk directory (DIR/<worker name>, mode 0700); a bad --kv-host-memory is refused naming it.
source "$(dirname "$0")/../cli/lib.sh"
: "${KVF_SHARED:=../shared}"
source "$(dirname "$0")/fleet.sh"
trap cleanup_up EXIT
M="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
N=8

# --- flags: refused with the flag, the value and what is allowed ---------------------------
out=$("$KVF_BIN" decode --model "$M" --kv-host-memory=100 2>&1) && fail "decode took --kv-host-memory=100"
expect_contains "decode: --kv-host-memory below a block is refused" "$out" "--kv-host-memory=100 holds no KV block"
bb=$(printf '%s\n' "$out" | sed -n 's/.*(one is \([0-9]*\) bytes.*/\1/p' | head -1)
[ -n "$bb" ] || fail "no block size in: $out"
out=$("$KVF_BIN" decode --model "$M" --kv-host-memory=1M --kv-disk-dir="$TMP/d" 2>&1) && fail "decode took a disk dir without bytes"
expect_contains "decode: --kv-disk-dir without --kv-disk-bytes is refused" "$out" "needs --kv-disk-bytes"
out=$("$KVF_BIN" decode --model "$M" --kv-host-memory=1M --kv-disk-dir="$TMP/d" --kv-disk-bytes=$((bb + 1)) 2>&1) && fail "decode took --kv-disk-bytes of one block and a byte"
expect_contains "decode: --kv-disk-bytes under one disk slot is refused" "$out" "--kv-disk-bytes=$((bb + 1))"
expect_contains "decode: ... naming the slot as the minimum" "$out" "at least one disk slot"
out=$("$KVF_BIN" decode --model "$M" --kv-host-memory=lots 2>&1) && fail "decode took --kv-host-memory=lots"
expect_contains "decode: --kv-host-memory=lots is refused" "$out" "kv-host-memory"

# --- the fleet -----------------------------------------------------------------------------------
up_serve tiers --model "$M" --prefill 1 --decode 1 --port 0 --kv-blocks=16 --kv-host-memory=1M \
    --kv-disk-dir="$TMP/disk" --kv-disk-bytes=256K
for w in decode-0 prefill-0; do
    [ -f "$TMP/disk/$w/kvfleet-kv-tier.bin" ] || fail "no disk tier file in $TMP/disk/$w: $(ls -R "$TMP/disk")"
    expect_eq "$w: its disk directory is private" "$(stat -c %a "$TMP/disk/$w")" 700
done
ADMIN=$(sed -n 's/.*decode: .* admin HTTP on port \([0-9]*\).*/127.0.0.1:\1/p' "$TMP/tiers.err" | head -1)
[ -n "$ADMIN" ] || fail "no decode admin port in: $(cat "$TMP/tiers.err")"
hits() {
    curl -s "http://$ADMIN/metrics" | awk '$1 ~ /^kvfleet_kv_tier_hit_blocks_total\{role="decode",tier="(host|disk)"\}$/ {s += $2} END {print s + 0}'
}

# prompts: token ids of 160 (long) and 200 (fillers), each its own pattern
ids() { $PY -c "import sys; n, s = int(sys.argv[1]), int(sys.argv[2]); print(','.join(str(3 + (i * 7919 + s * 104729) % 310) for i in range(n)))" "$1" "$2"; }
LONG=$(ids 160 1)
F1=$(ids 200 2)
F2=$(ids 200 3)
complete() {
    $PY - "$URL" "$1" "$N" <<'PYEOF'
import json, sys, urllib.request
url, ids, n = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
body = {"model": "tiny-gqa-f32", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    print(",".join(map(str, json.load(r)["choices"][0]["token_ids"])))
PYEOF
}
reference() {
    local j
    j=$("$KVF_BIN" generate --model "$M" --prompt-ids "$1" --max-tokens "$N" --ignore-eos --json 2>/dev/null) || fail "generate"
    json_get "$j" "','.join(map(str, j['output_ids']))"
}
want=$(reference "$LONG")
got=$(complete "$LONG")
expect_eq "long prompt, cold: the tokens of generate" "$got" "$want"
h0=$(hits)
expect_eq "long prompt, cold: no tier hit yet" "$h0" 0
expect_eq "filler 1: the tokens of generate" "$(complete "$F1")" "$(reference "$F1")"
expect_eq "filler 2: the tokens of generate" "$(complete "$F2")" "$(reference "$F2")"
got=$(complete "$LONG")
expect_eq "long prompt, again: the tokens of generate" "$got" "$want"
h1=$(hits)
[ "$h1" -gt 0 ] || fail "the tier hit metric did not rise ($h0 -> $h1): $(curl -s "http://$ADMIN/metrics" | grep kv_tier)"
pass "long prompt, again: $h1 prefix blocks came back from the tiers"
body=$(curl -s "http://$ADMIN/metrics")
for name in kvfleet_kv_tier_promote_seconds_count kvfleet_kv_tier_used_blocks kvfleet_kv_tier_capacity_blocks \
            kvfleet_kv_tier_demoted_blocks_total kvfleet_kv_tier_promoted_bytes_total; do
    expect_contains "/metrics has $name" "$body" "$name{role=\"decode\",tier=\"host\"}"
done
finish
