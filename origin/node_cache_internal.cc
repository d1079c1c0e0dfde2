#include "origin/node_cache_internal.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/atomic_file.h"
#include "core/catalog/registry.h"
#include "core/quant_config.h"
#include "core/status_macros.h"
#include "origin/origin.h"

namespace weightstore::origin::node_cache_internal {

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

std::array<uint64_t, 4> Identity(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
          static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000u + static_cast<uint64_t>(st.st_mtim.tv_nsec)};
}

std::string Errno(const std::string& what, const std::string& path) {
  return absl::StrCat(what, " '", path, "': ", std::strerror(errno));
}

bool PlaceablePath(absl::string_view path) { return IsPlaceableName(path, 4096); }

std::string ApartFolder(absl::string_view name) {
  return absl::StrCat(kApartFolder, "/", Sha256Hex(name).substr(0, 32));
}

bool IsApartPath(absl::string_view path) {
  if (!absl::ConsumePrefix(&path, kApartFolder) || !absl::ConsumePrefix(&path, "/")) return false;
  const size_t slash = path.find('/');
  if (slash != 32) return false;
  for (char c : path.substr(0, 32)) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)) || absl::ascii_isupper(static_cast<unsigned char>(c))) {
      return false;
    }
  }
  const absl::string_view file = path.substr(33);
  return PlaceablePath(file) && !absl::StrContains(file, '/');
}

bool LedgerPath(absl::string_view path) { return PlaceablePath(path) || IsApartPath(path); }

absl::Status PlaceApart(const std::string& name, OriginCheckpoint* checkpoint) {
  const std::string folder = ApartFolder(name);
  std::set<std::string> taken;
  for (size_t i = 0; i < checkpoint->files.size(); ++i) {
    OriginFile& f = checkpoint->files[i];
    const bool main = i + 1 == checkpoint->files.size();
    // The main file is the name plus its extension (NameForPath, checked).
    const std::string file = main && absl::StartsWith(f.path, name)
                                 ? absl::StrCat("checkpoint", f.path.substr(name.size()))
                                 : std::filesystem::path(f.path).filename().string();
    if (!PlaceablePath(file) || (main && !absl::StartsWith(f.path, name)) ||
        (!main && std::filesystem::path(f.path).parent_path() != std::filesystem::path(name).parent_path()) ||
        !taken.insert(file).second) {
      return absl::DataLossError(absl::StrCat("the origin's file '", absl::CHexEscape(f.path.substr(0, 256)),
                                              "' does not lie beside the others of '", name, "'"));
    }
    f.path = absl::StrCat(folder, "/", file);
  }
  return absl::OkStatus();
}

bool IsBesidePath(absl::string_view name, absl::string_view path) {
  const std::string folder = ApartFolder(name);
  if (!absl::ConsumePrefix(&path, folder) || !absl::ConsumePrefix(&path, "/")) return false;
  return absl::c_linear_search(QuantizationConfig::kFileNames, path);
}

void RemoveApartFolderIfEmpty(const std::string& folder, bool configs) {
  std::error_code ec;
  auto is_config = [](const std::filesystem::path& file) {
    return absl::c_linear_search(QuantizationConfig::kFileNames, file.filename().string());
  };
  for (auto it = std::filesystem::directory_iterator(folder, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    if (it->path().filename() != kApartNameFile && !(configs && is_config(it->path()))) return;
  }
  if (ec) return;
  if (configs) {
    for (absl::string_view config : QuantizationConfig::kFileNames) {
      std::filesystem::remove(std::filesystem::path(folder) / std::string(config), ec);
    }
  }
  std::filesystem::remove(std::filesystem::path(folder) / kApartNameFile, ec);
  std::filesystem::remove(folder, ec);  // only if empty: a pull may have begun to fill it again
}

absl::Status Remembered(absl::Status status) {
  status.SetPayload(kRememberedRefusal, absl::Cord("1"));
  return status;
}

absl::Status FsyncFolder(const std::string& folder) {
  UniqueFd fd(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid() || ::fsync(fd.get()) != 0) return absl::InternalError(Errno("cannot fsync", folder));
  return absl::OkStatus();
}

absl::Status WriteAtomically(const std::string& path, const std::string& content) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file, AtomicFile::Create(path, /*overwrite=*/true));
  WEIGHTSTORE_RETURN_IF_ERROR(file->Append(content));
  return file->Commit();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::string out(max_bytes + 1, '\0');
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<size_t>(in.gcount()));
  if (out.size() > max_bytes) return absl::DataLossError(absl::StrCat("'", path, "' is over ", max_bytes, " bytes"));
  return out;
}

}  // namespace weightstore::origin::node_cache_internal
