#include "core/select/snapshot.h"

#include <set>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/host_buffer.h"
#include "core/select/dtype_cast.h"
#include "core/status_macros.h"

namespace weightstore {

absl::StatusOr<std::vector<NamedEntry>> ResolveNames(const Checkpoint& checkpoint, const Selection& selection,
                                                     bool applying_to_target) {
  const std::vector<CheckpointEntry>& entries = checkpoint.entries();
  const std::string& key = selection.options().top_level_key;
  std::vector<NamedEntry> named;
  named.reserve(entries.size());
  uint64_t name_bytes = 0;
  const SelectionDeadline deadline(selection.limits().max_time);
  auto add = [&](absl::string_view name, size_t i) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::string renamed, selection.Rename(name, &deadline));
    name_bytes += renamed.size();
    if (name_bytes > selection.limits().max_total_name_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("the selected names of '", checkpoint.path(), "' exceed ",
                                                     selection.limits().max_total_name_bytes,
                                                     " bytes together after renaming"));
    }
    named.push_back({std::move(renamed), i});
    return absl::OkStatus();
  };
  if (key.empty()) {
    for (size_t i = 0; i < entries.size(); ++i) WEIGHTSTORE_RETURN_IF_ERROR(add(entries[i].spec.name, i));
  } else {
    const std::string prefix = absl::StrCat(key, ".");
    std::set<std::string> keys;
    for (size_t i = 0; i < entries.size(); ++i) {
      absl::string_view name = entries[i].spec.name;
      if (absl::ConsumePrefix(&name, prefix)) {
        WEIGHTSTORE_RETURN_IF_ERROR(add(name, i));
      } else if (size_t dot = name.find('.'); dot != absl::string_view::npos && keys.size() < 32) {
        keys.insert(std::string(name.substr(0, dot)));
      }
    }
    if (named.empty()) {
      return absl::NotFoundError(
          absl::StrCat("'", checkpoint.path(), "' has no tensors under top-level key '", key, "'; keys with tensors: ",
                       keys.empty() ? "(none)" : absl::StrJoin(keys, ", "), keys.size() >= 32 ? ", ..." : ""));
    }
  }
  if (selection.UsesContiguousIndices(checkpoint.format(), applying_to_target)) {
    std::vector<std::string> names;
    names.reserve(named.size());
    for (const NamedEntry& n : named) names.push_back(n.name);
    names = MapIndicesContiguous(names);
    for (size_t i = 0; i < named.size(); ++i) named[i].name = std::move(names[i]);
  }
  absl::flat_hash_map<absl::string_view, size_t> first;  // name -> entry index
  first.reserve(named.size());
  for (const NamedEntry& n : named) {
    auto [it, inserted] = first.emplace(n.name, n.entry);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("tensors '", entries[it->second].spec.name, "' and '",
                                                     entries[n.entry].spec.name, "' of '", checkpoint.path(),
                                                     "' are both renamed to '", n.name, "'"));
    }
  }
  return named;
}

absl::StatusOr<std::shared_ptr<const Snapshot>> Snapshot::Select(std::shared_ptr<const Checkpoint> checkpoint,
                                                                 const Selection& selection) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<NamedEntry> named,
                               ResolveNames(*checkpoint, selection, /*applying_to_target=*/false));
  std::vector<SnapshotTensor> tensors;
  tensors.reserve(named.size());
  const SelectionDeadline deadline(selection.limits().max_time);
  for (NamedEntry& n : named) {
    WEIGHTSTORE_RETURN_IF_ERROR(deadline.Check("filtering", n.name.size() + 1));
    if (!selection.Matches(n.name)) continue;
    SnapshotTensor t;
    t.source = &checkpoint->entries()[n.entry];
    t.spec = t.source->spec;
    t.spec.name = std::move(n.name);
    if (selection.options().dtype && IsFloatingPoint(t.spec.dtype)) {
      WEIGHTSTORE_RETURN_IF_ERROR(CheckCast(t.spec.dtype, *selection.options().dtype));
      t.spec.dtype = *selection.options().dtype;
    }
    tensors.push_back(std::move(t));
  }
  return Create(std::move(checkpoint), std::move(tensors));
}

absl::StatusOr<std::shared_ptr<const Snapshot>> Snapshot::Create(std::shared_ptr<const Checkpoint> checkpoint,
                                                                 std::vector<SnapshotTensor> tensors) {
  std::shared_ptr<Snapshot> snapshot(new Snapshot());
  snapshot->tensors_ = std::move(tensors);  // by_name_ views point into these names
  snapshot->by_name_.reserve(snapshot->tensors_.size());
  for (size_t i = 0; i < snapshot->tensors_.size(); ++i) {
    const SnapshotTensor& t = snapshot->tensors_[i];
    if (t.transpose && (t.source->spec.shape.size() != 2 ||
                        t.spec.shape != std::vector<uint64_t>{t.source->spec.shape[1], t.source->spec.shape[0]})) {
      return absl::InternalError(absl::StrCat("tensor '", t.spec.name, "': transpose needs a rank-2 source"));
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
  if (tensor.is_identity()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, checkpoint_->Read(*tensor.source));
    t.spec = tensor.spec;
    return t;
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(tensor.spec.byte_size()));
  WEIGHTSTORE_RETURN_IF_ERROR(ReadInto(tensor, buffer.span()));
  return SharedTensor{tensor.spec, std::move(buffer).Freeze()};
}

absl::Status Snapshot::ReadInto(const SnapshotTensor& tensor, std::span<std::byte> out) const {
  if (tensor.is_identity()) return checkpoint_->ReadInto(*tensor.source, out);
  WEIGHTSTORE_RETURN_IF_ERROR(CheckDestination(tensor.spec, out.size()));
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

absl::Status Snapshot::ReadRange(const SnapshotTensor& tensor, uint64_t offset, std::span<std::byte> out) const {
  const CheckpointEntry& source = *tensor.source;
  const uint64_t out_size = DTypeSize(tensor.spec.dtype), in_size = DTypeSize(source.spec.dtype);
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
  if (tensor.transpose && source.layout.strides.empty()) {
    // Whole rows of the served [c, r] matrix: produced by tiles, as reads a
    // column at a time would touch a cache line per element.
    const uint64_t rows = source.spec.shape[0], cols = source.spec.shape[1], row_bytes = rows * out_size;
    if (row_bytes > 0 && offset % row_bytes == 0 && out.size() % row_bytes == 0) {
      TransposeCastRows(source.spec.dtype, base, tensor.spec.dtype, out.data(), rows, cols, offset / row_bytes,
                        (offset + out.size()) / row_bytes);
      if (source.layout.normalize_bool && tensor.spec.dtype == DType::kBool) {
        for (std::byte& b : out) b = std::byte{b != std::byte{0}};
      }
      return absl::OkStatus();
    }
  }
  // The served tensor as a strided view of the source elements: the source's
  // own strides (row-major when it has none), swapped for a transpose.
  std::vector<uint64_t> shape = source.spec.shape, strides = source.layout.strides;
  if (strides.empty() && !tensor.transpose && !shape.empty()) {
    // Contiguous and not transposed: one run over every element, so a cast
    // streams through CastElements' fast loops instead of row by row.
    shape = {source.spec.num_elements()};
  }
  if (strides.empty()) {
    strides.assign(shape.size(), 1);
    for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  }
  if (tensor.transpose) {
    std::swap(shape[0], shape[1]);
    std::swap(strides[0], strides[1]);
  }
  uint64_t first = offset / out_size, count = out.size() / out_size;
  std::byte* dst = out.data();
  if (shape.empty()) {  // a scalar
    CastElements(source.spec.dtype, base, tensor.spec.dtype, dst, 1);
  } else {
    // The odometer starts at element `first`; each step covers a run of the
    // innermost dimension.
    const size_t rank = shape.size();
    std::vector<uint64_t> index(rank);
    for (size_t d = rank, rest = first; d-- > 0;) {
      index[d] = rest % shape[d];
      rest /= shape[d];
    }
    while (count > 0) {
      uint64_t at = 0;
      for (size_t d = 0; d < rank; ++d) at += index[d] * strides[d];
      const uint64_t run = std::min(count, shape[rank - 1] - index[rank - 1]);
      CastStrided(source.spec.dtype, base + at * in_size, strides[rank - 1], tensor.spec.dtype, dst, run);
      dst += run * out_size;
      count -= run;
      index[rank - 1] += run;
      for (size_t d = rank - 1; d > 0 && index[d] == shape[d]; --d) {
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
