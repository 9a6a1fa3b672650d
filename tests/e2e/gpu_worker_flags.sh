#!/bin/sh
# gpu_worker_flags.sh (label cli, runs without a GPU): `kvfleet decode|prefill --device cuda`
# with no usable GPU fails at once naming the flag and why; a device pool with a host-only
# transport (plain ucx, local), cuda_ipc or nccl on a host pool, staging without a GPU or with a
# GPU-to-GPU backend are refused before any model or GPU is touched; nccl with a device pool is
# accepted (it then needs the GPU); up and bench serve refuse an unknown --device.
set -u
BIN=${KVF_BIN:?KVF_BIN names the kvfleet binary}
M=${KVF_SHARED:-../shared}/fixtures/models/tiny-gqa-f32
fail=0
n=0

expect() { # expect CODE TEXT -- command...   (CODE "nz": any non-zero exit)
    code=$1; text=$2; shift 3
    out=$(timeout 60 "$@" 2>&1 </dev/null); rc=$?
    n=$((n + 1))
    if [ "$code" = nz ] && [ "$rc" = 0 -o "$rc" = 124 ]; then
        echo "FAIL: $* exited $rc, want non-zero: $out"; fail=1; return
    elif [ "$code" != nz ] && [ "$rc" != "$code" ]; then
        echo "FAIL: $* exited $rc, want $code: $out"; fail=1; return
    fi
    case $out in *"$text"*) echo "ok: $* -> $rc";; *) echo "FAIL: $*: no \"$text\" in: $out"; fail=1 ;; esac
}

# --help lists the new flags
expect 0 "--device" -- "$BIN" decode --help
expect 0 "--xfer-gpu-staging" -- "$BIN" prefill --help
expect 0 "--xfer-backend" -- "$BIN" decode --help
expect 0 "--device" -- "$BIN" up --help
expect 0 "--device" -- "$BIN" bench serve --help

# a device pool needs a transport that reaches GPU memory (refused from the flags alone)
expect 2 "--device cuda keeps the KV pool in GPU memory and --xfer-backend=ucx moves host memory only" -- \
    "$BIN" decode --model "$M" --device cuda --xfer-backend ucx
expect 2 "--xfer-gpu-staging" -- "$BIN" decode --model "$M" --device cuda --xfer-backend ucx
expect 2 "--xfer-backend=local copies host memory (use cuda_ipc" -- \
    "$BIN" prefill --model "$M" --device cuda --xfer-backend local
expect 2 "--xfer-backend=cuda_ipc moves GPU pools: it needs --device cuda" -- \
    "$BIN" decode --model "$M" --xfer-backend cuda_ipc
expect 2 "--xfer-gpu-staging needs --device cuda" -- "$BIN" prefill --model "$M" --xfer-gpu-staging
expect 2 "--xfer-gpu-staging is for --xfer-backend=ucx" -- \
    "$BIN" decode --model "$M" --device cuda --xfer-backend cuda_ipc --xfer-gpu-staging
expect 2 "--xfer-backend=nccl moves GPU pools: it needs --device cuda (NCCL sends and receives device memory only" -- \
    "$BIN" decode --model "$M" --xfer-backend nccl
expect 2 "--xfer-gpu-staging is for --xfer-backend=ucx (nccl moves GPU to GPU)" -- \
    "$BIN" prefill --model "$M" --device cuda --xfer-backend nccl --xfer-gpu-staging
# the notice channel's address: an IPv4 peers can reach, and only for the GPU-to-GPU backends
expect 2 "--xfer-notice-host=node-7 is not an IPv4 address peers can connect to" -- \
    "$BIN" prefill --model "$M" --device cuda --xfer-backend nccl --xfer-notice-host node-7
expect 2 "--xfer-notice-host=0.0.0.0 is not an IPv4 address" -- \
    "$BIN" decode --model "$M" --device cuda --xfer-notice-host 0.0.0.0
expect 2 "--xfer-notice-host is for cuda_ipc and nccl (the transport is ucx)" -- \
    "$BIN" decode --model "$M" --xfer-notice-host 10.0.0.7
expect 2 "--xfer-backend=tcp is not supported (use auto, ucx, cuda_ipc, nccl or local)" -- \
    "$BIN" decode --model "$M" --xfer-backend tcp
expect 2 "--device=tpu is not known (use cpu or cuda)" -- "$BIN" decode --model "$M" --device tpu
# the environment sets them too
KVFLEET_DEVICE=cuda KVFLEET_XFER_BACKEND=ucx expect 2 "moves host memory only" -- "$BIN" prefill --model "$M"
expect 2 "up: --device=tpu is not known (use cpu or cuda)" -- "$BIN" up --device tpu
expect 2 "--device=tpu is not known (use cpu or cuda)" -- "$BIN" bench serve --device tpu

# --device cuda with a transport that fits: fails at once without a GPU (skipped where one is)
if "$BIN" generate --model "$M" --prompt-ids 1 --max-tokens 1 --device cuda >/dev/null 2>&1; then
    echo "note: this machine has a GPU: the no-GPU cases are left to machines without one"
else
    expect nz "decode: --device cuda: " -- "$BIN" decode --model "$M" --device cuda
    expect nz "prefill: --device cuda: " -- "$BIN" prefill --model "$M" --device cuda --xfer-backend cuda_ipc
    # nccl with a device pool passes the flag checks and then needs the GPU like the others
    expect nz "decode: --device cuda: " -- "$BIN" decode --model "$M" --device cuda --xfer-backend nccl
    expect nz "decode: --device cuda: " -- "$BIN" decode --model "$M" --device cuda --xfer-backend ucx --xfer-gpu-staging
    # up passes --device to every worker and stops the fleet when they refuse it
    expect nz "died before it was ready" -- "$BIN" up --device cuda --model "$M" --port 0
fi
[ $fail = 0 ] && echo "$n checks passed"
exit $fail
