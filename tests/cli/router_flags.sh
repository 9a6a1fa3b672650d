#!/usr/bin/env bash
# router_flags.sh: `kvfleet router`'s kv policy flags (issue 22): --help lists them with their
# defaults, each bad value is refused with exit code 2 and a message naming the flag, the value
# and what is allowed, and `kvfleet up` passes them on: the router of `kvfleet up --approx
# --policy=kv` says at start that it runs approximate, and routes a request.
. "$(dirname "$0")/lib.sh"
tmp=$(mktemp -d); up_pid=
trap '[ -n "$up_pid" ] && kill -INT "$up_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
fx="$KVF_SHARED/fixtures/models/tiny-gqa-f32"
[ -f "$fx/config.json" ] || fail "fixture model $fx is missing"

help=$("$KVF_BIN" router --help)
for f in "--load-bound=VALUE .*(default 1.1)" "--load-window=VALUE .*(default 1800)" \
         "--load-penalty=VALUE .*(default 0.5)" "--host-promote-s-per-block=VALUE .*(default 0.0001048576)" \
         "--disk-promote-s-per-block=VALUE .*(default 0.0004194304)" "--approx  .*(default false)" \
         "--approx-ttl=VALUE .*(default 3600)"; do
    echo "$help" | grep -qE -- "$f" || fail "router --help lacks $f"
    pass "router --help: $f"
done

# bad values: refused before anything starts (no worker is reached at 127.0.0.1:9)
refused() { # refused WHAT MESSAGE FLAGS...
    local what=$1 msg=$2; shift 2
    set +e
    err=$("$KVF_BIN" router --decode=127.0.0.1:9 --model "$fx" "$@" 2>&1 >/dev/null); rc=$?
    set -e
    expect_eq "$what exit code" "$rc" 2
    expect_contains "$what message" "$err" "$msg"
}
refused "load bound below 1" "--load-bound=0.5 is out of range (0 = off, or a finite number >= 1)" --load-bound 0.5
refused "negative load bound" "--load-bound=-1 is out of range" --load-bound=-1
refused "zero window" "--load-window=0 is out of range (seconds, finite and > 0)" --load-window=0
refused "negative penalty" "--load-penalty=-0.5 is out of range (finite and >= 0)" --load-penalty=-0.5
refused "negative host price" "--host-promote-s-per-block=-1 is out of range (seconds, finite and >= 0)" --host-promote-s-per-block=-1
refused "negative disk price" "--disk-promote-s-per-block=-0.5 is out of range (seconds, finite and >= 0)" --disk-promote-s-per-block=-0.5
refused "infinite disk price" "--disk-promote-s-per-block='inf' is not valid" --disk-promote-s-per-block=inf
refused "zero approx ttl" "--approx-ttl=0 is out of range (seconds, finite and > 0)" --approx-ttl=0
refused "not a number" "--load-window='soon' is not valid" --load-window=soon
refused "approx without kv" "--approx goes with --policy=kv (not round-robin)" --approx --policy=round-robin
# the environment too
set +e
err=$(KVFLEET_LOAD_BOUND=0.9 "$KVF_BIN" router --decode=127.0.0.1:9 --model "$fx" 2>&1 >/dev/null); rc=$?
set -e
expect_eq "KVFLEET_LOAD_BOUND exit code" "$rc" 2
expect_contains "KVFLEET_LOAD_BOUND message" "$err" "--load-bound=0.9 is out of range"

# kvfleet up forwards the router's flags
"$KVF_BIN" up --model "$fx" --prefill 0 --decode 1 --port 0 --approx --policy=kv --approx-ttl 600 \
    --load-bound 1.5 >"$tmp/up.out" 2>&1 &
up_pid=$!
url=
for _ in $(seq 1 600); do
    url=$(grep -oE "at http://127\.0\.0\.1:[0-9]+" "$tmp/up.out" | head -1 | sed 's/^at //') || true
    [ -n "$url" ] && break
    kill -0 "$up_pid" 2>/dev/null || { cat "$tmp/up.out" >&2; fail "kvfleet up exited before it was ready"; }
    sleep 0.1
done
[ -n "$url" ] || { cat "$tmp/up.out" >&2; fail "kvfleet up was not ready in 60 s"; }
expect_contains "up: the router runs kv, approximate" "$(cat "$tmp/up.out")" \
    "router: policy kv, approximate: workers' caches predicted from this router's decisions (TTL 600 s"
expect_contains "up: the router's load bound" "$(cat "$tmp/up.out")" "load bound 1.5 over 1800 s"
# a 40-token prompt is routed, and its two full blocks are in the index (predicted)
prompt=$(seq -s, 1 40)
ans=$(curl -sf "$url/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"tiny-gqa-f32\", \"prompt\": [$prompt], \"max_tokens\": 2}")
expect_contains "up: a completion" "$ans" '"text_completion"'
metrics=$(curl -sf "$url/metrics")
expect_contains "up: predicted blocks in the index" "$metrics" 'kvfleet_router_index_blocks{role="decode"} 2'
expect_contains "up: predicted blocks in the pool tier" "$metrics" 'kvfleet_router_index_worker_blocks{role="decode",tier="pool"} 2'
expect_contains "up: none in the host tier" "$metrics" 'kvfleet_router_index_worker_blocks{role="decode",tier="host"} 0'
kill -INT "$up_pid"; wait "$up_pid" || true; up_pid=
finish
