#include "core/select/pipeline.h"

#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/select/dtype_cast.h"
#include "core/select/quantized_shard.h"
#include "core/status_macros.h"

namespace weightstore {

absl::StatusOr<std::vector<NamedEntry>> ResolveNames(const Checkpoint& checkpoint, const Selection& selection,
                                                     bool applying_to_target, const SelectionDeadline& deadline) {
  const std::vector<CheckpointEntry>& entries = checkpoint.entries();
  const std::string& key = selection.options().top_level_key;
  std::vector<NamedEntry> named;
  named.reserve(entries.size());
  uint64_t name_bytes = 0;
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

SnapshotTensor StartTensor(const Checkpoint& checkpoint, const CheckpointEntry& entry, std::string name) {
  SnapshotTensor t;
  t.source = &entry;
  t.spec = entry.spec;
  t.spec.name = std::move(name);
  DescribeQuantization(checkpoint, &t);
  return t;
}

absl::Status CastToSelectionDType(const Selection& selection, SnapshotTensor* tensor) {
  const std::optional<DType>& dtype = selection.options().dtype;
  if (!dtype || !IsFloatingPoint(tensor->spec.dtype)) return absl::OkStatus();
  tensor->spec.dtype = *dtype;
  return CheckCast(tensor->source->spec.dtype, *dtype);
}

absl::Status SliceTensor(const Selection& selection, const SelectionDeadline& deadline, SnapshotTensor* tensor) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(tensor->slice, selection.SliceOf(tensor->spec.name, tensor->spec.shape, &deadline));
  WEIGHTSTORE_RETURN_IF_ERROR(
      CheckUnitSlice(tensor->source->spec.dtype, tensor->unsliced_shape(), tensor->slice, tensor->spec.name));
  if (!tensor->slice.empty()) tensor->spec.shape = tensor->slice.Shape();
  return absl::OkStatus();
}

absl::Status CutTensors(const Checkpoint& checkpoint, const Selection& selection, const SelectionDeadline& deadline,
                        std::vector<SnapshotTensor>* tensors, absl::FunctionRef<void(size_t i, bool dropped)> visit) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<bool> other, OtherRanksExperts(selection, deadline, tensors->size(),
                                                                          [&](size_t i) -> absl::string_view {
                                                                            return (*tensors)[i].spec.name;
                                                                          }));
  size_t kept = 0;
  for (size_t i = 0; i < tensors->size(); ++i) {
    visit(i, other[i]);
    if (other[i]) continue;
    if (kept != i) (*tensors)[kept] = std::move((*tensors)[i]);
    ++kept;
  }
  tensors->resize(kept);
  return ShardTensors(checkpoint, selection, deadline, tensors);
}

}  // namespace weightstore
