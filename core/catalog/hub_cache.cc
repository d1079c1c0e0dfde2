#include "core/catalog/hub_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/format.h"

namespace weightstore {
namespace fs = std::filesystem;

namespace {

constexpr absl::string_view kKinds[] = {"models", "datasets", "spaces"};
// The weights transformers loads from a snapshot, in the order it looks.
constexpr absl::string_view kPrimary[] = {"model.safetensors.index.json", "model.safetensors", "pytorch_model.bin"};
constexpr size_t kMaxRefBytes = 256;

bool IsNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
}

// A snapshot folder's name or a ref's content: 1 to 128 of [0-9A-Za-z._-],
// not hidden (so never "." or "..").
bool IsRevision(absl::string_view s) {
  return !s.empty() && s.size() <= 128 && s[0] != '.' && std::all_of(s.begin(), s.end(), IsNameChar);
}

bool IsRealDirectory(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type() == fs::file_type::directory;
}

// `path` with every link resolved, when that lies inside `root` (itself
// resolved); otherwise the reason, in `error`.
std::optional<fs::path> ResolveInside(const fs::path& path, const fs::path& root, std::string* error) {
  std::error_code ec;
  fs::path resolved = fs::canonical(path, ec);
  if (ec) {
    std::error_code link_ec;
    const bool is_link = fs::is_symlink(path, link_ec);
    *error = absl::StrCat(
        path.string(), ": ",
        is_link ? absl::StrCat("dangling link to '", fs::read_symlink(path, link_ec).string(), "'") : ec.message());
    return std::nullopt;
  }
  const fs::path rel = resolved.lexically_relative(root);
  if (rel.empty() || *rel.begin() == "..") {
    *error =
        absl::StrCat(path.string(), ": links to '", resolved.string(), "', outside its repo's folder in the cache");
    return std::nullopt;
  }
  std::error_code type_ec;
  if (!fs::is_regular_file(resolved, type_ec)) {
    *error = absl::StrCat(path.string(), ": not a regular file");
    return std::nullopt;
  }
  return resolved;
}

// One snapshot's checkpoints: "" for the weights transformers loads, "/stem"
// for every other checkpoint file in it.
std::map<std::string, std::string> SnapshotCheckpoints(const fs::path& snapshot, const fs::path& root,
                                                       const HubCacheLimits& limits, std::vector<std::string>* errors) {
  std::vector<std::string> files;  // relative to the snapshot
  std::error_code ec;
  fs::recursive_directory_iterator it(snapshot, fs::directory_options::skip_permission_denied, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string leaf = it->path().filename().string();
    std::error_code item_ec;
    if (absl::StartsWith(leaf, ".")) {
      if (it->is_directory(item_ec)) it.disable_recursion_pending();
      continue;
    }
    if (it->is_symlink(item_ec) || it->is_regular_file(item_ec)) {
      if (files.size() == limits.max_files_per_snapshot) {
        errors->push_back(absl::StrCat(snapshot.string(), ": more than ", limits.max_files_per_snapshot,
                                       " files; the rest are not served"));
        break;
      }
      files.push_back(it->path().lexically_relative(snapshot).string());
    } else if (it->is_directory(item_ec) && static_cast<size_t>(it.depth()) + 1 >= limits.max_depth) {
      it.disable_recursion_pending();
    }
  }
  if (ec) errors->push_back(absl::StrCat(snapshot.string(), ": ", ec.message()));
  std::sort(files.begin(), files.end());

  // The primary is the first of kPrimary present, whatever its order in `files`.
  std::string primary_file;
  for (absl::string_view p : kPrimary) {
    if (std::find(files.begin(), files.end(), p) != files.end()) {
      primary_file = std::string(p);
      break;
    }
  }

  std::map<std::string, std::string> out;  // suffix -> path
  std::set<std::string> shards;            // relative paths of index shards
  std::set<std::string> failed;            // relative paths not served
  for (const std::string& rel : files) {
    const FormatSpec* index = IndexFormatForPath(rel);
    if (index == nullptr || index->index_files == nullptr) continue;
    std::string error;
    if (!ResolveInside(snapshot / rel, root, &error)) {
      errors->push_back(error);
      failed.insert(rel);
      continue;
    }
    for (const std::string& shard : index->index_files((snapshot / rel).string())) {
      const std::string shard_rel = fs::path(shard).lexically_relative(snapshot).string();
      shards.insert(shard_rel);
      if (!failed.contains(rel) && !ResolveInside(shard, root, &error)) {
        errors->push_back(absl::StrCat(error, " (a shard of ", (snapshot / rel).string(), ")"));
        failed.insert(rel);
      }
    }
  }
  for (const std::string& rel : files) {
    if (failed.contains(rel) || shards.contains(rel)) continue;
    std::string suffix;
    if (rel == primary_file) {
      suffix = "";
    } else {
      std::optional<std::string> stem = StripFormatExtension(rel);
      if (!stem) continue;  // not weights (config.json, a tokenizer)
      suffix = absl::StrCat("/", *stem);
    }
    std::string error;
    if (IndexFormatForPath(rel) == nullptr && !ResolveInside(snapshot / rel, root, &error)) {
      errors->push_back(error);
      continue;
    }
    out.emplace(std::move(suffix), (snapshot / rel).string());
  }
  return out;
}

// Every ref under refs/ ("main", "v1.0", "refs/pr/1") with the snapshot it
// names, or an error line.
std::map<std::string, std::string> ReadRefs(const fs::path& refs, const HubCacheLimits& limits,
                                            std::vector<std::string>* errors) {
  std::map<std::string, std::string> out;
  if (!IsRealDirectory(refs)) return out;
  std::error_code ec;
  size_t seen = 0;
  fs::recursive_directory_iterator it(refs, fs::directory_options::skip_permission_denied, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string leaf = it->path().filename().string();
    std::error_code item_ec;
    const fs::file_status status = it->symlink_status(item_ec);
    if (absl::StartsWith(leaf, ".")) {
      if (status.type() == fs::file_type::directory) it.disable_recursion_pending();
      continue;
    }
    if (status.type() == fs::file_type::directory) {
      if (static_cast<size_t>(it.depth()) + 1 >= limits.max_depth) it.disable_recursion_pending();
      continue;
    }
    if (++seen > limits.max_refs) {
      errors->push_back(absl::StrCat(refs.string(), ": more than ", limits.max_refs, " refs; the rest are not served"));
      break;
    }
    if (status.type() != fs::file_type::regular) {
      errors->push_back(absl::StrCat(it->path().string(), ": a ref that is not a regular file"));
      continue;
    }
    // Read without following a link (checked above), at most kMaxRefBytes + 1.
    std::string content(kMaxRefBytes + 1, '\0');
    const int fd = ::open(it->path().c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    const ssize_t n = fd < 0 ? -1 : ::read(fd, content.data(), content.size());
    if (fd >= 0) ::close(fd);
    if (n < 0) {
      errors->push_back(absl::StrCat(it->path().string(), ": cannot read the ref"));
      continue;
    }
    content.resize(static_cast<size_t>(n));
    const std::string commit(absl::StripAsciiWhitespace(content));
    if (static_cast<size_t>(n) > kMaxRefBytes || !IsRevision(commit)) {
      errors->push_back(absl::StrCat(it->path().string(), ": holds no commit id (1 to 128 of [0-9A-Za-z._-])"));
      continue;
    }
    out.emplace(it->path().lexically_relative(refs).string(), commit);
  }
  if (ec) errors->push_back(absl::StrCat(refs.string(), ": ", ec.message()));
  return out;
}

}  // namespace

std::optional<std::string> HubRepoKind(const std::string& dir) {
  const std::string leaf = fs::path(dir).filename().string();
  for (absl::string_view kind : kKinds) {
    if (absl::StartsWith(leaf, absl::StrCat(kind, "--")) && IsRealDirectory(fs::path(dir) / "snapshots")) {
      return std::string(kind);
    }
  }
  return std::nullopt;
}

std::optional<std::string> HubRepoId(const std::string& folder_name) {
  if (!absl::StartsWith(folder_name, "models--")) return std::nullopt;
  std::vector<std::string> parts = absl::StrSplit(folder_name.substr(8), "--");
  if (parts.empty() || parts.size() > 2) return std::nullopt;
  for (const std::string& part : parts) {
    // Hub names: 1 to 96 of [0-9A-Za-z._-], not starting or ending with '.' or '-'.
    if (part.empty() || part.size() > 96 || !std::all_of(part.begin(), part.end(), IsNameChar) || part.front() == '.' ||
        part.front() == '-' || part.back() == '.' || part.back() == '-') {
      return std::nullopt;
    }
  }
  return absl::StrJoin(parts, "/");
}

HubRepoScan ScanHubRepo(const std::string& dir, const HubCacheLimits& limits) {
  HubRepoScan scan;
  const fs::path repo(dir);
  std::optional<std::string> id = HubRepoId(repo.filename().string());
  if (!id) {
    scan.errors.push_back(absl::StrCat(dir, ": not a model repo folder of a hub cache (models--ORG--NAME)"));
    return scan;
  }
  std::error_code ec;
  const fs::path root = fs::canonical(repo, ec);
  if (ec) {
    scan.errors.push_back(absl::StrCat(dir, ": ", ec.message()));
    return scan;
  }

  // Each snapshot's checkpoints, by the snapshot's folder name.
  std::map<std::string, std::map<std::string, std::string>> snapshots;
  std::vector<fs::path> folders;
  for (fs::directory_iterator it(repo / "snapshots", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string leaf = it->path().filename().string();
    if (absl::StartsWith(leaf, ".")) continue;
    if (folders.size() == limits.max_snapshots) {
      scan.errors.push_back(absl::StrCat((repo / "snapshots").string(), ": more than ", limits.max_snapshots,
                                         " snapshots; the rest are not served"));
      break;
    }
    if (!IsRevision(leaf) || !IsRealDirectory(it->path())) {
      scan.errors.push_back(absl::StrCat(it->path().string(), ": not a snapshot folder"));
      continue;
    }
    folders.push_back(it->path());
  }
  if (ec) scan.errors.push_back(absl::StrCat((repo / "snapshots").string(), ": ", ec.message()));
  std::sort(folders.begin(), folders.end());
  for (const fs::path& folder : folders) {
    snapshots[folder.filename().string()] = SnapshotCheckpoints(folder, root, limits, &scan.errors);
  }

  auto serve = [&](const std::string& base, const std::string& commit) {
    for (const auto& [suffix, path] : snapshots.at(commit)) scan.checkpoints.push_back({base + suffix, path});
  };
  for (const auto& [ref, commit] : ReadRefs(repo / "refs", limits, &scan.errors)) {
    if (!snapshots.contains(commit)) {
      scan.errors.push_back(
          absl::StrCat((repo / "refs" / ref).string(), ": names snapshot '", commit, "', which is not in the cache"));
      continue;
    }
    serve(ref == "main" ? *id : absl::StrCat(*id, "@", ref), commit);
  }
  for (const auto& [commit, checkpoints] : snapshots) serve(absl::StrCat(*id, "@", commit), commit);
  return scan;
}

}  // namespace weightstore
