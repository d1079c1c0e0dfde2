#!/usr/bin/env bash
# Checks docker/Dockerfile without a Docker engine (there is none on the CI
# machine), on the same Debian 12 packages the image uses:
#  1. the build stage installs every package the daemon builds from
#     (scripts/install-deps.sh --daemon's list: header-only ones such as
#     msgpack-cxx leave no trace in ldd), and CMake configures with the build
#     stage's flags; then the two binaries build as the build stage builds
#     them, or, given BINARIES (a build tree of the same sources that already
#     has them: CI's gcc build), those are checked instead of a third compile
#     of the daemon. That tree must compile the sources as the Dockerfile does
#     (WEIGHTSTORE_UNITY_BUILD alike); its other flags change optimisation,
#     warnings and what else is built, not what the binaries link;
#  2. every shared library they link must come from a package the runtime stage
#     installs (or from debian:12-slim itself);
#  3. runs the ENTRYPOINT's command as the image's numeric user (10001) on the
#     bundled models, and the HEALTHCHECK's command against it.
# The Dockerfile is linted by deploy/validate/validate.sh.
# Usage: docker/check.sh [BUILD_DIR [BINARIES]]   (BUILD_DIR default: build-docker)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dockerfile="$root/docker/Dockerfile"
build="${1:-$root/build-docker}"
binaries="${2:-}"

echo "== 1. build stage"
build_stage=$(sed -n '/^FROM debian:12 AS build/,/^FROM /p' "$dockerfile" | sed -n '/apt-get install/,/rm -rf/p' |
              tr -s ' \\\n' '\n')
needed=$(sed -n '/^daemon_packages=(/,/^)/p' "$root/scripts/install-deps.sh" | grep -v '^ *#' |
         tr -s ' ()\n' '\n' | grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -v '^daemon_packages=' || true)
for pkg in $needed; do
  if ! grep -qx -- "$pkg" <<< "$build_stage"; then
    echo "the build stage does not install $pkg (scripts/install-deps.sh --daemon does)"; exit 1
  fi
done
flags=$(sed -n '/^RUN cmake -S/,/^ && cmake --build/p' "$dockerfile" | grep -o -- '-D[A-Z_]*=[A-Za-z]*' | tr '\n' ' ')
echo "cmake flags from the Dockerfile: $flags"
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja $flags > /dev/null
if [ -n "$binaries" ]; then
  # The build stage's targets exist under its flags; the binaries come from BINARIES.
  for option in WEIGHTSTORE_UNITY_BUILD; do
    want=$(sed -n "s/^$option:BOOL=//p" "$build/CMakeCache.txt")
    have=$(sed -n "s/^$option:BOOL=//p" "$binaries/CMakeCache.txt")
    if [ "$want" != "$have" ]; then
      echo "$binaries has $option=$have, the Dockerfile's build $option=$want: not the same compile"; exit 1
    fi
  done
  for target in weightstored weightstore; do
    ninja -C "$build" -t query "$target" > /dev/null || { echo "no target $target under the Dockerfile's flags"; exit 1; }
  done
  build="$(cd "$binaries" && pwd)"
  echo "binaries from $build"
else
  cmake --build "$build" --target weightstored weightstore > /dev/null
fi
for binary in "$build/server/weightstored" "$build/client/weightstore"; do
  [ -x "$binary" ] || { echo "no $binary"; exit 1; }
done
echo "ok"

echo "== 2. runtime libraries"
runtime=$(sed -n '/^FROM debian:12-slim/,$p' "$dockerfile" | sed -n '/apt-get install/,/rm -rf/p' | tr -s ' \\\n' '\n' |
          grep -E '^lib|^ca-certificates' || true)
base="libc6 libgcc-s1 libstdc++6 zlib1g"  # in debian:12-slim already
missing=0
for lib in $(ldd "$build/server/weightstored" "$build/client/weightstore" | awk '/=> \//{print $3}' | sort -u); do
  # Debian 12 merges /lib into /usr/lib; dpkg knows one of the two spellings.
  pkg=""
  for candidate in "$lib" "$(readlink -f "$lib")" "/usr$lib" "${lib#/usr}"; do
    pkg=$(dpkg -S "$candidate" 2>/dev/null | head -1 | cut -d: -f1 || true)
    [ -n "$pkg" ] && break
  done
  if [ -z "$pkg" ]; then echo "no Debian package owns $lib"; missing=1; continue; fi
  if ! grep -qx "$pkg" <<< "$runtime" && ! grep -qw "$pkg" <<< "$base"; then
    echo "$lib comes from $pkg, which the runtime stage does not install"; missing=1
  fi
done
[ "$missing" = 0 ] && echo "ok: every library is installed by the runtime stage or in the base image"
[ "$missing" = 0 ] || exit 1

echo "== 3. ENTRYPOINT as uid 10001, then the HEALTHCHECK"
scratch="$(mktemp -d)"
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$scratch"' EXIT
cp -r "$root/deploy/models" "$scratch/models"
chmod -R a+rX "$scratch"
mkdir "$scratch/run" && chown 10001:10001 "$scratch/run"  # like the image's writable /run/weightstore
# The image's command line, with loopback ports picked by the kernel.
setpriv --reuid 10001 --regid 10001 --clear-groups \
  "$build/server/weightstored" --models "$scratch/models" --listen 127.0.0.1:0 \
  --health-listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --port-file "$scratch/run/port" 2> "$scratch/log" &
pid=$!
for _ in $(seq 100); do [ -s "$scratch/run/port" ] && break; sleep 0.1; done
[ -s "$scratch/run/port.health" ] || { cat "$scratch/log"; exit 1; }
"$build/client/weightstore" health --server "127.0.0.1:$(cat "$scratch/run/port.health")" --timeout 2
"$build/client/weightstore" ls --server "127.0.0.1:$(cat "$scratch/run/port")"
echo "ok"
