#include "core/select/snapshot.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/host_buffer.h"
#include "core/select/dtype_cast.h"
#include "core/select/pipeline.h"
#include "core/status_macros.h"

namespace weightstore {

std::vector<uint64_t> SnapshotTensor::unsliced_shape() const {
  std::vector<uint64_t> shape = source->spec.shape;
  if (transpose && shape.size() == 2) std::swap(shape[0], shape[1]);
  return shape;
}

namespace {

// A sub-byte tensor (core/dtype.h) as its storage sees it: its shape and its
// slice in units of storage rather than elements (the last dimension divided
// by the elements a unit holds; a whole tensor flattened to its units).
// REQUIRES: CheckUnitSlice.
struct UnitView {
  std::vector<uint64_t> shape;
  TensorSlice slice;
};

UnitView ToUnits(DType dtype, const std::vector<uint64_t>& shape, const TensorSlice& slice) {
  const uint64_t per_unit = DTypeUnitElements(dtype);
  UnitView view;
  if (slice.empty()) {
    uint64_t elements = 1;
    for (uint64_t d : shape) elements *= d;
    view.shape = {elements / per_unit};
    return view;
  }
  view.shape = shape;
  view.shape.back() /= per_unit;
  view.slice = slice;
  for (IndexRange& r : view.slice.dims.back()) {
    r.start /= per_unit;
    r.stop /= per_unit;
  }
  return view;
}

}  // namespace

absl::Status CheckUnitSlice(DType dtype, std::span<const uint64_t> shape, const TensorSlice& slice,
                            absl::string_view name) {
  const uint64_t per_unit = DTypeUnitElements(dtype);
  if (per_unit == 1 || slice.empty()) return absl::OkStatus();
  const std::string what = absl::StrCat("tensor '", name, "' (", DTypeName(dtype), " ", ShapeToString(shape), ")");
  if (shape.empty() || shape.back() % per_unit != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": its rows are not whole bytes (", DTypeName(dtype),
                                                   " packs ", per_unit, " elements in ", DTypeSize(dtype),
                                                   " bytes), so it is served whole only"));
  }
  for (const IndexRange& r : slice.dims.back()) {
    if (r.start % per_unit != 0 || r.stop % per_unit != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the slice [", r.start, ":", r.stop, "] of its last dimension would split a byte (", DTypeName(dtype),
          " packs ", per_unit, " elements in ", DTypeSize(dtype), " bytes); cut at multiples of ", per_unit));
    }
  }
  return absl::OkStatus();
}

uint64_t ServedUnitBytes(const SnapshotTensor& tensor) {
  const DType from = tensor.source->spec.dtype, to = tensor.spec.dtype;
  if (from == to) return DTypeSize(to);
  return DTypeUnitElements(from) * DTypeSize(to);  // a cast's target is never sub-byte
}

std::optional<uint64_t> SnapshotTensor::ByteRangeStart() const {
  if (transpose || spec.dtype != source->spec.dtype || !Checkpoint::IsZeroCopy(*source)) return std::nullopt;
  if (IsSubByte(spec.dtype)) {
    const UnitView units = ToUnits(spec.dtype, source->spec.shape, slice);
    std::optional<uint64_t> first = units.slice.ContiguousStart(units.shape);
    if (!first) return std::nullopt;
    return *first * DTypeSize(spec.dtype);
  }
  std::optional<uint64_t> first = slice.ContiguousStart(source->spec.shape);
  if (!first) return std::nullopt;
  return *first * DTypeSize(spec.dtype);
}

absl::StatusOr<std::shared_ptr<const Snapshot>> Snapshot::Select(std::shared_ptr<const Checkpoint> checkpoint,
                                                                 const Selection& selection) {
  const SelectionDeadline deadline(selection.limits());
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<NamedEntry> named,
                               ResolveNames(*checkpoint, selection, /*applying_to_target=*/false, deadline));
  std::vector<SnapshotTensor> tensors;
  tensors.reserve(named.size());
  for (NamedEntry& n : named) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(bool kept, selection.Matches(n.name, deadline));
    if (!kept) continue;
    tensors.push_back(StartTensor(*checkpoint, checkpoint->entries()[n.entry], std::move(n.name)));
    WEIGHTSTORE_RETURN_IF_ERROR(CastToSelectionDType(selection, &tensors.back()));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(CutTensors(*checkpoint, selection, deadline, &tensors, [](size_t, bool) {}));
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Snapshot> snapshot,
                               Create(std::move(checkpoint), std::move(tensors)));
  WEIGHTSTORE_RETURN_IF_ERROR(
      selection.CheckSlicesUsed([&](absl::string_view name) { return snapshot->Find(name) != nullptr; }));
  return snapshot;
}

absl::StatusOr<std::shared_ptr<const Snapshot>> Snapshot::Create(std::shared_ptr<const Checkpoint> checkpoint,
                                                                 std::vector<SnapshotTensor> tensors) {
  std::shared_ptr<Snapshot> snapshot(new Snapshot());
  snapshot->tensors_ = std::move(tensors);  // by_name_ views point into these names
  snapshot->by_name_.reserve(snapshot->tensors_.size());
  for (size_t i = 0; i < snapshot->tensors_.size(); ++i) {
    const SnapshotTensor& t = snapshot->tensors_[i];
    if (t.transpose && t.source->spec.shape.size() != 2) {
      return absl::InternalError(absl::StrCat("tensor '", t.spec.name, "': transpose needs a rank-2 source"));
    }
    if (t.transpose && IsSubByte(t.source->spec.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.spec.name, "': its ",
                                                     DTypeName(t.source->spec.dtype),
                                                     " elements are packed and cannot be transposed"));
    }
    const std::vector<uint64_t> unsliced = t.unsliced_shape();
    WEIGHTSTORE_RETURN_IF_ERROR(t.slice.Check(unsliced, t.spec.name));
    WEIGHTSTORE_RETURN_IF_ERROR(CheckUnitSlice(t.source->spec.dtype, unsliced, t.slice, t.spec.name));
    if (t.spec.shape != (t.slice.empty() ? unsliced : t.slice.Shape())) {
      return absl::InternalError(absl::StrCat("tensor '", t.spec.name, "': served shape ", ShapeToString(t.spec.shape),
                                              " is not that of its source and slice"));
    }
    WEIGHTSTORE_RETURN_IF_ERROR(CheckCast(t.source->spec.dtype, t.spec.dtype));
    if (!snapshot->by_name_.emplace(t.spec.name, i).second) {
      return absl::InvalidArgumentError(absl::StrCat("two tensors are served as '", t.spec.name, "'"));
    }
  }
  snapshot->checkpoint_ = std::move(checkpoint);
  return std::shared_ptr<const Snapshot>(std::move(snapshot));
}

uint64_t Snapshot::total_bytes() const {
  uint64_t total = 0;
  for (const SnapshotTensor& t : tensors_) total += t.spec.byte_size();
  return total;
}

const SnapshotTensor* Snapshot::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<SharedTensor> Snapshot::Read(absl::string_view name) const {
  const SnapshotTensor* t = Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("tensor '", name, "' not in this selection of '", checkpoint_->path(), "'"));
  }
  return Read(*t);
}

absl::StatusOr<SharedTensor> Snapshot::Read(const SnapshotTensor& tensor) const {
  std::optional<uint64_t> start;
  if (tensor.is_identity() || (start = tensor.ByteRangeStart())) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, checkpoint_->Read(*tensor.source));
    t.spec = tensor.spec;
    if (start) t.bytes = t.bytes.Subspan(*start, tensor.spec.byte_size());
    return t;
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(tensor.spec.byte_size()));
  WEIGHTSTORE_RETURN_IF_ERROR(ReadInto(tensor, buffer.span()));
  return SharedTensor{tensor.spec, std::move(buffer).Freeze()};
}

absl::Status Snapshot::ReadInto(const SnapshotTensor& tensor, std::span<std::byte> out) const {
  if (tensor.is_identity()) return checkpoint_->ReadInto(*tensor.source, out);
  WEIGHTSTORE_RETURN_IF_ERROR(CheckDestination(tensor.spec, out.size()));
  if (!tensor.slice.empty()) return ReadRange(tensor, 0, out);
  // Source bytes (a view when contiguous), then one pass of transpose and cast.
  WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor source, checkpoint_->Read(*tensor.source));
  const DType from = tensor.source->spec.dtype, to = tensor.spec.dtype;
  if (tensor.transpose) {
    TransposeCast(from, source.bytes.data(), to, out.data(), tensor.source->spec.shape[0],
                  tensor.source->spec.shape[1]);
  } else {
    CastElements(from, source.bytes.data(), to, out.data(), tensor.source->spec.num_elements());
  }
  return absl::OkStatus();
}

namespace {

// One served dimension as the odometer walks it: served index i lies in range
// k (served_start[k] <= i < served_start[k + 1]) and reads source index
// source_start[k] + (i - served_start[k]), `stride` elements apart.
struct DimWalk {
  uint64_t size = 0;
  uint64_t stride = 0;
  std::vector<uint64_t> served_start, source_start;

  size_t RangeOf(uint64_t i) const {
    return static_cast<size_t>(std::upper_bound(served_start.begin(), served_start.end(), i) - served_start.begin()) -
           1;
  }
  uint64_t RangeEnd(size_t k) const { return k + 1 < served_start.size() ? served_start[k + 1] : size; }
};

}  // namespace

absl::Status Snapshot::ReadRange(const SnapshotTensor& tensor, uint64_t offset, std::span<std::byte> out) const {
  const CheckpointEntry& source = *tensor.source;
  // Sizes in units of storage (core/dtype.h): one element but for sub-byte
  // sources, whose shape and slice are then counted in units too.
  const uint64_t out_size = ServedUnitBytes(tensor), in_size = DTypeSize(source.spec.dtype);
  const uint64_t per_unit = DTypeUnitElements(source.spec.dtype);
  UnitView units;
  const std::vector<uint64_t>* source_shape = &source.spec.shape;
  const TensorSlice* slice = &tensor.slice;
  if (per_unit > 1) {
    units = ToUnits(source.spec.dtype, source.spec.shape, tensor.slice);
    source_shape = &units.shape;
    slice = &units.slice;
  }
  const uint64_t total = tensor.spec.byte_size();
  if (offset > total || out.size() > total - offset || offset % out_size != 0 || out.size() % out_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("bytes [", offset, ", +", out.size(), ") are not a range of ",
                                                   DTypeName(tensor.spec.dtype), " elements of tensor '",
                                                   tensor.spec.name, "' (", total, " bytes)"));
  }
  if (out.empty()) return absl::OkStatus();
  absl::StatusOr<SharedBytes> storage = source.layout.storage->Get();
  if (!storage.ok()) {
    return absl::Status(storage.status().code(),
                        absl::StrCat("tensor '", source.spec.name, "': ", storage.status().message()));
  }
  const std::byte* base = storage->data() + source.layout.offset;
  // A transposed tensor is 2-D, so its slice (if any) has two dimensions.
  if (tensor.transpose && source.layout.strides.empty() &&
      (tensor.slice.empty() || (tensor.slice.dims[0].size() == 1 && tensor.slice.dims[1].size() == 1))) {
    // Whole rows of the served [c, r] matrix (of the block a slice keeps:
    // source rows [r0, r1), columns [c0, c1)): produced by tiles, as reads a
    // column at a time would touch a cache line per element.
    const uint64_t cols = source.spec.shape[1];
    const IndexRange c = tensor.slice.empty() ? IndexRange{0, cols} : tensor.slice.dims[0][0];
    const IndexRange r = tensor.slice.empty() ? IndexRange{0, source.spec.shape[0]} : tensor.slice.dims[1][0];
    const uint64_t rows = r.size(), row_bytes = rows * out_size;
    if (row_bytes > 0 && offset % row_bytes == 0 && out.size() % row_bytes == 0) {
      TransposeCastRows(source.spec.dtype, base + r.start * cols * in_size, tensor.spec.dtype, out.data(), rows, cols,
                        c.start + offset / row_bytes, c.start + (offset + out.size()) / row_bytes, cols);
      if (source.layout.normalize_bool && tensor.spec.dtype == DType::kBool) {
        for (std::byte& b : out) b = std::byte{b != std::byte{0}};
      }
      return absl::OkStatus();
    }
  }
  // The served tensor as a strided view of the source elements: the source's
  // own strides (row-major when it has none), swapped for a transpose, walked
  // through the slice's ranges.
  std::vector<uint64_t> shape = *source_shape, strides = source.layout.strides;
  if (strides.empty()) {
    strides.assign(shape.size(), 1);
    for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  }
  if (tensor.transpose) {
    std::swap(shape[0], shape[1]);
    std::swap(strides[0], strides[1]);
  }
  std::vector<DimWalk> dims(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    DimWalk& w = dims[d];
    w.stride = strides[d];
    if (slice->empty()) {
      w.size = shape[d];
      w.served_start = {0};
      w.source_start = {0};
      continue;
    }
    for (const IndexRange& r : slice->dims[d]) {
      if (r.size() == 0) continue;  // serves nothing (a non-empty `out` means every dimension has some)
      w.served_start.push_back(w.size);
      w.source_start.push_back(r.start);
      w.size += r.size();
    }
  }
  if (source.layout.strides.empty() && !tensor.transpose) {
    if (std::optional<uint64_t> start = slice->ContiguousStart(*source_shape)) {
      // The served elements are consecutive in the source: one run, so a cast
      // streams through CastElements' fast loops instead of row by row.
      base += *start * in_size;
      dims = {DimWalk{tensor.spec.num_elements() / per_unit, 1, {0}, {0}}};
    }
  }
  uint64_t first = offset / out_size, count = out.size() / out_size;
  std::byte* dst = out.data();
  if (dims.empty()) {  // a scalar
    CastElements(source.spec.dtype, base, tensor.spec.dtype, dst, 1);
  } else {
    // The odometer starts at element `first`; each step covers a run of the
    // innermost dimension within one of its ranges.
    const size_t rank = dims.size();
    std::vector<uint64_t> index(rank);
    for (size_t d = rank, rest = first; d-- > 0;) {
      index[d] = rest % dims[d].size;
      rest /= dims[d].size;
    }
    while (count > 0) {
      uint64_t at = 0;
      size_t k = 0;
      for (size_t d = 0; d < rank; ++d) {
        k = dims[d].RangeOf(index[d]);
        at += (dims[d].source_start[k] + index[d] - dims[d].served_start[k]) * dims[d].stride;
      }
      const DimWalk& inner = dims[rank - 1];
      const uint64_t run = std::min(count, inner.RangeEnd(k) - index[rank - 1]);
      if (per_unit == 1) {
        CastStrided(source.spec.dtype, base + at * in_size, inner.stride, tensor.spec.dtype, dst, run);
      } else {  // packed: a unit's elements are consecutive, and so are the units of a run
        CastElements(source.spec.dtype, base + at * in_size, tensor.spec.dtype, dst, run * per_unit);
      }
      dst += run * out_size;
      count -= run;
      index[rank - 1] += run;
      for (size_t d = rank - 1; d > 0 && index[d] == dims[d].size; --d) {
        index[d] = 0;
        ++index[d - 1];
      }
    }
  }
  if (source.layout.normalize_bool && tensor.spec.dtype == DType::kBool) {
    for (std::byte& b : out) b = std::byte{b != std::byte{0}};
  }
  return absl::OkStatus();
}

absl::Status WriteSnapshot(const Snapshot& snapshot, const std::string& path, const FormatSpec& format,
                           const Metadata& metadata, const WriteOptions& options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                               CheckpointWriter::Create(path, format, options));
  writer->SetMetadata(metadata);
  for (const SnapshotTensor& tensor : snapshot.tensors()) {
    WEIGHTSTORE_RETURN_IF_ERROR(writer->Add(tensor.spec, [&snapshot, &tensor]() -> absl::StatusOr<SharedBytes> {
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, snapshot.Read(tensor));
      return t.bytes;
    }));
  }
  return writer->Finish();
}

}  // namespace weightstore
