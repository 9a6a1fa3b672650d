# lib.sh: what the CLI shell tests share. Source it; KVF_BIN names the kvfleet binary.
set -euo pipefail
: "${KVF_BIN:?KVF_BIN must name the kvfleet binary}"
n_pass=0
fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { n_pass=$((n_pass + 1)); echo "ok: $*"; }
# expect_eq WHAT GOT WANT
expect_eq() { [ "$2" = "$3" ] || fail "$1: got '$2', want '$3'"; pass "$1"; }
# expect_contains WHAT HAYSTACK NEEDLE
expect_contains() { case "$2" in *"$3"*) pass "$1";; *) fail "$1: '$3' not in: $2";; esac; }
# json_get JSON PY_EXPR: evaluates a Python expression over the parsed object `j`
json_get() { /usr/bin/python3 -c "import json,sys; j=json.loads(sys.argv[1]); print($2)" "$1"; }
finish() { echo "$n_pass passed, 0 failed"; }
