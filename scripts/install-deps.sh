#!/usr/bin/env bash
# install-deps.sh: installs every Debian package kvfleet's build, tests and benchmarks need.
# Idempotent: packages already present are left alone; safe to run again. Debian 12 only;
# nothing comes from anywhere but Debian's repositories. Runs apt as root (sudo when not root).
set -euo pipefail

PACKAGES=(
  # build
  build-essential cmake pkg-config git
  # common/, model/
  libjansson-dev libxxhash-dev libopenblas-dev libpcre2-dev libutf8proc-dev
  # transport/, proto/, router/
  libucx-dev ucx-utils libprotobuf-c-dev protobuf-c-compiler libgrpc-dev libevent-dev
  # cli/ (gen-certs, up --tls)
  libssl-dev
  # tests, fuzzing, sanitizers
  libcmocka-dev clang libclang-rt-14-dev openssl iproute2 procps curl python3
  # benchmarks
  wrk hyperfine
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
