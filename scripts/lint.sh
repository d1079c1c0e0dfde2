#!/usr/bin/env bash
# The shape checks CI runs before building: the include rules of the codemap
# (scripts/check-layout.sh), clang-format over every C++ source (.clang-format),
# and buf lint over proto/ (proto/buf.yaml). Needs scripts/install-deps.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check-layout.sh
git ls-files -z -- '*.h' '*.cc' '*.cu' | xargs -0 clang-format --dry-run -Werror
buf=build-tools/node_modules/.bin/buf
(cd proto && "../$buf" lint)
echo "lint: layout, clang-format and buf lint are clean"
