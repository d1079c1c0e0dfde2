// Checkpoint: an immutable, ordered index of tensors plus string metadata, opened
// from a file of one of the formats in the table (core/format.h), or from a
// multi-file index (a sharded SafeTensors folder).
//
// Opening reads only headers and indices; tensor bytes are touched when Read() is
// called. Read() is zero-copy when the tensor is stored contiguously in the file:
// the returned bytes point into the mapping and keep it alive. Strided PyTorch
// tensors are gathered into a new buffer. Thread-safe: immutable after Open().
#ifndef WEIGHTSTORE_CORE_CHECKPOINT_H_
#define WEIGHTSTORE_CORE_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/format.h"
#include "core/mapped_file.h"
#include "core/quant_config.h"
#include "core/shared_bytes.h"
#include "core/tensor.h"

namespace weightstore {

// The bytes behind one or more tensors: a range of a mapped file, or something
// produced on first use (an inflated zip entry). Thread-safe.
class LazyStorage {
 public:
  using Producer = std::function<absl::StatusOr<SharedBytes>()>;

  static std::shared_ptr<const LazyStorage> Ready(SharedBytes bytes);
  // `producer` runs at most once successfully; it must return exactly `size` bytes.
  static std::shared_ptr<const LazyStorage> Deferred(uint64_t size, Producer producer);

  uint64_t size() const { return size_; }
  // True when Get() has the bytes without producing them.
  bool ready() const;
  // Returns the bytes, producing them on first use.
  absl::StatusOr<SharedBytes> Get() const;

 private:
  LazyStorage() = default;
  uint64_t size_ = 0;
  Producer producer_;
  mutable absl::Mutex mu_;
  mutable std::optional<SharedBytes> bytes_ ABSL_GUARDED_BY(mu_);
};

// Where one tensor's elements are inside its storage.
struct TensorLayout {
  std::shared_ptr<const LazyStorage> storage;
  uint64_t offset = 0;            // bytes from the start of the storage to element 0
  std::vector<uint64_t> strides;  // in elements; empty means contiguous row-major
  bool normalize_bool = false;    // map every nonzero byte of a BOOL tensor to 1
};

struct CheckpointEntry {
  TensorSpec spec;
  TensorLayout layout;
};

struct OpenOptions {
  // PyTorch: select this root key (whose value must be a dict) before flattening.
  // Default: none, flatten the whole root dict.
  std::string top_level_key;
  // PyTorch zip: verify the CRC-32 of tensor storages too (the pickle and small
  // records are always verified). Default: false (costs a pass over the data).
  bool verify_crc = false;
  // Largest SafeTensors JSON header accepted. Default: 100,000,000 bytes, as the
  // reference implementation.
  uint64_t max_header_bytes = 100000000;
  // Largest number of tensors in one checkpoint. Default: 100,000 (as Burnpack).
  uint64_t max_tensors = 100000;
  // Longest tensor name. Default: 4096 bytes.
  size_t max_name_bytes = 4096;
  // A strided (PyTorch) tensor may be served as at most this many times the
  // bytes of storage it reads, or 1 MiB, whichever is more: a broadcast view
  // (stride 0) of a few stored bytes could otherwise claim gigabytes.
  // Default: 16.
  uint64_t max_expansion = 16;
  // PyTorch zip: bytes of compressed storage records one checkpoint may have
  // inflated (and kept while it is served); torch.save never compresses them.
  // Default: 256 MiB.
  uint64_t max_inflated_bytes = uint64_t{256} << 20;
  // Burn bincode records (.bin, .bin.gz): path of the layout JSON they are read
  // with ({"parameters": [{"path", "shape"}, ...]} in declaration order), since
  // bincode stores no names. Ignored by every other format. Default: empty,
  // none (a bincode record is then refused, saying a layout is needed).
  std::string record_layout;
  // Burn gzip records (.mpk.gz, .json.gz, .bin.gz): bytes one record may
  // inflate to, kept while it is served. Also refused: more than 1100 times
  // the compressed size (deflate cannot exceed about 1032:1). Both are checked
  // while inflating. Also bounds the bytes a record's converted tensors
  // (JSON bytes, <= 0.13 values) take. Default: 8 GiB.
  uint64_t max_record_inflated_bytes = uint64_t{8} << 30;
  MappedFileOptions mapped_file;
  // Opens each file of the checkpoint (the file itself, or an index and its
  // shards). Default (empty): MappedFile::Open with `mapped_file`. PreloadFile
  // (core/sealed_memfd.h) reads files into sealed memory instead.
  std::function<absl::StatusOr<std::shared_ptr<const MappedFile>>(const std::string& path)> open_file;
};

// Where a tensor's bytes lie in one of a checkpoint's files.
struct FileExtent {
  size_t file = 0;      // index into Checkpoint::files()
  uint64_t offset = 0;  // from the start of the file
};

class Checkpoint {
 public:
  // Opens `path`, detecting the format from its content (core/format.h): a
  // file, an index of a multi-file checkpoint (by its suffix, e.g.
  // `*.safetensors.index.json`), or a folder holding exactly one such index;
  // and the quantization config beside it (QuantizationConfig::ReadBeside).
  // Returns NotFound if missing and InvalidArgument, naming the file and the
  // fault, if the checkpoint or its quantization config is malformed.
  static absl::StatusOr<std::shared_ptr<const Checkpoint>> Open(const std::string& path,
                                                                const OpenOptions& options = {});

  // Builds a checkpoint from parts (used by the format readers and by tests).
  // Returns InvalidArgument if two entries share a name, a layout does not fit
  // its storage, or an entry exceeds `options`' name and expansion limits.
  // `detail` describes the container ("zip", "legacy", ...) for inspection.
  // `files` are the files the storages point into (see Locate()).
  static absl::StatusOr<std::shared_ptr<const Checkpoint>> Create(
      const FormatSpec& format, std::string path, Metadata metadata, std::vector<CheckpointEntry> entries,
      std::string detail = "", std::vector<std::shared_ptr<const MappedFile>> files = {},
      const OpenOptions& options = OpenOptions());

  const FormatSpec& format() const { return *format_; }
  const std::string& path() const { return path_; }
  // How the format was stored, e.g. "zip" or "legacy" for PyTorch; may be empty.
  const std::string& detail() const { return detail_; }
  const Metadata& metadata() const { return metadata_; }
  size_t size() const { return entries_.size(); }
  // Tensors in file order.
  const std::vector<CheckpointEntry>& entries() const { return entries_; }
  // Sum of every tensor's byte_size().
  uint64_t total_bytes() const { return total_bytes_; }
  // The files this checkpoint was opened from (for an index: its shards). Empty
  // for checkpoints built from parts.
  const std::vector<std::shared_ptr<const MappedFile>>& files() const { return files_; }
  // What the quantization config beside the checkpoint's file says
  // (core/quant_config.h), read by Open(); nullptr when there is none.
  const QuantizationConfig* quantization() const { return quantization_.get(); }
  // Its scheme for `entry` (one of entries()), looked up once at Open:
  // nullptr without a config or where the config leaves the tensor's module
  // unquantized.
  const QuantScheme* QuantSchemeOf(const CheckpointEntry& entry) const;
  // Returns where `bytes` (from Read()) lie in one of files(), or nullopt when
  // they are not file bytes (gathered, inflated or fixed up).
  std::optional<FileExtent> Locate(const SharedBytes& bytes) const;

  // Returns the entry named `name`, or nullptr.
  const CheckpointEntry* Find(absl::string_view name) const;

  // Returns the tensor's bytes (row-major, little-endian). Zero-copy when the
  // tensor is contiguous in its storage. Returns NotFound for an unknown name and
  // DataLoss if its storage cannot be read.
  absl::StatusOr<SharedTensor> Read(absl::string_view name) const;
  absl::StatusOr<SharedTensor> Read(const CheckpointEntry& entry) const;

  // Copies the tensor's bytes (row-major, little-endian) into `out`, gathering
  // strided tensors. Returns InvalidArgument unless out.size() == byte_size(),
  // DataLoss if its storage cannot be read.
  absl::Status ReadInto(const CheckpointEntry& entry, std::span<std::byte> out) const;

  // Reads the tensor into a new HostBuffer-backed SharedTensor: always a copy,
  // into memory owned by the result (not the file).
  absl::StatusOr<SharedTensor> ReadCopy(const CheckpointEntry& entry) const;

  // True when Read() of this entry returns a view rather than a new buffer (a
  // PyTorch BOOL tensor holding bytes other than 0 and 1 is copied regardless).
  static bool IsZeroCopy(const CheckpointEntry& entry);

 private:
  Checkpoint() = default;

  const FormatSpec* format_ = nullptr;
  std::string path_;
  std::string detail_;
  Metadata metadata_;
  std::vector<CheckpointEntry> entries_;
  absl::flat_hash_map<std::string, size_t> by_name_;
  uint64_t total_bytes_ = 0;
  std::vector<std::shared_ptr<const MappedFile>> files_;
  std::shared_ptr<const QuantizationConfig> quantization_;
  std::vector<const QuantScheme*> quant_schemes_;  // per entry, into *quantization_
};

// Opens `path` with options.open_file, or MappedFile::Open when it is unset.
absl::StatusOr<std::shared_ptr<const MappedFile>> OpenCheckpointFile(const std::string& path,
                                                                     const OpenOptions& options);

// Files a checkpoint is opened from other than its paths, keyed by the path
// it names: new files not yet renamed into place, read through descriptors
// the caller keeps open (each is duplicated), and files that another version
// already maps.
struct FileOverrides {
  absl::flat_hash_map<std::string, int> descriptors;
  absl::flat_hash_map<std::string, std::shared_ptr<const MappedFile>> mapped;
};

// Opens `path` as a checkpoint, its files through `overrides` where named
// there and as `options` says otherwise. `from_descriptors`, if given,
// receives the files opened from descriptors, so a caller can tell whether
// the checkpoint named each of them and check them again later.
absl::StatusOr<std::shared_ptr<const Checkpoint>> OpenCheckpointWith(
    const std::string& path, const OpenOptions& options, const FileOverrides& overrides,
    std::vector<std::shared_ptr<const MappedFile>>* from_descriptors = nullptr);

// Copies the elements of a strided tensor into row-major order.
// REQUIRES: the layout was validated (every element lies inside `storage`).
void GatherStrided(const std::byte* storage, uint64_t element_size, std::span<const uint64_t> shape,
                   std::span<const uint64_t> strides, std::byte* out);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CHECKPOINT_H_
