#include "core/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checked_math.h"
#include "core/host_buffer.h"
#include "core/status_macros.h"
#include "core/status_util.h"
#include "core/utf8.h"

namespace weightstore {

std::shared_ptr<const LazyStorage> LazyStorage::Ready(SharedBytes bytes) {
  std::shared_ptr<LazyStorage> storage(new LazyStorage());
  storage->size_ = bytes.size();
  absl::MutexLock lock(&storage->mu_);
  storage->bytes_ = std::move(bytes);
  return storage;
}

std::shared_ptr<const LazyStorage> LazyStorage::Deferred(uint64_t size, Producer producer) {
  std::shared_ptr<LazyStorage> storage(new LazyStorage());
  storage->size_ = size;
  storage->producer_ = std::move(producer);
  return storage;
}

bool LazyStorage::ready() const {
  absl::MutexLock lock(&mu_);
  return bytes_.has_value();
}

absl::StatusOr<SharedBytes> LazyStorage::Get() const {
  absl::MutexLock lock(&mu_);
  if (bytes_.has_value()) return *bytes_;
  WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes bytes, producer_());
  if (bytes.size() != size_) {
    return absl::DataLossError(absl::StrCat("storage produced ", bytes.size(), " bytes, expected ", size_));
  }
  bytes_ = bytes;
  return bytes;
}

namespace {

bool IsContiguous(std::span<const uint64_t> shape, std::span<const uint64_t> strides) {
  uint64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;  // a size-1 dim's stride is irrelevant
    if (strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

absl::Status ValidateEntry(CheckpointEntry& entry, absl::string_view path) {
  const TensorSpec& spec = entry.spec;
  auto fault = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "' in '", path, "': ", what));
  };
  if (spec.name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' has a tensor with an empty name"));
  }
  if (!IsValidUtf8(spec.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' has a tensor name that is not UTF-8: '", absl::CHexEscape(spec.name), "'"));
  }
  if (entry.layout.storage == nullptr) return fault("has no storage");
  if (spec.shape.size() > kMaxRank) {
    return fault(absl::StrCat("has rank ", spec.shape.size(), "; at most ", kMaxRank, " dimensions are supported"));
  }
  const uint64_t element_size = DTypeSize(spec.dtype);
  auto numel = CheckedNumElements(spec.shape);
  if (numel && *numel % DTypeUnitElements(spec.dtype) != 0) {
    return fault(absl::StrCat("has ", *numel, " ", DTypeName(spec.dtype), " elements: not a whole number of bytes"));
  }
  if (IsSubByte(spec.dtype) && !entry.layout.strides.empty() &&
      (entry.layout.strides.size() != spec.shape.size() || !IsContiguous(spec.shape, entry.layout.strides))) {
    return fault(absl::StrCat("is a strided view of ", DTypeName(spec.dtype), " elements, which are packed"));
  }
  auto nbytes = numel ? DTypeBytes(spec.dtype, *numel) : std::nullopt;
  if (!nbytes) return fault(absl::StrCat("shape ", ShapeToString(spec.shape), " overflows"));
  const uint64_t storage_size = entry.layout.storage->size();
  if (!entry.layout.strides.empty()) {
    if (entry.layout.strides.size() != spec.shape.size()) {
      return fault(absl::StrCat("has ", entry.layout.strides.size(), " strides for rank ", spec.shape.size()));
    }
    if (IsContiguous(spec.shape, entry.layout.strides)) entry.layout.strides.clear();
  }
  if (entry.layout.strides.empty() || *numel == 0) {
    entry.layout.strides.clear();
    auto end = CheckedAdd(entry.layout.offset, *nbytes);
    if (!end || *end > storage_size) {
      return fault(absl::StrCat("bytes [", entry.layout.offset, ", +", *nbytes, ") lie outside its storage of ",
                                storage_size, " bytes"));
    }
    return absl::OkStatus();
  }
  // Strided: the last element reached is offset + sum((dim - 1) * stride).
  uint64_t last = 0;
  for (size_t i = 0; i < spec.shape.size(); ++i) {
    auto term = CheckedMul(spec.shape[i] - 1, entry.layout.strides[i]);
    auto sum = term ? CheckedAdd(last, *term) : std::nullopt;
    if (!sum) return fault("strides overflow");
    last = *sum;
  }
  auto last_byte = CheckedMul(last, element_size);
  auto end = last_byte ? CheckedAdd(entry.layout.offset, *last_byte) : std::nullopt;
  end = end ? CheckedAdd(*end, element_size) : std::nullopt;
  if (!end || *end > storage_size) {
    return fault(absl::StrCat("strided view reaches past its storage of ", storage_size, " bytes"));
  }
  return absl::OkStatus();
}

// Bytes of storage a validated entry reads: from its first element to its last.
uint64_t StoredSpan(const CheckpointEntry& entry) {
  const uint64_t size = entry.spec.byte_size();
  if (entry.layout.strides.empty() || size == 0) return size;
  uint64_t last = 0;
  for (size_t i = 0; i < entry.spec.shape.size(); ++i) last += (entry.spec.shape[i] - 1) * entry.layout.strides[i];
  return (last + 1) * DTypeSize(entry.spec.dtype);
}

// What OpenOptions bounds beyond the layout checks: the name's length, and how
// far a strided view may expand what it reads.
absl::Status CheckLimits(const CheckpointEntry& entry, absl::string_view path, const OpenOptions& options) {
  if (entry.spec.name.size() > options.max_name_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' has a tensor name of ", entry.spec.name.size(),
                                                   " bytes; at most ", options.max_name_bytes, " are allowed"));
  }
  const uint64_t served = entry.spec.byte_size(), stored = StoredSpan(entry);
  const uint64_t allowed = std::max<uint64_t>(
      uint64_t{1} << 20, CheckedMul(stored, options.max_expansion).value_or(std::numeric_limits<uint64_t>::max()));
  if (served > allowed) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", entry.spec.name, "' in '", path, "' is a strided view that expands ", stored,
                     " stored bytes to ", served, " bytes, more than ", options.max_expansion, "x (--max-expansion)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Checkpoint>> Checkpoint::Create(
    const FormatSpec& format, std::string path, Metadata metadata, std::vector<CheckpointEntry> entries,
    std::string detail, std::vector<std::shared_ptr<const MappedFile>> files, const OpenOptions& options) {
  std::shared_ptr<Checkpoint> checkpoint(new Checkpoint());
  checkpoint->detail_ = std::move(detail);
  checkpoint->files_ = std::move(files);
  checkpoint->format_ = &format;
  checkpoint->path_ = std::move(path);
  checkpoint->metadata_ = std::move(metadata);
  checkpoint->by_name_.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    WEIGHTSTORE_RETURN_IF_ERROR(ValidateEntry(entries[i], checkpoint->path_));
    WEIGHTSTORE_RETURN_IF_ERROR(CheckLimits(entries[i], checkpoint->path_, options));
    auto [it, inserted] = checkpoint->by_name_.emplace(entries[i].spec.name, i);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", checkpoint->path_, "' has two tensors named '", entries[i].spec.name, "'"));
    }
    checkpoint->total_bytes_ += entries[i].spec.byte_size();
  }
  checkpoint->entries_ = std::move(entries);
  return std::shared_ptr<const Checkpoint>(std::move(checkpoint));
}

namespace {

absl::StatusOr<std::shared_ptr<const Checkpoint>> OpenFiles(const std::string& path, const OpenOptions& options,
                                                            std::shared_ptr<const MappedFile>* file) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    std::vector<std::string> indexes;
    for (auto it = std::filesystem::directory_iterator(path, ec); !ec && it != std::filesystem::directory_iterator();
         it.increment(ec)) {
      if (IndexFormatForPath(it->path().filename().string()) != nullptr) indexes.push_back(it->path().string());
    }
    if (ec) return absl::NotFoundError(absl::StrCat("cannot list folder '", path, "': ", ec.message()));
    if (indexes.size() != 1) {
      std::vector<std::string> suffixes;
      for (const FormatSpec* f : Formats()) {
        if (!f->index_suffix.empty()) suffixes.push_back(absl::StrCat("*", f->index_suffix));
      }
      return absl::InvalidArgumentError(absl::StrCat("folder '", path, "' must hold exactly one ",
                                                     absl::StrJoin(suffixes, " or "), ", found ", indexes.size()));
    }
    return IndexFormatForPath(indexes[0])->open_index(indexes[0], options);
  }
  if (const FormatSpec* index = IndexFormatForPath(path)) return index->open_index(path, options);

  WEIGHTSTORE_ASSIGN_OR_RETURN(*file, OpenCheckpointFile(path, options));
  const FormatSpec* format = DetectFormat((*file)->bytes().view());
  if (format == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is not a checkpoint of any known format (", FormatNames(), ")"));
  }
  return format->open(*file, options);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Checkpoint>> Checkpoint::Open(const std::string& path,
                                                                   const OpenOptions& options) {
  std::shared_ptr<const MappedFile> file;
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> opened, OpenFiles(path, options, &file));
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<std::shared_ptr<const QuantizationConfig>> quantization,
                               QuantizationConfig::ReadBeside(path));
  // Nobody else holds the new checkpoint yet. The readers build it from byte
  // ranges; record the file they came from (an index records its shards).
  Checkpoint& mutable_checkpoint = const_cast<Checkpoint&>(*opened);
  if (file != nullptr) mutable_checkpoint.files_ = {std::move(file)};
  if (quantization) {
    mutable_checkpoint.quantization_ = std::move(*quantization);
    mutable_checkpoint.quant_schemes_.reserve(opened->entries_.size());
    for (const CheckpointEntry& entry : opened->entries_) {
      mutable_checkpoint.quant_schemes_.push_back(mutable_checkpoint.quantization_->SchemeOf(entry.spec.name));
    }
  }
  return opened;
}

const QuantScheme* Checkpoint::QuantSchemeOf(const CheckpointEntry& entry) const {
  if (quant_schemes_.empty()) return nullptr;
  const size_t i = static_cast<size_t>(&entry - entries_.data());
  return i < quant_schemes_.size() ? quant_schemes_[i] : nullptr;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> OpenCheckpointFile(const std::string& path,
                                                                     const OpenOptions& options) {
  if (options.open_file) return options.open_file(path);
  return MappedFile::Open(path, options.mapped_file);
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> OpenCheckpointWith(
    const std::string& path, const OpenOptions& options, const FileOverrides& overrides,
    std::vector<std::shared_ptr<const MappedFile>>* from_descriptors) {
  OpenOptions open = options;
  open.open_file = [&](const std::string& file) -> absl::StatusOr<std::shared_ptr<const MappedFile>> {
    if (auto it = overrides.descriptors.find(file); it != overrides.descriptors.end()) {
      const int copy = ::fcntl(it->second, F_DUPFD_CLOEXEC, 0);
      if (copy < 0) return StatusFromErrno(errno, absl::StrCat("cannot read '", file, "'"));
      WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> opened, MappedFile::FromDescriptor(copy, file));
      if (from_descriptors != nullptr) from_descriptors->push_back(opened);
      return opened;
    }
    if (auto it = overrides.mapped.find(file); it != overrides.mapped.end()) return it->second;
    return OpenCheckpointFile(file, options);
  };
  return Checkpoint::Open(path, open);
}

std::optional<FileExtent> Checkpoint::Locate(const SharedBytes& bytes) const {
  for (size_t i = 0; i < files_.size(); ++i) {
    uint64_t offset = 0;
    if (files_[i]->Contains(bytes, &offset)) return FileExtent{i, offset};
  }
  return std::nullopt;
}

const CheckpointEntry* Checkpoint::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

absl::StatusOr<SharedTensor> Checkpoint::Read(absl::string_view name) const {
  const CheckpointEntry* entry = Find(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' not in '", path_, "'"));
  }
  return Read(*entry);
}

bool Checkpoint::IsZeroCopy(const CheckpointEntry& entry) { return entry.layout.strides.empty(); }

namespace {

absl::StatusOr<SharedBytes> StorageOf(const CheckpointEntry& entry) {
  absl::StatusOr<SharedBytes> storage = entry.layout.storage->Get();
  if (!storage.ok()) {
    return absl::Status(storage.status().code(),
                        absl::StrCat("tensor '", entry.spec.name, "': ", storage.status().message()));
  }
  return storage;
}

bool NeedsBoolFix(const CheckpointEntry& entry, std::span<const std::byte> bytes) {
  if (!entry.layout.normalize_bool || entry.spec.dtype != DType::kBool) return false;
  for (std::byte b : bytes) {
    if (static_cast<uint8_t>(b) > 1) return true;
  }
  return false;
}

void FixBools(std::span<std::byte> bytes) {
  for (std::byte& b : bytes) b = std::byte{b != std::byte{0}};
}

}  // namespace

absl::StatusOr<SharedTensor> Checkpoint::Read(const CheckpointEntry& entry) const {
  if (!entry.layout.strides.empty()) return ReadCopy(entry);
  WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes storage, StorageOf(entry));
  SharedTensor tensor{entry.spec, storage.Subspan(entry.layout.offset, entry.spec.byte_size())};
  if (NeedsBoolFix(entry, tensor.bytes.span())) return ReadCopy(entry);
  return tensor;
}

absl::Status Checkpoint::ReadInto(const CheckpointEntry& entry, std::span<std::byte> out) const {
  const uint64_t nbytes = entry.spec.byte_size();
  WEIGHTSTORE_RETURN_IF_ERROR(CheckDestination(entry.spec, out.size()));
  WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes storage, StorageOf(entry));
  if (entry.layout.strides.empty()) {
    if (nbytes > 0) std::memcpy(out.data(), storage.data() + entry.layout.offset, nbytes);
  } else {
    GatherStrided(storage.data() + entry.layout.offset, DTypeSize(entry.spec.dtype), entry.spec.shape,
                  entry.layout.strides, out.data());
  }
  if (NeedsBoolFix(entry, out)) FixBools(out);
  return absl::OkStatus();
}

absl::StatusOr<SharedTensor> Checkpoint::ReadCopy(const CheckpointEntry& entry) const {
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(entry.spec.byte_size()));
  WEIGHTSTORE_RETURN_IF_ERROR(ReadInto(entry, buffer.span()));
  return SharedTensor{entry.spec, std::move(buffer).Freeze()};
}

namespace {

template <size_t kSize>
void GatherTyped(const std::byte* storage, std::span<const uint64_t> shape, std::span<const uint64_t> strides,
                 std::byte* out) {
  const size_t rank = shape.size();
  const uint64_t inner = shape[rank - 1], inner_stride = strides[rank - 1] * kSize;
  std::vector<uint64_t> index(rank, 0);
  uint64_t outer_count = 1;
  for (size_t i = 0; i + 1 < rank; ++i) outer_count *= shape[i];
  for (uint64_t o = 0; o < outer_count; ++o) {
    uint64_t base = 0;
    for (size_t i = 0; i + 1 < rank; ++i) base += index[i] * strides[i];
    const std::byte* src = storage + base * kSize;
    for (uint64_t j = 0; j < inner; ++j, src += inner_stride, out += kSize) {
      std::memcpy(out, src, kSize);
    }
    for (size_t i = rank - 1; i-- > 0;) {  // odometer over the outer dims
      if (++index[i] < shape[i]) break;
      index[i] = 0;
    }
  }
}

}  // namespace

void GatherStrided(const std::byte* storage, uint64_t element_size, std::span<const uint64_t> shape,
                   std::span<const uint64_t> strides, std::byte* out) {
  if (shape.empty()) {
    std::memcpy(out, storage, element_size);
    return;
  }
  switch (element_size) {
    case 1:
      return GatherTyped<1>(storage, shape, strides, out);
    case 2:
      return GatherTyped<2>(storage, shape, strides, out);
    case 4:
      return GatherTyped<4>(storage, shape, strides, out);
    default:
      return GatherTyped<8>(storage, shape, strides, out);
  }
}

}  // namespace weightstore
