// Snapshot: the tensors a selection yields from one checkpoint, under their new
// names, with any transformation (dtype cast, transpose) applied lazily, in one
// pass, when the bytes are read.
//
// Holds its checkpoint alive. Untransformed tensors read zero-copy, exactly as
// Checkpoint::Read. Thread-safe: immutable after construction.
#ifndef WEIGHTSTORE_CORE_SELECT_SNAPSHOT_H_
#define WEIGHTSTORE_CORE_SELECT_SNAPSHOT_H_

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "core/checkpoint.h"
#include "core/formats/checkpoint_writer.h"
#include "core/select/selection.h"
#include "core/select/slice.h"

namespace weightstore {

struct SnapshotTensor {
  TensorSpec spec;                          // name, dtype and shape as served
  const CheckpointEntry* source = nullptr;  // in the snapshot's checkpoint
  bool transpose = false;                   // rank-2 [r, c] source served as [c, r]
  // The part served of the (transposed) source; empty: all of it.
  TensorSlice slice;
  // A scale tensor served as its weight's shard asks (ShardSpec::scales):
  // the weight's served name, and whether a block it serves is shared with
  // another rank (a rank's part of the weight ends inside it).
  std::string scale_of;
  bool shares_scale_blocks = false;
  // ...and the weight elements one of its elements covers, per dimension.
  std::vector<uint64_t> scale_block;
  // A weight its checkpoint's quantization config describes, and that a scale
  // of a standard name follows in the file: the scheme, as
  // DescribeQuantScheme, and the config's file ("NVFP4, 4-bit values, blocks
  // of 1x16 (hf_quant_config.json)"). Empty otherwise.
  std::string quantization;

  // The shape before slicing: the source's, transposed when asked.
  std::vector<uint64_t> unsliced_shape() const;
  // The served bytes are the stored bytes, unchanged.
  bool is_identity() const { return !transpose && spec.dtype == source->spec.dtype && slice.empty(); }
  // When the served bytes are one run of the stored bytes of a contiguous
  // source (no transpose, no cast; a slice whose elements are consecutive):
  // the run's first byte, counted from the tensor's first. nullopt otherwise.
  std::optional<uint64_t> ByteRangeStart() const;
};

// InvalidArgument naming the tensor when `slice` of a sub-byte tensor of
// `dtype` and (unsliced) `shape` would split a byte: a range of its last
// dimension that does not start and stop on a whole unit of storage, or a
// slice of a tensor whose rows are not whole units (core/dtype.h). Never
// rounded, as the reference's MisalignedSlice.
absl::Status CheckUnitSlice(DType dtype, std::span<const uint64_t> shape, const TensorSlice& slice,
                            absl::string_view name);

// The served bytes that make one unit of `tensor`'s storage: a served range
// (ReadRange) starts and ends on them. One element, but for a sub-byte source
// (a unit's elements, cast).
uint64_t ServedUnitBytes(const SnapshotTensor& tensor);

class Snapshot {
 public:
  // Applies `selection` (rename, contiguous indices, filter, dtype, slices) to
  // every tensor of `checkpoint`. Returns InvalidArgument naming both tensors
  // when two are renamed to the same name, or naming the tensor a slice does
  // not fit; NotFound naming an explicit slice no served tensor has.
  static absl::StatusOr<std::shared_ptr<const Snapshot>> Select(std::shared_ptr<const Checkpoint> checkpoint,
                                                                const Selection& selection);
  // Builds a snapshot from chosen tensors (used by Apply). Names must be
  // unique; each spec's shape must be its slice's (InternalError else).
  static absl::StatusOr<std::shared_ptr<const Snapshot>> Create(std::shared_ptr<const Checkpoint> checkpoint,
                                                                std::vector<SnapshotTensor> tensors);

  const Checkpoint& checkpoint() const { return *checkpoint_; }
  const std::shared_ptr<const Checkpoint>& shared_checkpoint() const { return checkpoint_; }
  const std::vector<SnapshotTensor>& tensors() const { return tensors_; }
  size_t size() const { return tensors_.size(); }
  uint64_t total_bytes() const;
  // Returns the tensor served as `name`, or nullptr.
  const SnapshotTensor* Find(absl::string_view name) const;

  // Returns the tensor's bytes as served. Zero-copy for untransformed tensors.
  absl::StatusOr<SharedTensor> Read(const SnapshotTensor& tensor) const;
  absl::StatusOr<SharedTensor> Read(absl::string_view name) const;
  // Writes the served bytes into `out` (out.size() must be spec.byte_size()).
  absl::Status ReadInto(const SnapshotTensor& tensor, std::span<std::byte> out) const;
  // Writes the served bytes [offset, offset + out.size()) into `out`, gathering
  // and casting only that range: a transformed tensor can be streamed in chunks
  // without materializing all of it. Returns InvalidArgument unless the range
  // lies inside the tensor and both ends fall on element boundaries.
  absl::Status ReadRange(const SnapshotTensor& tensor, uint64_t offset, std::span<std::byte> out) const;

 private:
  Snapshot() = default;
  std::shared_ptr<const Checkpoint> checkpoint_;
  std::vector<SnapshotTensor> tensors_;
  absl::flat_hash_map<absl::string_view, size_t> by_name_;  // views into tensors_[i].spec.name
};

// Writes every tensor of `snapshot` (names, dtypes and transforms as served) to
// a `format` file at `path`, with `metadata`.
absl::Status WriteSnapshot(const Snapshot& snapshot, const std::string& path, const FormatSpec& format,
                           const Metadata& metadata, const WriteOptions& options);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_SNAPSHOT_H_
