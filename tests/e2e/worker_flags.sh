#!/bin/sh
# worker_flags.sh: `kvfleet decode` / `kvfleet prefill` refuse bad flags with a message naming
# the flag, the value and what is allowed (exit 2), and --help lists the role's flags.
set -u
BIN=${KVF_BIN:?KVF_BIN names the kvfleet binary}
M=${KVF_SHARED:-../shared}/fixtures/models/tiny-gqa-f32
fail=0

expect() { # expect CODE TEXT -- command...
    code=$1; text=$2; shift 3
    out=$("$@" 2>&1 </dev/null); rc=$?
    if [ "$rc" != "$code" ]; then echo "FAIL: $* exited $rc, want $code: $out"; fail=1; return; fi
    case $out in *"$text"*) ;; *) echo "FAIL: $*: no \"$text\" in: $out"; fail=1 ;; esac
}

expect 0 "--local-prefill-max-tokens" -- "$BIN" decode --help
expect 0 "--prefill-timeout-ms" -- "$BIN" decode --help
expect 0 "--fault-delay-ms" -- "$BIN" prefill --help
expect 2 "--model DIR is required" -- "$BIN" decode
expect 2 "--kv-dtype=f8 is not supported (use f32, f16 or bf16)" -- "$BIN" decode --model "$M" --kv-dtype=f8
expect 2 "--listen=nowhere is not HOST:PORT" -- "$BIN" prefill --model "$M" --listen nowhere
expect 2 "port \"99999\" is not 0..65535" -- "$BIN" decode --model "$M" --admin-listen 127.0.0.1:99999
expect 2 "--xfer-backend=nccl moves GPU pools: it needs --device cuda" -- "$BIN" decode --model "$M" --xfer-backend nccl
# one name per concept: the old --transport (flag or environment) says what it became
expect 2 "--transport was renamed: use --xfer-backend" -- "$BIN" decode --model "$M" --transport ucx
KVFLEET_TRANSPORT=ucx expect 2 "KVFLEET_TRANSPORT (--transport) was renamed: use KVFLEET_XFER_BACKEND" -- "$BIN" prefill --model "$M"
expect 0 "--xfer-net-devices" -- "$BIN" prefill --help
expect 0 "--xfer-listen" -- "$BIN" decode --help
expect 2 "holds 3 blocks" -- "$BIN" decode --model "$M" --kv-blocks 3
expect 2 "--local-prefill-max-tokens (-1) must be >= 0" -- "$BIN" decode --model "$M" --local-prefill-max-tokens=-1
expect 0 "--attn-decode" -- "$BIN" decode --help
expect 2 "--attn-decode=fast is not known (use auto, simt or mma)" -- "$BIN" decode --model "$M" --attn-decode fast
expect 2 "--log-level=loud is not one of" -- "$BIN" prefill --model "$M" --log-level loud
expect 1 "no-such-model" -- "$BIN" decode --model /nonexistent/no-such-model
# the environment sets flags too
KVFLEET_KV_DTYPE=f4 expect 2 "--kv-dtype=f4 is not supported" -- "$BIN" decode --model "$M"
exit $fail
