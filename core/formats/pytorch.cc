#include "core/formats/pytorch.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checked_math.h"
#include "core/formats/byte_reader.h"
#include "core/formats/pickle.h"
#include "core/formats/zip_reader.h"
#include "core/status_macros.h"

namespace weightstore {
namespace {

// Whether `strides` (elements) lay `shape` out row-major (dimensions of size 1
// may have any stride).
bool IsRowMajor(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& strides) {
  if (strides.empty()) return true;
  if (strides.size() != shape.size()) return false;
  uint64_t expected = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

using Kind = PickleValue::Kind;

constexpr unsigned char kLegacyMagic[15] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46,
                                            0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, 0x2e};
constexpr size_t kMaxDictDepth = 64;
constexpr uint64_t kMaxWalkNodes = 10000000;
constexpr uint64_t kMaxNameBytesBuilt = uint64_t{256} << 20;
// A state dict's pickle holds names and shapes, ~100 bytes a tensor.
constexpr uint64_t kMaxPickleBytes = uint64_t{256} << 20;

// Returns a LazyStorage for a storage key, or an error naming it.
using StorageResolver = std::function<absl::StatusOr<std::shared_ptr<const LazyStorage>>(const PickleStorage& storage)>;

// TAR checkpoints: persistent id -> the tensor (or storage) it names.
using PersistentTable = absl::flat_hash_map<std::string, const PickleValue*>;

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("'", path, "': ", what));
}

// Collects the tensors of nested dicts, joining keys with '.'.
class Flattener {
 public:
  Flattener(const std::string& path, const OpenOptions& options, const PersistentTable* persistent)
      : path_(path),
        max_tensors_(options.max_tensors),
        max_name_bytes_(options.max_name_bytes),
        persistent_(persistent) {}

  absl::Status Walk(const PickleValue* value, const std::string& prefix, size_t depth) {
    if (++nodes_ > kMaxWalkNodes) return Bad(path_, "pickle structure is too large to flatten");
    if (value->kind == Kind::kPersistentId) {
      auto it = persistent_ ? persistent_->find(value->s) : PersistentTable::const_iterator();
      if (persistent_ == nullptr || it == persistent_->end()) {
        return Bad(path_, absl::StrCat("pickle refers to unknown object '", value->s, "'"));
      }
      value = it->second;
    }
    if (value->kind == Kind::kTensor) {
      if (prefix.empty()) return Bad(path_, "the root is a single tensor, not a dict of tensors");
      if (tensors_.size() >= max_tensors_) return Bad(path_, absl::StrCat("more than ", max_tensors_, " tensors"));
      tensors_.emplace_back(prefix, value);
      return absl::OkStatus();
    }
    if (value->kind != Kind::kDict) return absl::OkStatus();  // lists, numbers, strings: not weights
    if (depth >= kMaxDictDepth) return Bad(path_, absl::StrCat("dicts nested deeper than ", kMaxDictDepth));
    std::vector<std::pair<std::string, const PickleValue*>> items;
    WEIGHTSTORE_RETURN_IF_ERROR(Items(value, prefix, &items));
    for (const auto& [key, child] : items) {
      const size_t length = prefix.empty() ? key.size() : prefix.size() + 1 + key.size();
      if (length > max_name_bytes_) {
        return Bad(path_, absl::StrCat("a tensor name under '", prefix.substr(0, 64), prefix.size() > 64 ? "..." : "",
                                       "' is longer than ", max_name_bytes_, " bytes"));
      }
      // Shared (memoized) dicts can be reached many times: bound the bytes of
      // every name built, not just each one.
      name_bytes_ += length;
      if (name_bytes_ > kMaxNameBytesBuilt) return Bad(path_, "pickle names are too large to flatten");
      WEIGHTSTORE_RETURN_IF_ERROR(Walk(child, prefix.empty() ? key : absl::StrCat(prefix, ".", key), depth + 1));
    }
    return absl::OkStatus();
  }

  // Returns a dict's items with string keys; a repeated key keeps its first
  // position and its last value, as a Python dict does.
  absl::Status Items(const PickleValue* dict, const std::string& prefix,
                     std::vector<std::pair<std::string, const PickleValue*>>* out) {
    absl::flat_hash_map<std::string, size_t> position;
    for (const auto& [k, v] : dict->dict) {
      std::string key;
      if (k->kind == Kind::kString) {
        if (k->s.size() > max_name_bytes_) {
          return Bad(path_, absl::StrCat("a dict key of ", k->s.size(), " bytes is longer than a tensor name may be (",
                                         max_name_bytes_, ")"));
        }
        key = k->s;
      } else if (k->kind == Kind::kInt) {
        key = absl::StrCat(k->i);
      } else {
        return Bad(path_, absl::StrCat("dict", prefix.empty() ? "" : absl::StrCat(" '", prefix, "'"),
                                       " has a key that is not a string or an integer"));
      }
      auto [it, inserted] = position.emplace(key, out->size());
      if (inserted) {
        out->emplace_back(std::move(key), v);
      } else {
        (*out)[it->second].second = v;
      }
    }
    return absl::OkStatus();
  }

  std::vector<std::pair<std::string, const PickleValue*>>& tensors() { return tensors_; }

 private:
  const std::string& path_;
  uint64_t max_tensors_;
  size_t max_name_bytes_;
  const PersistentTable* persistent_;
  uint64_t nodes_ = 0;
  uint64_t name_bytes_ = 0;
  std::vector<std::pair<std::string, const PickleValue*>> tensors_;
};

// Turns the unpickled root into checkpoint entries.
absl::StatusOr<std::shared_ptr<const Checkpoint>> BuildCheckpoint(const PickleValue* root, const std::string& path,
                                                                  const OpenOptions& options,
                                                                  const StorageResolver& resolve, std::string detail,
                                                                  const PersistentTable* persistent = nullptr) {
  Flattener flattener(path, options, persistent);
  if (root->kind != Kind::kDict) {
    return Bad(path,
               "the pickle's root is not a dict (a full torch.save(model) is not supported; "
               "save model.state_dict() instead)");
  }
  const PickleValue* start = root;
  if (!options.top_level_key.empty()) {
    std::vector<std::pair<std::string, const PickleValue*>> items;
    WEIGHTSTORE_RETURN_IF_ERROR(flattener.Items(root, "", &items));
    start = nullptr;
    std::vector<std::string> available;
    for (const auto& [key, value] : items) {
      if (value->kind == Kind::kDict) available.push_back(key);
      if (key == options.top_level_key) start = value;
    }
    if (start == nullptr || start->kind != Kind::kDict) {
      return absl::NotFoundError(
          absl::StrCat("'", path, "' has no dict under top-level key '", options.top_level_key,
                       "'; dict-valued keys: ", available.empty() ? "(none)" : absl::StrJoin(available, ", ")));
    }
  }
  WEIGHTSTORE_RETURN_IF_ERROR(flattener.Walk(start, "", 0));

  absl::flat_hash_map<const PickleValue*, std::shared_ptr<const LazyStorage>> storages;
  std::vector<CheckpointEntry> entries;
  entries.reserve(flattener.tensors().size());
  for (const auto& [name, value] : flattener.tensors()) {
    const PickleTensor& t = value->tensor;
    const PickleStorage& s = t.storage->storage;
    CheckpointEntry entry;
    entry.spec.name = name;
    if (const std::string& other = !t.unsupported_dtype.empty() ? t.unsupported_dtype : s.unsupported; !other.empty()) {
      return Bad(path, absl::StrCat("tensor '", name, "' has dtype ", other,
                                    ", which weightstore does not read (floats to F64, the float8 family, "
                                    "float4_e2m1fn_x2, complex64, bool and the integers to 64 bits); convert it "
                                    "in torch first"));
    }
    if (s.untyped && !t.dtype)
      return Bad(path, absl::StrCat("tensor '", name, "' has an untyped storage and no dtype"));
    entry.spec.dtype = t.dtype.value_or(s.dtype);
    if (!s.untyped && t.dtype && *t.dtype != s.dtype) {
      return Bad(path, absl::StrCat("tensor '", name, "' has dtype ", DTypeName(*t.dtype), " but a ",
                                    DTypeName(s.dtype), " storage"));
    }
    entry.spec.shape = t.shape;
    auto it = storages.find(t.storage);
    if (it == storages.end()) {
      absl::StatusOr<std::shared_ptr<const LazyStorage>> storage = resolve(s);
      if (!storage.ok()) {
        return absl::Status(storage.status().code(), absl::StrCat("tensor '", name, "': ", storage.status().message()));
      }
      it = storages.emplace(t.storage, *storage).first;
    }
    entry.layout.storage = it->second;
    auto offset = CheckedMul(t.storage_offset, DTypeSize(entry.spec.dtype));
    if (!offset) return Bad(path, absl::StrCat("tensor '", name, "' has an overflowing storage offset"));
    entry.layout.offset = *offset;
    entry.layout.strides = t.strides;
    entry.layout.normalize_bool = entry.spec.dtype == DType::kBool;
    if (entry.spec.dtype == DType::kF4) {
      // torch's float4_e2m1fn_x2 counts bytes of two values; SafeTensors' F4,
      // values (the last dimension doubled, as safetensors maps it).
      if (!IsRowMajor(entry.spec.shape, entry.layout.strides)) {
        return Bad(path, absl::StrCat("tensor '", name,
                                      "' is a strided view of float4_e2m1fn_x2, whose bytes hold two values; save "
                                      "it contiguous"));
      }
      entry.layout.strides.clear();
      if (entry.spec.shape.empty()) entry.spec.shape = {1};
      if (!CheckedMul(entry.spec.shape.back(), 2)) return Bad(path, absl::StrCat("tensor '", name, "' overflows"));
      entry.spec.shape.back() *= 2;
    }
    entries.push_back(std::move(entry));
  }
  return Checkpoint::Create(kPyTorchFormat, path, Metadata{}, std::move(entries), std::move(detail), {}, options);
}

// Bytes a storage declares: numel elements of its dtype (bytes when untyped).
absl::StatusOr<uint64_t> DeclaredBytes(const PickleStorage& s, const std::string& path) {
  auto n = CheckedMul(s.numel, s.untyped ? 1 : DTypeSize(s.dtype));
  if (!n) return Bad(path, absl::StrCat("storage '", s.key, "' size overflows"));
  return *n;
}

// Applies legacy view metadata: the storage is a window of its root storage.
absl::StatusOr<std::shared_ptr<const LazyStorage>> ApplyView(const PickleStorage& s,
                                                             std::shared_ptr<const LazyStorage> root,
                                                             const std::string& path) {
  if (!s.has_view) return root;
  const uint64_t elem = s.untyped ? 1 : DTypeSize(s.dtype);
  auto begin = CheckedMul(s.view_offset, elem), length = CheckedMul(s.view_size, elem);
  auto end = begin && length ? CheckedAdd(*begin, *length) : std::nullopt;
  if (!end || *end > root->size()) {
    return Bad(path, absl::StrCat("view '", s.view_key, "' of storage '", s.key, "' lies outside it"));
  }
  return LazyStorage::Deferred(*length, [root, b = *begin, n = *length]() -> absl::StatusOr<SharedBytes> {
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes bytes, root->Get());
    return bytes.Subspan(b, n);
  });
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseZip(SharedBytes bytes, const std::string& path,
                                                           const OpenOptions& options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(ZipArchive zip_value, ZipArchive::Open(bytes, path));
  auto zip = std::make_shared<const ZipArchive>(std::move(zip_value));
  // Entries resolve relative to the folder holding data.pkl (the shortest one).
  std::string root;
  bool found = false;
  for (const ZipEntry& e : zip->entries()) {
    if (e.name == "data.pkl" || absl::EndsWith(e.name, "/data.pkl")) {
      std::string prefix = e.name.substr(0, e.name.size() - 8);
      if (!found || prefix.size() < root.size()) root = prefix;
      found = true;
    }
  }
  if (!found) return Bad(path, "zip archive has no data.pkl (not a torch.save checkpoint)");
  for (const ZipEntry& e : zip->entries()) {
    if (e.name == root + "constants.pkl" || absl::StartsWith(e.name, root + "code/")) {
      return Bad(path,
                 "is a TorchScript archive; only torch.save checkpoints are read "
                 "(TorchScript would need its code to run)");
    }
  }
  std::string detail = "zip";
  if (const ZipEntry* order = zip->Find(root + "byteorder")) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes value, zip->Read(*order, /*verify_crc=*/true));
    std::string byteorder(absl::StripAsciiWhitespace(value.view()));
    if (byteorder != "little") return Bad(path, absl::StrCat("byte order '", byteorder, "' is not supported"));
  }
  if (const ZipEntry* version = zip->Find(root + "version")) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes value, zip->Read(*version, /*verify_crc=*/true));
    detail = absl::StrCat("zip, archive version ", absl::StripAsciiWhitespace(value.view().substr(0, 32)));
  }
  const ZipEntry* pkl = zip->Find(root + "data.pkl");
  if (pkl->uncompressed_size > kMaxPickleBytes) {
    return Bad(path, absl::StrCat(pkl->name, " is ", pkl->uncompressed_size, " bytes; pickles over ", kMaxPickleBytes,
                                  " bytes are not read"));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes pickle_bytes, zip->Read(*pkl, /*verify_crc=*/true));
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<PickleResult> pickle,
                               Unpickle(pickle_bytes.view(), absl::StrCat("'", path, "' (", pkl->name, ")")));

  absl::flat_hash_map<std::string, std::shared_ptr<const LazyStorage>> by_key;
  const bool verify = options.verify_crc;
  uint64_t deflated = 0;  // bytes of compressed records that would be inflated (and kept)
  StorageResolver resolve = [&](const PickleStorage& s) -> absl::StatusOr<std::shared_ptr<const LazyStorage>> {
    std::shared_ptr<const LazyStorage> storage;
    auto it = by_key.find(s.key);
    const std::string record = absl::StrCat(root, "data/", s.key);
    WEIGHTSTORE_ASSIGN_OR_RETURN(uint64_t declared, DeclaredBytes(s, path));
    const ZipEntry* entry = zip->Find(record);
    if (entry == nullptr) return Bad(path, absl::StrCat("storage record '", record, "' is missing"));
    if (entry->uncompressed_size != declared) {
      return Bad(path, absl::StrCat("storage record '", record, "' holds ", entry->uncompressed_size,
                                    " bytes, but its storage declares ", declared));
    }
    if (it == by_key.end() && entry->method != 0) {
      // torch.save stores records uncompressed; a compressed one is inflated
      // into memory that lives as long as the version: bounded per checkpoint.
      deflated += entry->uncompressed_size;
      if (deflated > options.max_inflated_bytes) {
        return Bad(path, absl::StrCat(
                             "storage record '", record, "' is compressed, and more than ", options.max_inflated_bytes,
                             " bytes of compressed records would be inflated (torch.save stores them uncompressed)"));
      }
    }
    if (it != by_key.end()) {
      storage = it->second;
    } else if (entry->method == 0 && !verify) {
      storage = LazyStorage::Ready(bytes.Subspan(entry->data_offset, entry->uncompressed_size));
    } else {
      storage =
          LazyStorage::Deferred(entry->uncompressed_size, [zip, entry, verify] { return zip->Read(*entry, verify); });
    }
    by_key[s.key] = storage;
    return ApplyView(s, storage, path);
  };
  return BuildCheckpoint(pickle->root(), path, options, resolve, std::move(detail));
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseLegacy(SharedBytes bytes, const std::string& path,
                                                              const OpenOptions& options) {
  absl::string_view data = bytes.view();
  size_t pos = 0;
  auto next = [&](absl::string_view what) -> absl::StatusOr<std::unique_ptr<PickleResult>> {
    size_t used = 0;
    auto result = Unpickle(data.substr(pos), absl::StrCat("'", path, "' (legacy ", what, ")"), {}, &used);
    if (result.ok()) pos += used;
    return result;
  };
  pos = sizeof kLegacyMagic;  // the magic number pickle, already matched byte for byte
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto protocol, next("protocol version"));
  if (protocol->root()->kind != Kind::kInt || protocol->root()->i != 1001) {
    return Bad(path, "legacy protocol version is not 1001");
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto sys_info, next("sys_info"));
  if (sys_info->root()->kind == Kind::kDict) {
    for (const auto& [k, v] : sys_info->root()->dict) {
      if (k->kind == Kind::kString && k->s == "little_endian" && !(v->kind == Kind::kBool && v->b)) {
        return Bad(path, "big-endian legacy checkpoints are not supported");
      }
    }
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto main, next("main pickle"));
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto keys, next("storage keys"));
  if (keys->root()->kind != Kind::kList) return Bad(path, "legacy storage key list is not a list");

  // Every storage the main pickle declares, by key: its dtype and element count.
  absl::flat_hash_map<std::string, const PickleStorage*> declared;
  for (const PickleValue& v : main->values()) {
    if (v.kind == Kind::kStorage) declared.emplace(v.storage.key, &v.storage);
  }

  absl::flat_hash_map<std::string, std::shared_ptr<const LazyStorage>> storages;
  for (const PickleValue* key_value : keys->root()->items) {
    if (key_value->kind != Kind::kString) return Bad(path, "legacy storage key is not a string");
    const std::string& key = key_value->s;
    auto it = declared.find(key);
    if (it == declared.end()) {
      return Bad(path, absl::StrCat("legacy storage '", key, "' is listed but never used by a tensor"));
    }
    const PickleStorage& s = *it->second;
    if (data.size() - pos < 8) return Bad(path, absl::StrCat("legacy storage '", key, "' is truncated"));
    const uint64_t numel = LoadU64(data.data() + pos);
    pos += 8;
    if (numel != s.numel) {
      return Bad(path, absl::StrCat("legacy storage '", key, "' holds ", numel, " elements, declared ", s.numel));
    }
    WEIGHTSTORE_ASSIGN_OR_RETURN(uint64_t length, DeclaredBytes(s, path));
    if (length > data.size() - pos) return Bad(path, absl::StrCat("legacy storage '", key, "' is truncated"));
    if (!storages.emplace(key, LazyStorage::Ready(bytes.Subspan(pos, length))).second) {
      return Bad(path, absl::StrCat("legacy storage '", key, "' is listed twice"));
    }
    pos += length;
  }
  StorageResolver resolve = [&](const PickleStorage& s) -> absl::StatusOr<std::shared_ptr<const LazyStorage>> {
    auto it = storages.find(s.key);
    if (it == storages.end()) return Bad(path, absl::StrCat("legacy storage '", s.key, "' has no data"));
    return ApplyView(s, it->second, path);
  };
  return BuildCheckpoint(main->root(), path, options, resolve, "legacy");
}

struct TarEntry {
  uint64_t offset = 0;
  uint64_t size = 0;
};

// Reads the member table of a POSIX ustar archive, checking header checksums
// and that every member lies inside the file.
absl::StatusOr<absl::flat_hash_map<std::string, TarEntry>> ReadTarMembers(absl::string_view data,
                                                                          const std::string& path) {
  absl::flat_hash_map<std::string, TarEntry> members;
  auto field = [](absl::string_view h, size_t off, size_t len) {
    absl::string_view f = h.substr(off, len);
    return f.substr(0, f.find('\0'));
  };
  uint64_t pos = 0;
  while (data.size() - pos >= 512) {
    absl::string_view h = data.substr(pos, 512);
    if (h.find_first_not_of('\0') == absl::string_view::npos) break;  // end-of-archive block
    uint64_t checksum = 0, stored = 0, size = 0;
    for (size_t i = 0; i < 512; ++i) checksum += (i >= 148 && i < 156) ? ' ' : static_cast<uint8_t>(h[i]);
    auto octal = [](absl::string_view f, uint64_t* out) {
      f = absl::StripAsciiWhitespace(f);
      if (f.empty() || f.size() > 21) return false;
      uint64_t v = 0;
      for (char c : f) {
        if (c < '0' || c > '7') return false;
        v = v * 8 + static_cast<uint64_t>(c - '0');
      }
      *out = v;
      return true;
    };
    if (!octal(field(h, 148, 8), &stored) || stored != checksum) {
      return Bad(path, absl::StrCat("TAR header at byte ", pos, " has a bad checksum"));
    }
    if (!octal(field(h, 124, 12), &size)) return Bad(path, absl::StrCat("TAR header at byte ", pos, " has a bad size"));
    const uint64_t body = pos + 512;
    if (size > data.size() - body) return Bad(path, absl::StrCat("TAR member at byte ", pos, " runs past the end"));
    const char type = h[156];
    std::string name(field(h, 0, 100));
    std::string prefix(field(h, 345, 155));
    if (!prefix.empty()) name = absl::StrCat(prefix, "/", name);
    if (type == '0' || type == '\0') {
      if (!members.emplace(name, TarEntry{body, size}).second) {
        return Bad(path, absl::StrCat("TAR member '", name, "' appears twice"));
      }
    }
    pos = body + (size + 511) / 512 * 512;
  }
  return members;
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseTar(SharedBytes bytes, const std::string& path,
                                                           const OpenOptions& options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto members, ReadTarMembers(bytes.view(), path));
  auto member = [&](const char* name) -> absl::StatusOr<TarEntry> {
    auto it = members.find(name);
    if (it == members.end()) return Bad(path, absl::StrCat("TAR checkpoint has no '", name, "' member"));
    return it->second;
  };
  // Several pickles back to back inside one member.
  struct Stream {
    absl::string_view data;
    uint64_t base;  // file offset of data[0]
    size_t pos = 0;
  };
  auto next_pickle = [&](Stream& s, absl::string_view what) -> absl::StatusOr<std::unique_ptr<PickleResult>> {
    size_t used = 0;
    auto result = Unpickle(s.data.substr(s.pos), absl::StrCat("'", path, "' (TAR ", what, ")"), {}, &used);
    if (result.ok()) s.pos += used;
    return result;
  };
  auto as_key = [](const PickleValue* v, std::string* out) {
    if (v->kind == Kind::kString)
      *out = v->s;
    else if (v->kind == Kind::kInt)
      *out = absl::StrCat(v->i);
    else
      return false;
    return true;
  };

  if (auto it = members.find("sys_info"); it != members.end()) {
    Stream s{bytes.view().substr(it->second.offset, it->second.size), it->second.offset};
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto info, next_pickle(s, "sys_info"));
    if (info->root()->kind == Kind::kDict) {
      for (const auto& [k, v] : info->root()->dict) {
        if (k->kind == Kind::kString && k->s == "little_endian" && !(v->kind == Kind::kBool && v->b)) {
          return Bad(path, "big-endian TAR checkpoints are not supported");
        }
      }
    }
  }

  std::deque<PickleValue> arena;  // storages and tensors built from the tables
  absl::flat_hash_map<std::string, std::shared_ptr<const LazyStorage>> roots;
  PersistentTable objects;
  std::vector<std::unique_ptr<PickleResult>> keep;

  WEIGHTSTORE_ASSIGN_OR_RETURN(TarEntry storages_member, member("storages"));
  Stream st{bytes.view().substr(storages_member.offset, storages_member.size), storages_member.offset};
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto count, next_pickle(st, "storage count"));
  if (count->root()->kind != Kind::kInt || count->root()->i < 0 ||
      static_cast<uint64_t>(count->root()->i) > options.max_tensors) {
    return Bad(path, "TAR storage count is invalid");
  }
  for (int64_t n = 0; n < count->root()->i; ++n) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto header, next_pickle(st, "storage header"));
    const PickleValue* h = header->root();
    std::string key;
    if (h->kind != Kind::kTuple || h->items.size() != 3 || !as_key(h->items[0], &key) ||
        h->items[2]->kind != Kind::kGlobal || h->items[2]->global != PickleGlobal::kStorageClass) {
      return Bad(path, "TAR storage header is not (key, location, storage class)");
    }
    PickleValue& v = arena.emplace_back();
    v.kind = Kind::kStorage;
    v.storage.key = key;
    v.storage.dtype = h->items[2]->global_dtype;
    if (h->items[2]->global_unsupported) v.storage.unsupported = h->items[2]->global_name;
    if (st.data.size() - st.pos < 8) return Bad(path, absl::StrCat("TAR storage '", key, "' is truncated"));
    v.storage.numel = LoadU64(st.data.data() + st.pos);
    st.pos += 8;
    WEIGHTSTORE_ASSIGN_OR_RETURN(uint64_t length, DeclaredBytes(v.storage, path));
    if (length > st.data.size() - st.pos) return Bad(path, absl::StrCat("TAR storage '", key, "' is truncated"));
    if (!roots.emplace(key, LazyStorage::Ready(bytes.Subspan(st.base + st.pos, length))).second) {
      return Bad(path, absl::StrCat("TAR storage '", key, "' appears twice"));
    }
    st.pos += length;
    objects[key] = &v;
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto views, next_pickle(st, "storage views"));
  if (views->root()->kind != Kind::kList) return Bad(path, "TAR storage views are not a list");
  for (const PickleValue* view : views->root()->items) {
    std::string target, root;
    uint64_t offset, numel;
    if (view->kind != Kind::kTuple || view->items.size() != 4 || !as_key(view->items[0], &target) ||
        !as_key(view->items[1], &root) || view->items[2]->kind != Kind::kInt || view->items[2]->i < 0 ||
        view->items[3]->kind != Kind::kInt || view->items[3]->i < 0) {
      return Bad(path, "TAR storage view is not (target, root, offset, numel)");
    }
    offset = static_cast<uint64_t>(view->items[2]->i);
    numel = static_cast<uint64_t>(view->items[3]->i);
    auto it = objects.find(root);
    if (it == objects.end() || it->second->kind != Kind::kStorage || it->second->storage.has_view) {
      return Bad(path, absl::StrCat("TAR storage view '", target, "' names unknown root '", root, "'"));
    }
    PickleValue& v = arena.emplace_back(*it->second);
    v.storage.has_view = true;
    v.storage.view_key = target;
    v.storage.view_offset = offset;
    v.storage.view_size = numel;
    objects[target] = &v;
  }

  WEIGHTSTORE_ASSIGN_OR_RETURN(TarEntry tensors_member, member("tensors"));
  Stream tt{bytes.view().substr(tensors_member.offset, tensors_member.size), tensors_member.offset};
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto tensor_count, next_pickle(tt, "tensor count"));
  if (tensor_count->root()->kind != Kind::kInt || tensor_count->root()->i < 0 ||
      static_cast<uint64_t>(tensor_count->root()->i) > options.max_tensors) {
    return Bad(path, "TAR tensor count is invalid");
  }
  for (int64_t n = 0; n < tensor_count->root()->i; ++n) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto header, next_pickle(tt, "tensor header"));
    const PickleValue* h = header->root();
    std::string key, storage_key;
    if (h->kind != Kind::kTuple || h->items.size() != 3 || !as_key(h->items[0], &key) ||
        !as_key(h->items[1], &storage_key)) {
      return Bad(path, "TAR tensor header is not (key, storage key, type)");
    }
    auto storage = objects.find(storage_key);
    if (storage == objects.end() || storage->second->kind != Kind::kStorage) {
      return Bad(path, absl::StrCat("TAR tensor '", key, "' names unknown storage '", storage_key, "'"));
    }
    ByteReader r(tt.data.substr(tt.pos));
    int32_t ndim;
    if (!r.ReadI32(&ndim) || ndim < 0 || ndim > 64 || !r.Skip(4)) {
      return Bad(path, absl::StrCat("TAR tensor '", key, "' has a bad rank"));
    }
    PickleValue& v = arena.emplace_back();
    v.kind = Kind::kTensor;
    v.tensor.storage = storage->second;
    for (int pass = 0; pass < 2; ++pass) {
      for (int32_t d = 0; d < ndim; ++d) {
        int64_t x;
        if (!r.ReadI64(&x) || x < 0) return Bad(path, absl::StrCat("TAR tensor '", key, "' has a bad size or stride"));
        (pass == 0 ? v.tensor.shape : v.tensor.strides).push_back(static_cast<uint64_t>(x));
      }
    }
    int64_t offset;
    if (!r.ReadI64(&offset) || offset < 0) return Bad(path, absl::StrCat("TAR tensor '", key, "' has a bad offset"));
    v.tensor.storage_offset = static_cast<uint64_t>(offset);
    tt.pos += r.position();
    objects[key] = &v;
  }

  WEIGHTSTORE_ASSIGN_OR_RETURN(TarEntry pickle_member, member("pickle"));
  Stream main{bytes.view().substr(pickle_member.offset, pickle_member.size), pickle_member.offset};
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto pickle, next_pickle(main, "main pickle"));
  StorageResolver resolve = [&](const PickleStorage& s) -> absl::StatusOr<std::shared_ptr<const LazyStorage>> {
    auto it = roots.find(s.key);
    if (it == roots.end()) return Bad(path, absl::StrCat("TAR storage '", s.key, "' has no data"));
    return ApplyView(s, it->second, path);
  };
  return BuildCheckpoint(pickle->root(), path, options, resolve, "tar", &objects);
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParsePlainPickle(SharedBytes bytes, const std::string& path,
                                                                   const OpenOptions& options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<PickleResult> pickle,
                               Unpickle(bytes.view(), absl::StrCat("'", path, "'")));
  StorageResolver resolve = [&](const PickleStorage& s) -> absl::StatusOr<std::shared_ptr<const LazyStorage>> {
    return Bad(path, absl::StrCat("is a plain pickle, which holds no data for storage '", s.key, "'"));
  };
  return BuildCheckpoint(pickle->root(), path, options, resolve, "pickle");
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParsePyTorch(SharedBytes bytes, const std::string& path,
                                                               const OpenOptions& options) {
  absl::string_view data = bytes.view();
  if (absl::StartsWith(data, "PK\x03\x04") || absl::StartsWith(data, "PK\x05\x06")) {
    return ParseZip(std::move(bytes), path, options);
  }
  if (data.size() >= 263 && data.substr(257, 5) == "ustar") return ParseTar(std::move(bytes), path, options);
  if (data.size() >= sizeof kLegacyMagic && std::memcmp(data.data(), kLegacyMagic, sizeof kLegacyMagic) == 0) {
    return ParseLegacy(std::move(bytes), path, options);
  }
  if (!data.empty() && static_cast<uint8_t>(data[0]) == 0x80) return ParsePlainPickle(std::move(bytes), path, options);
  // The file's bytes are not quoted: this message can reach a remote caller.
  return absl::InvalidArgumentError(
      absl::StrCat("'", path, "' is not a checkpoint of any known format (", FormatNames(), "; ",
                   data.empty() ? "the file is empty"
                                : absl::StrCat("no known signature in its first bytes; ", data.size(), " bytes"),
                   ")"));
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadPyTorch(std::shared_ptr<const MappedFile> file,
                                                              const OpenOptions& options) {
  return ParsePyTorch(file->bytes(), file->path(), options);
}

namespace {
constexpr absl::string_view kPyTorchExtensions[] = {".pt", ".pth"};
constexpr absl::string_view kPyTorchNamedExtensions[] = {".bin"};
bool DetectPyTorch(absl::string_view) { return true; }
}  // namespace

constinit const FormatSpec kPyTorchFormat = {
    .name = "pytorch",
    .extensions = kPyTorchExtensions,
    .named_extensions = kPyTorchNamedExtensions,
    .detect = DetectPyTorch,
    .open = ReadPyTorch,
    .contiguous_indices_when_applying = true,
};

}  // namespace weightstore
