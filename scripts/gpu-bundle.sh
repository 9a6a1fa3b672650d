#!/usr/bin/env bash
# gpu-bundle.sh: builds the CUDA build (build-gpu) here and packs everything a lent GPU machine
# needs to run it into ONE archive, .gpu/bundle.tar.xz (git-ignored; carried with carry=[".gpu"]);
# scripts/gpu-run.sh unpacks and runs it there. Costs no device time. Usage: scripts/gpu-bundle.sh
#
# What goes in (the device image has CUDA, CMake and PyTorch but none of our Debian libraries,
# and ../shared does not travel):
#   build/        build-gpu's gpu-test executables and kvfleet (debug info stripped) and every
#                 CTestTestfile.cmake (so `ctest -L gpu` works), KVF_SHARED rewritten to a plain
#                 path; CMakeCache.txt for reference. No objects, no CMakeFiles.
#   lib/          the shared libraries those binaries need (ldd closure), minus glibc, libstdc++,
#                 libgcc and CUDA's own (libcublas*, libnccl, libcudart: found on the device),
#                 each under its soname; lib/ucx/: UCX's cma transport module (UCX_MODULE_DIR).
#   shared/       ../shared/fixtures/models (what the gpu tests read).
#   tools/        curl (used by tests/e2e/fleet.sh and gpu_disagg.sh) with its own libraries
#                 behind a wrapper, used there only when the device has no curl.
#   bundle.env    the absolute paths the build expects (source, build, shared) for gpu-run.sh;
#   elf.list      the carried ELF files gpu-run.sh checks with ldd; MANIFEST.txt what went in.
# Environment: KVF_GPU_NO_BUILD=1 packs build-gpu as it is (no cmake); BUILD_DIR (build-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-gpu}
ARCHIVE=.gpu/bundle.tar.xz
LIMIT_MIB=40
T0=$SECONDS
step=0
say() { echo "gpu-bundle: $*"; }
next() { step=$((step + 1)); say "[$step/7] $*"; }
die() { echo "gpu-bundle: error: $*" >&2; exit 1; }

for t in cmake ctest ldd strip xz tar objdump; do
    command -v "$t" >/dev/null || die "'$t' is not installed (needed to build and pack)"
done
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3) || die "python3 is needed to read ctest's test list"

# --- 1. configure and build -------------------------------------------------------------------
next "configure $BUILD_DIR (KVF_CUDA=ON, sm_90, RelWithDebInfo)"
mkdir -p .gpu
if [ "${KVF_GPU_NO_BUILD:-0}" != 1 ]; then
    nice -n 19 cmake -S . -B "$BUILD_DIR" -DKVF_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo >.gpu/configure.log 2>&1 ||
        { tail -30 .gpu/configure.log; die "cmake configure failed (log: .gpu/configure.log)"; }
    rm -f .gpu/configure.log
fi
[ -f "$BUILD_DIR/CMakeCache.txt" ] || die "$BUILD_DIR is not configured"
BUILD_ABS=$(cd "$BUILD_DIR" && pwd -P)
cache() { sed -n "s/^$1:[A-Z]*=//p" "$BUILD_ABS/CMakeCache.txt"; }
SRC_PATH=$(cache CMAKE_HOME_DIRECTORY)
SHARED_RAW=$(cache KVF_SHARED_DIR)
SHARED_PATH=$(realpath -m "$SHARED_RAW")
[ -d "$SHARED_PATH/fixtures/models" ] || die "KVF_SHARED_DIR ($SHARED_RAW) has no fixtures/models"

# The gpu tests and what they run: executables under the build dir are targets of the same
# name; kvfleet is always needed (KVF_BIN of every test, the e2e script, the benches). In a tree
# not built yet ctest gives a test whose executable does not exist no command ("?" below): such
# a test is a target named as the test (kvf_gpu_test), listed again after the build.
list_gpu_tests() {
    ctest --test-dir "$BUILD_ABS" -N -L gpu --show-only=json-v1 2>/dev/null |
        "$PY" -c '
import json, os, sys
build = sys.argv[1]
for t in json.load(sys.stdin)["tests"]:
    cmd = t.get("command")
    if not cmd:
        print(t["name"], "?")
        continue
    exe = cmd[0] if cmd[0].startswith(build + "/") else ""
    print(t["name"], os.path.relpath(exe, build) if exe else "-")
' "$BUILD_ABS"
}
mapfile -t TESTS < <(list_gpu_tests)
[ "${#TESTS[@]}" -gt 0 ] || die "ctest -N -L gpu lists no test in $BUILD_DIR"
TARGETS=(kvfleet)
for line in "${TESTS[@]}"; do
    exe=${line#* }
    case "$exe" in
    -) ;;
    \?) TARGETS+=("${line%% *}") ;;
    *) TARGETS+=("$(basename "$exe")") ;;
    esac
done
say "gpu tests: ${#TESTS[@]} (${TESTS[*]%% *}); targets: ${TARGETS[*]}"

next "build ${#TARGETS[@]} targets (nice -n 19, -j2; a first build takes several minutes)"
if [ "${KVF_GPU_NO_BUILD:-0}" != 1 ]; then
    nice -n 19 cmake --build "$BUILD_ABS" -j2 --target "${TARGETS[@]}" >"$BUILD_ABS/gpu-bundle-build.log" 2>&1 ||
        { tail -40 "$BUILD_ABS/gpu-bundle-build.log"; die "build failed (log: $BUILD_DIR/gpu-bundle-build.log; if someone is mid-edit in a shared checkout, KVF_GPU_NO_BUILD=1 packs the last good build)"; }
fi
mapfile -t TESTS < <(list_gpu_tests)
EXES=(kvfleet)
for line in "${TESTS[@]}"; do
    exe=${line#* }
    [ "$exe" = "?" ] && die "gpu test ${line%% *} has no executable after the build"
    [ "$exe" = - ] || EXES+=("$exe")
done
for e in "${EXES[@]}"; do [ -x "$BUILD_ABS/$e" ] || die "$BUILD_DIR/$e was not built"; done
grep -q libcublas <<<"$(ldd "$BUILD_ABS/kvfleet")" || die "$BUILD_DIR/kvfleet has no CUDA (configured without nvcc?)"

# --- 2. stage the build dir -------------------------------------------------------------------
STAGE_ROOT=$(mktemp -d /tmp/kvf-gpu-stage.XXXXXX)
trap 'rm -rf "$STAGE_ROOT"' EXIT
S=$STAGE_ROOT/kvf-gpu
mkdir -p "$S/build" "$S/lib/ucx" "$S/shared/fixtures" "$S/tools/bin" "$S/tools/libexec" "$S/tools/lib"
next "stage $BUILD_DIR: ${#EXES[@]} executables (strip --strip-debug) and the CTestTestfile.cmake files"
(cd "$BUILD_ABS" && find . -name CMakeFiles -prune -o -name CTestTestfile.cmake -print) |
    while read -r f; do mkdir -p "$S/build/$(dirname "$f")"; cp "$BUILD_ABS/$f" "$S/build/$f"; done
cp "$BUILD_ABS/CMakeCache.txt" "$S/build/"
# KVF_SHARED is "<source>/../shared": through a symlinked source dir that ".." would leave it.
esc=$(printf '%s' "$SHARED_RAW" | sed 's/[][\.*^$|]/\\&/g')
find "$S/build" -name CTestTestfile.cmake -exec sed -i "s|KVF_SHARED=$esc|KVF_SHARED=$SHARED_PATH|g" {} +
: >"$S/elf.list"
for e in "${EXES[@]}"; do
    mkdir -p "$S/build/$(dirname "$e")"
    cp "$BUILD_ABS/$e" "$S/build/$e"
    strip --strip-debug "$S/build/$e"
    echo "build/$e" >>"$S/elf.list"
done

# --- 3. the libraries: ldd closure of every carried binary ------------------------------------
# Left to the device: glibc, libstdc++, libgcc, and CUDA's libraries (the driver's libcuda, the
# toolkit's libcublas*/libnccl/libcudart, found there under /usr/local/cuda* or pip's nvidia/*).
is_left_out() {
    case "$1" in
    linux-vdso.so* | ld-linux*.so* | libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | \
        librt.so.* | libresolv.so.* | libutil.so.* | libanl.so.* | libmvec.so.* | \
        libstdc++.so.* | libgcc_s.so.* | \
        libcuda.so.* | libcudart.so.* | libcublas.so.* | libcublasLt.so.* | libnccl.so.* | \
        libnvrtc*.so.* | libnvJitLink.so.*) return 0 ;;
    esac
    return 1
}
# copy_deps DEST_DIR FILE...: each needed library not left out, as DEST_DIR/<soname>.
copy_deps() {
    local dest=$1 f name arrow path rest
    shift
    for f in "$@"; do
        while read -r name arrow path rest; do
            [ "$arrow" = "=>" ] || continue
            is_left_out "$name" && continue
            [ "$path" = not ] && die "ldd $f: $name not found here"
            case "$path" in /usr/local/cuda*) continue ;; esac
            [ -e "$dest/$name" ] && continue
            if [ -e "$S/lib/$name" ]; then # one copy in the archive (tar keeps hard links)
                ln "$S/lib/$name" "$dest/$name"
            else
                cp -L "$path" "$dest/$name"
            fi
        done < <(ldd "$f")
    done
}
next "collect libraries (ldd over the binaries and UCX's modules)"
UCX_DIR=/usr/lib/x86_64-linux-gnu/ucx
# Only the cma module: ib and rdmacm need rdma-core's libibverbs with its providers and
# /etc/libibverbs.d (which warns on every start where that is missing); one GPU needs neither.
# tcp, sysv, posix and self are built into libuct itself.
[ -e "$UCX_DIR/libuct_cma.so.0" ] || die "$UCX_DIR/libuct_cma.so.0 is missing (apt-get install libucx0)"
cp -L "$UCX_DIR/libuct_cma.so.0" "$S/lib/ucx/libuct_cma.so.0"
echo "lib/ucx/libuct_cma.so.0" >>"$S/elf.list"
mapfile -t BINS < <(sed "s|^|$S/|" "$S/elf.list")
copy_deps "$S/lib" "${BINS[@]}"
for l in "$S"/lib/*.so*; do echo "lib/$(basename "$l")" >>"$S/elf.list"; done
# curl for the e2e scripts, with its own library folder (not on the shared LD_LIBRARY_PATH: its
# ssl, ffi and the like would shadow the device's for python).
CURL=$(command -v curl) || die "curl is not installed here"
cp -L "$CURL" "$S/tools/libexec/curl"
copy_deps "$S/tools/lib" "$S/tools/libexec/curl"
cat >"$S/tools/bin/curl" <<'EOF'
#!/bin/sh
# curl from the bundle (Debian's), with its own libraries; gpu-run.sh puts this on PATH only
# when the device has no curl.
d=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/libexec/curl" "$@"
EOF
chmod +x "$S/tools/bin/curl"
GLIBC_NEED=$( (sed "s|^|$S/|" "$S/elf.list"; find "$S/tools/libexec" "$S/tools/lib" -type f) |
    xargs objdump -T 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 || true)

# --- 4. fixtures, paths, manifest -------------------------------------------------------------
next "fixtures ($SHARED_PATH/fixtures/models), bundle.env, MANIFEST.txt"
cp -a "$SHARED_PATH/fixtures/models" "$S/shared/fixtures/"
cat >"$S/bundle.env" <<EOF
# Written by scripts/gpu-bundle.sh: the absolute paths build-gpu was configured with.
KVF_SRC_PATH=$SRC_PATH
KVF_BUILD_PATH=$BUILD_ABS
KVF_SHARED_PATH=$SHARED_PATH
KVF_GLIBC_NEED=${GLIBC_NEED#GLIBC_}
EOF
rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=""
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    dirty=" (tree had uncommitted changes)"
fi
{
    echo "kvfleet GPU bundle, made $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname) from $rev$dirty"
    echo "build: $BUILD_ABS (KVF_CUDA=ON, CMAKE_CUDA_ARCHITECTURES=$(cache CMAKE_CUDA_ARCHITECTURES), $(cache CMAKE_BUILD_TYPE))"
    echo "needs on the device: glibc >= ${GLIBC_NEED#GLIBC_}, libstdc++/libgcc, libcublas.so.13, libcublasLt.so.13, libnccl.so.2, an NVIDIA driver"
    echo "gpu tests:"
    printf '  %s\n' "${TESTS[@]}"
    echo "files:"
    (cd "$S" && find . -type f -printf '%s %p\n' | sort -k2 | awk '{printf "  %10d %s\n", $1, $2}')
} >"$S/MANIFEST.txt"

# --- 5. pack ----------------------------------------------------------------------------------
next "pack $ARCHIVE (xz -6, 2 threads)"
mkdir -p .gpu
XZ_OPT="-6 -T2" nice -n 19 tar -C "$S" -cJf "$ARCHIVE.tmp" .
mv "$ARCHIVE.tmp" "$ARCHIVE"

# --- 6. summary -------------------------------------------------------------------------------
next "summary"
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
part() { du -sb "$S/$1" | cut -f1; }
size=$(stat -c %s "$ARCHIVE")
printf '  %-34s %12s\n' "part" "unpacked"
printf '  %-34s %12s\n' "build/ (${#EXES[@]} binaries, ctest files)" "$(mib "$(part build)")"
printf '  %-34s %12s\n' "lib/ ($(find "$S/lib" -maxdepth 1 -name '*.so*' | wc -l) libraries + ucx/)" "$(mib "$(part lib)")"
printf '  %-34s %12s\n' "shared/fixtures/models" "$(mib "$(part shared)")"
printf '  %-34s %12s\n' "tools/ (curl + $(find "$S/tools/lib" -name '*.so*' | wc -l) libraries)" "$(mib "$(part tools)")"
printf '  %-34s %12s\n' "total" "$(mib "$(du -sb "$S" | cut -f1)")"
say "wrote $ARCHIVE: $(mib "$size") compressed (limit for the carried tree 64 MiB; aim < $LIMIT_MIB MiB), needs glibc >= ${GLIBC_NEED#GLIBC_}, $((SECONDS - T0)) s"
[ "$size" -lt $((LIMIT_MIB * 1048576)) ] || say "warning: the archive is over $LIMIT_MIB MiB"
say "next: run(carry=[\".gpu\"], command=\"bash scripts/gpu-run.sh tests\") (phases: tests, bench, serve, all)"
