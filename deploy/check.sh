#!/usr/bin/env bash
# check.sh: offline validation of deploy/ (kustomize overlays and the helm chart). Renders every
# overlay and chart variant, then validates each object (deploy/tools/validate.cjs): schemas,
# unknown fields, project rules. Exits 77 (skip) when the tools from scripts/install-deps.sh are
# missing. A negative self-check proves a misspelt field fails. No cluster is needed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tools="${KVF_DEPLOY_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet-deploy}"
helm="$tools/bin/helm"
kubectl="$tools/bin/kubectl"
kube_version=1.33.0

missing=()
[ -x "$helm" ] || missing+=("$helm")
[ -x "$kubectl" ] || missing+=("$kubectl")
command -v node >/dev/null || missing+=("node")
command -v yamllint >/dev/null || missing+=("yamllint")
for m in kubernetes-models @kubernetes-models/prometheus-operator typescript yaml dockerfile-utils; do
  [ -d "$tools/node_modules/$m" ] || missing+=("$tools/node_modules/$m")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deploy/check.sh: SKIP: missing ${missing[*]}; run scripts/install-deps.sh (needs npm and apt once)"
  exit 77
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

# render DIR PREFIX: every overlay and chart variant of the deploy tree at DIR into $out/PREFIX-*.yaml
render() {
  local d="$1" p="$2" o
  for o in "$d"/kustomize/overlays/*/; do
    "$kubectl" kustomize "$o" > "$out/$p-kustomize-$(basename "$o").yaml"
  done
  "$kubectl" kustomize "$d/kustomize/base" > "$out/$p-kustomize-base.yaml"
  local chart="$d/helm/kvfleet"
  "$helm" lint --strict --quiet --kube-version "$kube_version" "$chart" >/dev/null
  "$helm" template kvfleet "$chart" --kube-version "$kube_version" > "$out/$p-helm-default.yaml"
  "$helm" template kvfleet "$chart" --kube-version "$kube_version" \
    --set worker.device=cuda,model.source=pvc \
    --set prefill.replicas=2,decode.replicas=4,autoscaling.enabled=true > "$out/$p-helm-gpu.yaml"
  "$helm" template kvfleet "$chart" --kube-version "$kube_version" \
    --set tls.enabled=false,apiKeys.enabled=false,networkPolicy.enabled=false \
    --set serviceMonitor.enabled=false,podDisruptionBudget.enabled=false > "$out/$p-helm-minimal.yaml"
}

start=$SECONDS
n_pass=0
ok() { n_pass=$((n_pass + 1)); }
trap 'rc=$?; [ $rc = 0 ] || echo "deploy/check.sh: $n_pass passed, 1 failed"; rm -rf "$out"' EXIT
echo "deploy/check.sh: yamllint"
yamllint -s -c "$here/.yamllint" "$here"; ok
echo "deploy/check.sh: Containerfile lint (dockerfile-utils)"
node -e '
const u = require(process.argv[1] + "/node_modules/dockerfile-utils"), f = process.argv[2];
const d = u.validate(require("fs").readFileSync(f, "utf8"));
for (const x of d) console.error(`FAIL ${f}:${x.range.start.line + 1}: ${x.message}`);
process.exit(d.length ? 1 : 0);' "$tools" "$here/Containerfile"; ok
echo "deploy/check.sh: helm lint --strict, helm template, kubectl kustomize"
render "$here" ok; n_pass=$((n_pass + $(ls "$out" | wc -l) + 1))   # each rendering, helm lint
echo "deploy/check.sh: validate $(ls "$out" | wc -l) renderings"
node "$here/tools/validate.cjs" "$tools" "$out"/ok-*.yaml; ok

# Negative self-check: a misspelt field in a copy of the base and of the chart must fail.
echo "deploy/check.sh: negative self-check (imagePullPolicyy)"
bad="$out/bad-tree"
cp -r "$here" "$bad"
sed -i '0,/imagePullPolicy:/s//imagePullPolicyy:/' "$bad/kustomize/base/router.yaml"
sed -i '0,/imagePullPolicy:/s//imagePullPolicyy:/' "$bad/helm/kvfleet/templates/workers.yaml"
render "$bad" bad
for f in "$out"/bad-kustomize-base.yaml "$out"/bad-helm-default.yaml; do
  if node "$here/tools/validate.cjs" "$tools" "$f" > "$out/neg.log" 2>&1; then
    echo "deploy/check.sh: FAIL: a misspelt field in $(basename "$f") was not caught"; cat "$out/neg.log"; exit 1
  fi
  grep -q imagePullPolicyy "$out/neg.log" || { echo "deploy/check.sh: FAIL: wrong error for $(basename "$f")"; cat "$out/neg.log"; exit 1; }
  ok
done
echo "deploy/check.sh: OK ($((SECONDS - start)) s)"
echo "deploy/check.sh: $n_pass passed, 0 failed"
