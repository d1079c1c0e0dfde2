#!/usr/bin/env bash
# Checks the include rules that keep the layout readable (README's codemap):
#   core/**          never includes gRPC, protobuf, server/, client/ or proto/
#   core/formats/    includes the base only (and itself)
#   core/select/     includes the base and core/formats/ (the writer)
#   core/shm/        includes the base only (and itself)
#   core/catalog/    the top of core: includes the base, core/shm/ (preloads)
#                    and core/formats/ (push writes new versions); nothing in
#                    core includes it
#   the base         (core/*.{h,cc}) includes no room
#   a format's name  appears in code outside core/formats/ only in tests
#   server/*.cc      includes no other handler's header (service.h,
#                    shm_server.h, watch.h): handlers share serving.h,
#                    resolve.h and the gates; only server.cc composes them
# Prints each violation; exits 1 if there is any.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
fail() { echo "layout: $*"; status=1; }

# Non-test sources of a room (recursively), or of the base (its top folder).
sources() { find "$@" -type f \( -name '*.h' -o -name '*.cc' \) ! -name '*_test.cc'; }
base_sources() { find core -maxdepth 1 -type f \( -name '*.h' -o -name '*.cc' \) ! -name '*_test.cc'; }
# FILE:HEADER for every #include of the files named (/dev/null keeps grep off
# stdin when there are none).
includes() { grep -Ho '^#include [<"][^">]*[">]' /dev/null "$@" 2>/dev/null | sed 's/#include [<"]\(.*\)[">]$/\1/'; }

while IFS=: read -r file inc; do
  case "$inc" in grpc*|google/protobuf/*|server/*|client/*|proto/*|weightstore/v1/*) fail "$file includes $inc (core is free of gRPC, protobuf and the layers above it)";; esac
done < <(includes $(find core -type f \( -name '*.h' -o -name '*.cc' \)))

check_room() {  # ROOM ALLOWED-ROOMS...
  local room=$1; shift
  [ -d "core/$room" ] || { fail "core/$room/ is missing"; return; }
  while IFS=: read -r file inc; do
    [[ "$inc" == core/*/* ]] || continue
    local target=${inc#core/}; target=${target%%/*}
    local ok=0
    for allowed in "$room" "$@"; do [ "$target" = "$allowed" ] && ok=1; done
    [ $ok = 1 ] || fail "$file includes $inc (core/$room/ may include the base$([ $# -gt 0 ] && printf " and core/%s/" "$@"))"
  done < <(includes $(sources core/$room))
}
check_room formats
check_room select formats
check_room shm
check_room catalog shm formats

# The catalog is the top of core: no other room, and not the base, includes it.
while IFS=: read -r file inc; do
  [[ "$inc" == core/catalog/* ]] && fail "$file includes $inc (nothing in core below the catalog includes it)"
done < <(includes $(sources core/formats core/select core/shm) $(base_sources))

while IFS=: read -r file inc; do
  [[ "$inc" == core/*/* ]] || continue
  [[ "$inc" == core/catalog/* ]] && continue  # reported above
  fail "$file includes $inc (the base includes no room)"
done < <(includes $(base_sources))

# A format is named in code only inside its room (the table lists them).
for name in safetensors pytorch burnpack burn_record; do
  while read -r hit; do
    fail "names the $name format outside core/formats/: $hit"
  done < <(grep -rInE "k(SafeTensors|PyTorch|Burnpack|BurnRecord)Format|core/formats/(safetensors|pytorch|burnpack|burn_record)\.h" \
             core server client proto --include='*.h' --include='*.cc' | grep -v '^core/formats/' | grep -v '_test\.cc:' |
           grep -iE "${name/_/_?}")
done

# The handlers of server/ meet only in server.cc, which composes them.
for file in $(sources server | grep '\.cc$'); do
  case "$file" in server/server.cc | server/weightstored_main.cc) continue ;; esac
  while IFS=: read -r _ inc; do
    case "$inc" in
      server/service.h | server/shm_server.h | server/watch.h)
        [ "$inc" = "${file%.cc}.h" ] || fail "$file includes $inc (another handler's header: share serving.h, resolve.h or a gate instead)" ;;
    esac
  done < <(includes "$file")
done

exit $status
