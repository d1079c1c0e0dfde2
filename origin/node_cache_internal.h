// What the node cache's source files (origin/node_cache*.cc) share: small
// helpers, and the eviction's Victim, which a transfer holds until it has
// evicted them. Not for use outside origin/.
#ifndef WEIGHTSTORE_ORIGIN_NODE_CACHE_INTERNAL_H_
#define WEIGHTSTORE_ORIGIN_NODE_CACHE_INTERNAL_H_

#include <sys/stat.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/shm/unix_socket.h"
#include "origin/node_cache.h"

namespace weightstore::origin {
namespace node_cache_internal {

int64_t NowMs();

// What identifies a file this cache placed: device, inode, size and mtime in
// nanoseconds, which a rename keeps.
std::array<uint64_t, 4> Identity(const struct stat& st);

std::string Errno(const std::string& what, const std::string& path);

// A path the node may create under its models folder (core/catalog/registry.h).
bool PlaceablePath(absl::string_view path);

// Where a checkpoint is placed that cannot lie at its name: a hub revision
// ("acme/tiny@v1.0", which no file name serves), or a checkpoint from a hub
// snapshot (whose shard names other repos share). Each gets a folder of its
// own, hidden from the registry's scans, and is loaded under its name:
// ".weightstore-cache/placed/<32 hex digits of the name's SHA-256>".
inline constexpr absl::string_view kApartFolder = ".weightstore-cache/placed";
std::string ApartFolder(absl::string_view name);
// True for a file directly in some apart folder ("<ApartFolder>/FILE").
bool IsApartPath(absl::string_view path);
// The file in an apart folder that holds the checkpoint's name (no shard can
// be named so: it is hidden).
inline constexpr char kApartNameFile[] = ".name";
// Moves `checkpoint`'s files (as the origin lists them: the main file at the
// name plus its extension, the rest beside it) into the apart folder of
// `name`: the main file as "checkpoint" plus its extension, each other file
// under its own file name. DataLoss for files that would not lie side by side
// there.
absl::Status PlaceApart(const std::string& name, OriginCheckpoint* checkpoint);
// True for "<ApartFolder(name)>/<a quantization config's file name>": where
// a config pulled beside `name` lies (OriginFile::beside).
bool IsBesidePath(absl::string_view name, absl::string_view path);
// Removes the apart folder `folder` (absolute) if nothing but its name file
// is left in it; with `configs`, if nothing but that and configs beside
// (which go too): a checkpoint whose weights are gone.
void RemoveApartFolderIfEmpty(const std::string& folder, bool configs = false);
// A path the ledger may list: placeable, or a file in an apart folder.
bool LedgerPath(absl::string_view path);

// Marks a refusal that comes from what the origin holds, so that it is
// remembered (NodeCacheOptions::not_found_ttl).
inline constexpr absl::string_view kRememberedRefusal = "weightstore.dev/remembered-refusal";
absl::Status Remembered(absl::Status status);

// fsync of a folder: a rename in it is durable.
absl::Status FsyncFolder(const std::string& folder);
absl::Status WriteAtomically(const std::string& path, const std::string& content);

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes);

}  // namespace node_cache_internal

struct NodeCache::Victim {
  std::string name;
  Cached cached;
  std::vector<std::pair<std::string, UniqueFd>> locks;  // its files, held until removed
  // False when its files are no longer as this cache placed them (replaced
  // while not served): forgotten, not removed.
  bool ours = true;
};

}  // namespace weightstore::origin

#endif  // WEIGHTSTORE_ORIGIN_NODE_CACHE_INTERNAL_H_
