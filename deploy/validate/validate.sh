#!/usr/bin/env bash
# Validates everything under deploy/ and docker/ with real tools:
#   Kubernetes manifests  kubernetes-models' OpenAPI schemas (npm)
#   docker/Dockerfile     dockerfile-utils' linter (npm)
#   ConfigMap's TOML      weightstored --config ... --check-config (our parser)
#   Prometheus config     promtool check config (Debian's prometheus)
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

echo "== Kubernetes manifests and Dockerfile"
node "$here/validate.mjs" "$scratch/weightstored.toml"

echo "== the ConfigMap's weightstored.toml, through weightstored's own parser"
# Paths that exist only on a node are pointed at scratch ones; every key and
# value type of the file is still parsed and checked.
printf 'read %s\n' "validation-token-0123456789" > "$scratch/tokens"
"$build/server/weightstored" --config "$scratch/weightstored.toml" --models "$root/deploy/models" \
  --socket "$scratch/ws.sock" --tokens-file "$scratch/tokens" --check-config > /dev/null
echo "ok"

echo "== Prometheus scrape config"
promtool check config "$root/deploy/prometheus/prometheus.yml"

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
