#!/usr/bin/env bash
# Validates everything under deploy/ and docker/ with real tools:
#   kustomizations        kubectl kustomize (Debian's kubernetes-client), on
#                         deploy/kubernetes and deploy/kubernetes/regional
#   Kubernetes manifests  kubernetes-models' OpenAPI schemas (npm), the files
#                         and both renderings (validate.mjs)
#   docker/Dockerfile     dockerfile-utils' linter (npm)
#   ConfigMaps' TOML      weightstored --config ... --check-config (our parser),
#                         every weightstored.toml of both renderings
#   Prometheus config     promtool check config, and test rules on the alerts
#                         (Debian's prometheus)
#   systemd unit          systemd-analyze verify (Debian's systemd)
# Usage: deploy/validate/validate.sh BUILD_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

echo "== npm packages (package-lock.json pins them)"
(cd "$here" && npm ci --no-audit --no-fund --loglevel=error)

echo "== kustomizations: the node tier, and with the regional tier"
mkdir -p "$scratch/rendered" "$scratch/toml"
for k in node:deploy/kubernetes regional:deploy/kubernetes/regional; do
  # Current kustomize versions warn on stderr about the v2.0-compatible fields
  # (bases, patchesStrategicMerge): shown only when the rendering fails.
  if ! kubectl kustomize "$root/${k#*:}" > "$scratch/rendered/${k%%:*}.yaml" 2> "$scratch/kustomize.err"; then
    cat "$scratch/kustomize.err"; exit 1
  fi
  echo "ok   ${k#*:}"
done

echo "== Kubernetes manifests (files and renderings) and Dockerfile"
node "$here/validate.mjs" --toml-dir "$scratch/toml" \
  --rendered "$scratch/rendered/node.yaml" --rendered "$scratch/rendered/regional.yaml"

echo "== the ConfigMaps' weightstored.toml, through weightstored's own parser"
# Paths that exist only in a pod are pointed at scratch ones, each only where the
# file sets it; every key and value type of the file is still parsed and checked.
# The models folder is a writable copy: a daemon with an origin writes to it.
printf 'read %s\n' "validation-token-0123456789" > "$scratch/tokens"
printf '%s\n' "validation-token-0123456789" > "$scratch/origin-token"
has() { grep -Eq "^[[:space:]]*$1[[:space:]]*=" "$toml"; }
tomls=("$scratch"/toml/*.toml)
[ -f "${tomls[0]}" ] || { echo "validate.mjs wrote no weightstored.toml"; exit 1; }
for toml in "${tomls[@]}"; do
  name="$(basename "$toml" .toml)"
  rm -rf "$scratch/models"
  cp -r "$root/deploy/models" "$scratch/models"
  overrides=(--models "$scratch/models")
  if has socket; then overrides+=(--socket "$scratch/ws.sock"); fi
  if has tokens-file; then overrides+=(--tokens-file "$scratch/tokens"); fi
  if has origin-token-file; then overrides+=(--origin-token-file "$scratch/origin-token"); fi
  "$build/server/weightstored" --config "$toml" "${overrides[@]}" --check-config > /dev/null
  echo "ok   $name"
done

echo "== Prometheus scrape config, its alerting rules, and their tests"
promtool check config "$root/deploy/prometheus/prometheus.yml"
(cd "$root/deploy/prometheus" && promtool test rules alerts_test.yml)

echo "== systemd unit"
# systemd-analyze checks that ExecStart exists: point it at the built binary.
mkdir -p "$scratch/unit"
sed "s|/usr/local/bin/weightstored|$build/server/weightstored|g" "$root/deploy/systemd/weightstored.service" \
  > "$scratch/unit/weightstored.service"
# It reports unknown keys and bad values as warnings with exit status 0: any
# output is a failure.
out="$(systemd-analyze verify --man=no "$scratch/unit/weightstored.service" 2>&1)"
if [ -n "$out" ]; then echo "$out"; exit 1; fi
echo "ok"
