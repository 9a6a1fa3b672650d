#!/usr/bin/env bash
# image-test.sh: builds the CPU image from deploy/Containerfile on local bases (debootstrap +
# podman import: no registry is needed, the build fetches nothing: APT=0, --pull=never), then runs
# gen-model, prefill, decode and the router as containers from it on the host network and passes
# one completion through them (decode with --local-prefill-max-tokens 0, so prefill does the
# prompt). Needs root, podman, buildah, debootstrap, runc and a Debian mirror for debootstrap.
# Exits 77 (skip) when a tool is missing. The bases are cached in $KVF_IMAGE_CACHE.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${KVF_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet-deploy/image}"
mirror="${KVF_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
tag=localhost/kvfleet:image-test
for t in podman buildah debootstrap runc curl git; do
  command -v "$t" >/dev/null || { echo "image-test: SKIP: no $t (apt-get install podman buildah debootstrap runc)"; exit 77; }
done
[ "$(id -u)" = 0 ] || { echo "image-test: SKIP: needs root (debootstrap, rootful podman)"; exit 77; }
podman=(podman --storage-driver vfs --cgroup-manager=cgroupfs --runtime runc)
start=$SECONDS
step() { echo "image-test: [$((SECONDS - start)) s] $*"; }

# 1. the two bases: build (compilers and -dev packages) and runtime (the libraries ldd lists)
build_pkgs=build-essential,cmake,pkg-config,libjansson-dev,libxxhash-dev,libopenblas-dev,libpcre2-dev,libutf8proc-dev,libucx-dev,libprotobuf-c-dev,protobuf-c-compiler,libgrpc-dev,libevent-dev,libssl-dev,libcmocka-dev,python3
run_pkgs=libjansson4,libopenblas0-pthread,libpcre2-8-0,libutf8proc2,libucx0,libprotobuf-c1,libgrpc29,libevent-2.1-7,libevent-pthreads-2.1-7,libssl3,ca-certificates
mkdir -p "$cache"
base() { # base NAME PACKAGES: debootstrap once into a tarball, import it as localhost/kvfleet-base-NAME
  local name=$1 pkgs=$2 tar="$cache/base-$1-v2.tar"
  if [ ! -s "$tar" ]; then
    step "debootstrap $name base"
    local dir; dir=$(mktemp -d)
    debootstrap --variant=minbase --include="$pkgs" bookworm "$dir" "$mirror" > "$cache/debootstrap-$name.log" 2>&1 ||
      { tail -20 "$cache/debootstrap-$name.log"; rm -rf "$dir"; exit 1; }
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
    chmod 0755 "$dir" # mktemp's 0700 would become the image's / and lock uid 65532 out of everything
    tar -C "$dir" -cf "$tar.tmp" . && mv "$tar.tmp" "$tar"; rm -rf "$dir"
  fi
  "${podman[@]}" image exists "localhost/kvfleet-base-$name:v2" ||
    "${podman[@]}" import "$tar" "localhost/kvfleet-base-$name:v2" >/dev/null
}
base build "$build_pkgs"
base run "$run_pkgs"

# 2. the image, from a clean copy of the tracked tree (no build directories in the context)
ctx=$(mktemp -d); work=$(mktemp -d); pids=()
cleanup() {
  for c in kvf-it-router kvf-it-decode kvf-it-prefill; do "${podman[@]}" rm -f "$c" >/dev/null 2>&1 || true; done
  rm -rf "$ctx" "$work"
}
trap cleanup EXIT
git -C "$root" ls-files -z --cached --others --exclude-standard | (cd "$root" && xargs -0 cp --parents -t "$ctx" 2>/dev/null || true)
step "build $tag"
buildah --storage-driver vfs build --isolation chroot --pull=never \
  --ulimit nofile=4096:4096 --build-arg BASE=localhost/kvfleet-base-run:v2 \
  --build-arg BUILD_BASE=localhost/kvfleet-base-build:v2 --build-arg APT=0 \
  -f "$root/deploy/Containerfile" -t "$tag" "$ctx" > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
"${podman[@]}" image inspect "$tag" --format 'image-test: image {{.Id}} {{.Size}} bytes, user {{.Config.User}}, entrypoint {{.Config.Entrypoint}}' 2>/dev/null ||
  "${podman[@]}" image ls "$tag"

# 3. the fleet: read-only root filesystems, non-root, host network, a tmpfs at /tmp
run=("${podman[@]}" run --rm --network host --ulimit nofile=4096:4096 --ulimit nproc=4096:4096 --read-only --tmpfs /tmp -v "$work/models:/models:z")
mkdir -p "$work/models"; chmod 777 "$work/models"
step "gen-model"
"${run[@]}" "$tag" gen-model --out /models/m --preset tiny > "$work/gen.log" 2>&1 || { cat "$work/gen.log"; exit 1; }
P=$((20000 + RANDOM % 20000))
"${run[@]}" -d --name kvf-it-prefill "$tag" prefill --model /models/m --listen 127.0.0.1:$P --admin-listen 127.0.0.1:$((P+1)) >/dev/null
"${run[@]}" -d --name kvf-it-decode "$tag" decode --model /models/m --listen 127.0.0.1:$((P+2)) --admin-listen 127.0.0.1:$((P+3)) --local-prefill-max-tokens 0 >/dev/null
"${run[@]}" -d --name kvf-it-router "$tag" router --model /models/m --port $((P+4)) --decode 127.0.0.1:$((P+2)) --prefill 127.0.0.1:$P >/dev/null
step "fleet started; waiting for /ready"
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$((P+4))/ready" >/dev/null && break; sleep 0.2; done
curl -sf "http://127.0.0.1:$((P+4))/ready" >/dev/null || {
  for c in kvf-it-prefill kvf-it-decode kvf-it-router; do echo "--- $c"; "${podman[@]}" logs "$c" 2>&1 | tail -5; done; exit 1; }
ans=$(curl -s "http://127.0.0.1:$((P+4))/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"m","prompt":"The kvfleet image test passes a prompt of a few blocks through prefill and decode","max_tokens":8}')
echo "image-test: completion: $ans"
case $ans in *'"text"'*) ;; *) echo "image-test: FAIL: no completion"; exit 1 ;; esac
remote=$(curl -s "http://127.0.0.1:$((P+1))/metrics" | grep -v '^#' | grep -i prefill | head -3 || true)
echo "image-test: prefill worker metrics: ${remote:-none}"
step "OK: router, prefill and decode containers served a completion"
