#!/usr/bin/env bash
# gpu-run.sh: runs the bundle scripts/gpu-bundle.sh made (.gpu/bundle.tar.xz) ON the lent GPU
# machine, from the repository root: unpacks it, makes the absolute paths the build expects,
# checks every carried binary's libraries with ldd, then runs one phase. Usage, through the
# device tool: run(carry=[".gpu"], timeout_s=600, command="bash scripts/gpu-run.sh PHASE")
#
# Phases (each bounds its own steps with `timeout`, ends with SUMMARY lines; run `tests` first:
# bench figures mean nothing before the kernels are known to be right):
#   tests  ctest -L gpu (6 tests: cuda_{attn,device,models,ops}, transport_gpu_xfer,
#          e2e_gpu_disagg) -> $OUT/gpu-tests.log, $OUT/ctest-LastTest.log. 31-36 s on an H200
#          (2026-11-28); bounded at 540 s. Exit status: ctest's.
#   bench  kvfleet bench attn (full grid, every case on the simt and the mma decode kernel and
#          a bare read of the same bytes, bounded 240 s) then bench/attn_torch.py (full grid,
#          bounded 200 s), then prefill chunks of 512, tiled vs per token (kvfleet bench attn
#          --chunk 512, batches 1 and 4, bounded 100 s), then a decode worker's mixed step (one
#          32-token chunk beside 64 decode sequences, bounded 60 s; not in `all`)
#          -> $OUT/bench-attn.log. 30-37 s on an H200.
#   tiles  only the prefill-chunk parts of bench (--chunk 512, then the mixed step): for a change
#          to the tile kernels. Under a minute.
#   serve  gen-model --preset 1b --dtype bf16 (bounded 100 s), bench serve --device cuda:
#          colocated vs disaggregated over cuda_ipc, short and long prompts (docs/BENCHMARKS.md
#          "GPU end to end"; bounded 360 s), single-stream generate with bf16 KV on the simt
#          and on the mma decode kernel (bounded 60 s each), then one with --profile (where a
#          decode step's time goes, op by op; bounded 60 s)
#          -> $OUT/bench-serve.log, $OUT/serve-fleet-logs.tar.gz. About 100 s on an H200.
#   all    tests (bounded 300 s) then bench with --quick grids (90 s + 90 s + 60 s): under
#          10 min.
#   lease  everything in one call, for a 15-minute device lease (one machine start): tests
#          (bounded 150 s, 100 s a test), bench with --quick grids (kvfleet 50 s, torch 45 s,
#          prefill tiles 40 s, mixed step 25 s), then serve with KVF_GPU_SERVE_REQUESTS (default
#          here 40) and bounds 60 s (gen-model), 150 s (bench serve), 25 s (each generate): at most
#          ~595 s with set-up; give the call timeout_s=600 (a cut-off call still returns $OUT).
#          93 s on an H200, plus about 30 s to start the machine: with a 15-minute lease, run
#          `lease` first, then `bench` and `serve` at full size in a second call.
# Set-up takes 1-3 s (unpack, ldd). Exits 2 when the set-up fails (missing libraries,
# a path in the way). Environment: OUT (default /tmp/gpu-out), KVF_GPU_DIR (where to unpack,
# default /tmp/kvf-gpu), KVF_GPU_ARCHIVE, KVF_GPU_SERVE_REQUESTS (default 160),
# KVF_GPU_SERVE_PRESET (gen-model preset, default 1b; tiny for a quick check of the phase),
# KVF_GPU_ATTN_DECODE (the fleet's --attn-decode in serve: auto (default), simt or mma; the
# single-stream generate runs both simt and mma),
# KVF_GPU_RUN_NO_LINK=1 (use existing /work/main/build-gpu and /work/shared as they are: on the
# development machine, where they are real folders holding the same build).
set -uo pipefail
PHASE=${1:-}
case "$PHASE" in
tests | bench | tiles | serve | all | lease) ;;
*)
    echo "usage: scripts/gpu-run.sh tests|bench|tiles|serve|all|lease (see the header of this script)" >&2
    exit 2 ;;
esac
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd -P)
OUT=${OUT:-/tmp/gpu-out}
DEST=${KVF_GPU_DIR:-/tmp/kvf-gpu}
ARCHIVE=${KVF_GPU_ARCHIVE:-$REPO/.gpu/bundle.tar.xz}
mkdir -p "$OUT" || exit 2
T0=$SECONDS
say() { echo "gpu-run: $*"; }
die() { echo "gpu-run: error: $*" >&2; exit 2; }
secs() { echo "$((SECONDS - $1)) s"; }

# --- unpack (skipped when this archive is already unpacked there, on a warm machine) ----------
[ -f "$ARCHIVE" ] || die "$ARCHIVE is missing: run scripts/gpu-bundle.sh on the development machine and carry .gpu"
sum=$(sha256sum "$ARCHIVE" | cut -d' ' -f1)
if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$sum" ]; then
    say "$ARCHIVE already unpacked in $DEST"
else
    t=$SECONDS
    rm -rf "$DEST"
    mkdir -p "$DEST" || die "cannot make $DEST"
    if command -v xz >/dev/null; then
        tar -C "$DEST" -xJf "$ARCHIVE" || die "tar -xJf $ARCHIVE failed"
    else # no xz on the device: python's tarfile reads xz itself
        python3 -c '
import sys, tarfile
t = tarfile.open(sys.argv[1])
t.extractall(sys.argv[2], **({"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}))
' "$ARCHIVE" "$DEST" || die "unpacking $ARCHIVE with python3 failed"
    fi
    echo "$sum" >"$DEST/.stamp"
    say "unpacked $ARCHIVE ($(du -sh "$ARCHIVE" | cut -f1)) into $DEST in $(secs "$t")"
fi
head -1 "$DEST/MANIFEST.txt"
# shellcheck source=/dev/null
. "$DEST/bundle.env" || die "$DEST/bundle.env is missing"

# --- the absolute paths the build expects -----------------------------------------------------
# ensure_link PATH TARGET: PATH must lead to TARGET; a symlink is made when PATH is absent (or is
# a dangling link to TARGET). Anything else is refused.
ensure_link() {
    local p=$1 t=$2
    if [ -e "$p" ] && [ "$(readlink -f "$p")" = "$(readlink -f "$t")" ]; then
        say "$p is $t"
        return
    fi
    if [ -L "$p" ] && [ "$(readlink "$p")" = "$t" ]; then rm -f "$p"; fi
    if [ ! -e "$p" ] && [ ! -L "$p" ]; then
        mkdir -p "$(dirname "$p")" || die "cannot make $(dirname "$p")"
        ln -s "$t" "$p" || die "cannot link $p -> $t"
        say "linked $p -> $t"
        return
    fi
    if [ "${KVF_GPU_RUN_NO_LINK:-0}" = 1 ]; then
        say "KVF_GPU_RUN_NO_LINK=1: using $p as it is (it is not $t)"
        return
    fi
    die "$p exists and is not $t ($(ls -ld "$p")): the build expects that absolute path. Move it \
away, or set KVF_GPU_RUN_NO_LINK=1 where it already holds the same content"
}
ensure_link "$KVF_SRC_PATH" "$REPO"
ensure_link "$KVF_BUILD_PATH" "$DEST/build"
ensure_link "$KVF_SHARED_PATH" "$DEST/shared"
# The e2e scripts call /usr/bin/python3 (json and urllib only).
if [ ! -x /usr/bin/python3 ]; then
    py=$(command -v python3) || die "no python3 on PATH (the e2e scripts need one at /usr/bin/python3)"
    ln -s "$py" /usr/bin/python3 || die "cannot link /usr/bin/python3 -> $py"
    say "linked /usr/bin/python3 -> $py"
fi
CTEST=$(command -v ctest || python3 -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "ctest"))' 2>/dev/null) ||
    die "no ctest on PATH nor in python's cmake package"
[ -x "$CTEST" ] || die "no ctest on PATH nor in python's cmake package"

# --- libraries: the bundle's first, then wherever the device keeps CUDA's ---------------------
mapfile -t ELF < <(sed "s|^|$DEST/|" "$DEST/elf.list")
if ! command -v curl >/dev/null; then
    ELF+=("$DEST/tools/libexec/curl")
    export PATH="$PATH:$DEST/tools/bin"
    say "no curl here: using the bundle's ($DEST/tools/bin/curl)"
fi
# ldd_all LD_PATH: ldd of every carried file, in parallel, into $DEST/ldd/<index>.txt (the
# bundle's curl gets its own library folder first, as its wrapper does).
ldd_all() {
    rm -rf "$DEST/ldd" && mkdir -p "$DEST/ldd"
    # shellcheck disable=SC2016 # expanded by the sh that xargs starts
    for i in "${!ELF[@]}"; do echo "$i ${ELF[$i]}"; done |
        KVF_LDD_DIR=$DEST/ldd KVF_LDD_CURL=$DEST/tools/libexec/curl KVF_LDD_CURL_LIB=$DEST/tools/lib \
            LD_LIBRARY_PATH=$1 xargs -P 8 -L 1 sh -c '
            [ "$2" = "$KVF_LDD_CURL" ] && LD_LIBRARY_PATH=$KVF_LDD_CURL_LIB:$LD_LIBRARY_PATH
            ldd "$2" >"$KVF_LDD_DIR/$1.txt" 2>&1
            echo "ldd exit status $?" >>"$KVF_LDD_DIR/$1.txt"' sh
}
# not_found: the sonames the last ldd_all could not find.
not_found() { cat "$DEST"/ldd/*.txt | awk '$2 == "=>" && $3 == "not" {print $1}' | sort -u; }
lib_dirs() {
    ls -d /usr/local/cuda*/lib64 /usr/local/cuda*/lib /usr/local/cuda*/targets/*/lib 2>/dev/null
    python3 -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null |
        while read -r sp; do ls -d "$sp"/nvidia/*/lib "$sp"/nvidia/*/lib64 2>/dev/null; done
}
ORIG_LD=${LD_LIBRARY_PATH:-}
LDP="$DEST/lib${ORIG_LD:+:$ORIG_LD}"
ldd_all "$LDP"
mapfile -t MISSING < <(not_found)
if [ "${#MISSING[@]}" -gt 0 ]; then
    say "not in the bundle nor ld.so's paths: ${MISSING[*]}; searching"
    mapfile -t CANDS < <(lib_dirs)
    for round in 1 2 3; do # a library found may need others
        added=0
        for so in "${MISSING[@]}"; do
            dir=""
            for d in "${CANDS[@]}"; do [ -e "$d/$so" ] && { dir=$d; break; }; done
            [ -z "$dir" ] && dir=$(timeout 60 find /usr /opt /root -maxdepth 10 \( -name .debug -o -name .cache \) -prune -o -name "$so" -print -quit 2>/dev/null | xargs -r dirname)
            [ -n "$dir" ] || { say "$so: found nowhere"; continue; }
            say "$so: $dir"
            case ":$LDP:" in *":$dir:"*) ;; *) LDP="$DEST/lib:$dir${LDP#"$DEST/lib"}"; added=1 ;; esac
        done
        [ "$added" = 1 ] || break
        ldd_all "$LDP"
        mapfile -t MISSING < <(not_found)
        [ "${#MISSING[@]}" -eq 0 ] && break
        say "round $round: still missing: ${MISSING[*]}"
    done
fi
export LD_LIBRARY_PATH=$LDP UCX_MODULE_DIR=$DEST/lib/ucx PATH="$DEST/build:$PATH"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
say "UCX_MODULE_DIR=$UCX_MODULE_DIR"

# --- every carried binary must resolve every library (and symbol version) ---------------------
bad=0
for i in "${!ELF[@]}"; do
    miss=$(grep -E "not found|not a dynamic|No such file|cannot|error while|exit status [1-9]" "$DEST/ldd/$i.txt" 2>&1)
    [ -s "$DEST/ldd/$i.txt" ] || miss="ldd printed nothing"
    if [ -n "$miss" ]; then
        echo "ldd ${ELF[$i]#"$DEST"/}:" >&2
        while read -r l; do echo "    $l"; done <<<"$miss" >&2
        bad=$((bad + 1))
    fi
done
if [ "$bad" -gt 0 ]; then
    die "$bad of ${#ELF[@]} carried files do not resolve their libraries (above; the bundle needs glibc >= $KVF_GLIBC_NEED, here $(getconf GNU_LIBC_VERSION 2>/dev/null))"
fi
say "ldd: all ${#ELF[@]} carried files resolve their libraries"
if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
else
    say "nvidia-smi: not found (no NVIDIA driver here)"
fi
say "set-up done in $(secs "$T0")"

# --- phases -----------------------------------------------------------------------------------
SUMMARY=()
# run_tests BUDGET_S [PER_TEST_S]
run_tests() {
    local t=$SECONDS rc log=$OUT/gpu-tests.log
    say "tests: $CTEST -L gpu in $KVF_BUILD_PATH (bounded $1 s, ${2:-300} s a test)"
    (cd "$KVF_BUILD_PATH" && timeout -k 10 "$1" "$CTEST" -L gpu --output-on-failure --timeout "${2:-300}") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    cp "$KVF_BUILD_PATH/Testing/Temporary/LastTest.log" "$OUT/ctest-LastTest.log" 2>/dev/null
    local line skipped
    line=$(grep -E "tests passed|tests failed" "$log" | tail -1)
    skipped=$(grep -c "(Skipped)" "$log")
    case "$rc" in 124 | 137) line="TIMED OUT after $1 s; $line" ;; esac
    SUMMARY+=("tests: ctest exit $rc: ${line:-no ctest summary}; $skipped skipped; $(secs "$t"); $log")
    return "$rc"
}
# run_bench QUICK(0|1) ATTN_S TORCH_S CHUNK_S [MIXED_S]: the mixed step (--decode-seqs) runs
# when MIXED_S is given, or without --quick (60 s).
run_bench() {
    local t=$SECONDS rc1 rc2 rc3 log=$OUT/bench-attn.log q=()
    [ "$1" = 1 ] && q=(--quick)
    : >"$log"
    say "bench: kvfleet bench attn ${q[*]} (bounded $2 s)" | tee -a "$log"
    timeout -k 10 "$2" kvfleet bench attn "${q[@]}" 2>&1 | tee -a "$log"
    rc1=${PIPESTATUS[0]}
    say "bench: python3 bench/attn_torch.py ${q[*]} (bounded $3 s)" | tee -a "$log"
    LD_LIBRARY_PATH=$ORIG_LD PYTHONUNBUFFERED=1 timeout -k 10 "$3" python3 "$REPO/bench/attn_torch.py" "${q[@]}" 2>&1 | tee -a "$log"
    rc2=${PIPESTATUS[0]}
    say "bench: kvfleet bench attn --chunk 512 --batches 1,4 ${q[*]} (bounded $4 s)" | tee -a "$log"
    timeout -k 10 "$4" kvfleet bench attn --chunk 512 --batches 1,4 "${q[@]}" 2>&1 | tee -a "$log"
    rc3=${PIPESTATUS[0]}
    local mixed=${5:-}
    [ -z "$mixed" ] && [ "$1" = 0 ] && mixed=60
    if [ -n "$mixed" ]; then
        say "bench: kvfleet bench attn --chunk 32 --decode-seqs 64 --batches 1 ${q[*]} (bounded $mixed s)" | tee -a "$log"
        timeout -k 10 "$mixed" kvfleet bench attn --chunk 32 --decode-seqs 64 --batches 1 "${q[@]}" 2>&1 | tee -a "$log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc3=1
    fi
    local r
    r=$(grep -E "^(ratio_vs_d2d_copy_min_ctx4k|read_vs_d2d_copy_min_ctx4k|ratio_vs_read_min_ctx4k|speedup_tiled_vs_per_token_min)(_[a-z]+)?=" "$log" | tr '\n' ' ')
    SUMMARY+=("bench: kvfleet bench attn exit $rc1, attn_torch.py exit $rc2, --chunk 512 exit $rc3; ${r:-no ratio lines} (kvfleet, torch, then prefill tiles); $(secs "$t"); $log")
    [ "$rc1" = 0 ] || return "$rc1"
    [ "$rc2" = 0 ] || return "$rc2"
    return "$rc3"
}
# run_tiles: bench's prefill-chunk runs alone
run_tiles() {
    local t=$SECONDS rc=0 r log=$OUT/bench-tiles.log
    : >"$log"
    say "tiles: kvfleet bench attn --chunk 512 --batches 1,4 (bounded 100 s)" | tee -a "$log"
    timeout -k 10 100 kvfleet bench attn --chunk 512 --batches 1,4 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    say "tiles: kvfleet bench attn --chunk 32 --decode-seqs 64 --batches 1 (bounded 60 s)" | tee -a "$log"
    timeout -k 10 60 kvfleet bench attn --chunk 32 --decode-seqs 64 --batches 1 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    r=$(grep -E "^speedup_tiled_vs_per_token_min(_[a-z]+)?=" "$log" | tr '\n' ' ')
    SUMMARY+=("tiles: exit $rc; ${r:-no ratio lines} (chunks of 512, then the mixed step); $(secs "$t"); $log")
    return "$rc"
}

# run_serve [GEN_S SERVE_S GENERATE_S DEFAULT_REQUESTS]
run_serve() {
    local t=$SECONDS rc=0 r log=$OUT/bench-serve.log m=/tmp/kvf-m1b logs=/tmp/kvf-serve-logs
    local gen_s=${1:-100} serve_s=${2:-360} one_s=${3:-60}
    local n=${KVF_GPU_SERVE_REQUESTS:-${4:-160}} preset=${KVF_GPU_SERVE_PRESET:-1b}
    local dec=${KVF_GPU_ATTN_DECODE:-auto}
    [ "$preset" = 1b ] || m=/tmp/kvf-m-$preset
    : >"$log"
    if [ -f "$m/.complete" ]; then
        say "serve: $m already generated" | tee -a "$log"
    else
        say "serve: kvfleet gen-model --preset $preset --dtype bf16 --out $m (bounded $gen_s s)" | tee -a "$log"
        rm -rf "$m"
        timeout -k 10 "$gen_s" kvfleet gen-model --preset "$preset" --dtype bf16 --out "$m" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        [ "$rc" = 0 ] && touch "$m/.complete"
    fi
    if [ "$rc" = 0 ]; then
        rm -rf "$logs" && mkdir -p "$logs"
        say "serve: kvfleet bench serve --device cuda --attn-decode=$dec, $n requests at 8/s per configuration (bounded $serve_s s)" | tee -a "$log"
        timeout -k 10 "$serve_s" kvfleet bench serve --device cuda --model "$m" \
            --fleet-flags "--kv-memory=16G --kv-dtype=bf16 --max-batch-tokens=2048 --max-seqs=64 --attn-decode=$dec" \
            --rate 8 --requests "$n" --out-min 128 --out-max 256 --log-dir "$logs" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        tar -C /tmp -czf "$OUT/serve-fleet-logs.tar.gz" "$(basename "$logs")" 2>/dev/null
        if [ "$rc" != 0 ]; then # the fleets' own words, for the output tail
            for f in "$logs"/*.log; do [ -f "$f" ] && { echo "--- last lines of $f"; tail -n 15 "$f"; }; done | tee -a "$log"
        fi
        local k
        for k in simt mma; do
            say "serve: single-stream kvfleet generate --device cuda --kv-dtype bf16 --attn-decode $k, 512 tokens (bounded $one_s s)" | tee -a "$log"
            timeout -k 10 "$one_s" kvfleet generate --device cuda --model "$m" --prompt-ids 1,2,3,4,5,6,7,8 \
                --kv-dtype bf16 --attn-decode "$k" --max-tokens 512 --ignore-eos --json 2>&1 >/dev/null | tee -a "$log"
            [ "${PIPESTATUS[0]}" = 0 ] || [ "$rc" != 0 ] || rc=1
        done
        say "serve: where a decode step's time goes: kvfleet generate --profile, bf16 KV, 128 tokens (bounded $one_s s)" | tee -a "$log"
        timeout -k 10 "$one_s" kvfleet generate --device cuda --model "$m" --prompt-ids 1,2,3,4,5,6,7,8 \
            --kv-dtype bf16 --attn-decode "$dec" --max-tokens 128 --ignore-eos --json --profile 2>&1 >/dev/null | tee -a "$log"
        [ "${PIPESTATUS[0]}" = 0 ] || [ "$rc" != 0 ] || rc=1
    fi
    r=$(grep -E "^serve:|tokens/s" "$log" | tr '\n' ' ')
    SUMMARY+=("serve: exit $rc; ${r:-no serve: lines}; $(secs "$t"); $log")
    return "$rc"
}

case "$PHASE" in
tests) run_tests 540; RC=$? ;;
bench) run_bench 0 240 200 100; RC=$? ;;
tiles) run_tiles; RC=$? ;;
serve) run_serve; RC=$? ;;
all)
    run_tests 300; RC=$?
    run_bench 1 90 90 60; rb=$?
    [ "$RC" = 0 ] && RC=$rb ;;
lease)
    run_tests 150 100; RC=$?
    run_bench 1 50 45 40 25; rb=$?
    [ "$RC" = 0 ] && RC=$rb
    run_serve 60 150 25 40; rb=$?
    [ "$RC" = 0 ] && RC=$rb ;;
esac
echo
for s in "${SUMMARY[@]}"; do say "SUMMARY $s"; done
say "SUMMARY phase $PHASE: exit $RC, $(secs "$T0") in all; files in $OUT: $(find "$OUT" -maxdepth 1 -type f -printf '%f ')"
exit "$RC"
