#include "client/updates.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/device_patches.h"
#include "client/proto_convert.h"
#include "client/usable_cores.h"
#include "core/catalog/manifest.h"
#include "core/element_patch.h"
#include "core/host_buffer.h"
#include "core/parallel_for.h"
#include "core/status_macros.h"

namespace weightstore::client {

// Its Selection message, serialized deterministically.
std::string SelectionKey(const Query& query) {
  pb::Selection selection;
  ToProto(query, &selection);
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    selection.SerializeToCodedStream(&coded);
  }
  return out;
}

absl::StatusOr<ChangedTensors> FetchChanged(Store& store, const std::string& name, Query query, uint64_t max_bytes) {
  ChangedTensors r;
  const bool asked = !query.since_version.empty();
  std::optional<DeltaInfo> delta;
  if (store.maps()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(MappedTensors mapped, store.MapTensors(name, query));
    for (size_t i = 0; i < mapped.tensors.size(); ++i) {
      const TensorDescription& d = mapped.descriptions[i];
      if (!d.unchanged && !d.patched) r.received.push_back(std::move(mapped.tensors[i]));
    }
    r.patched = std::move(mapped.patches);
    r.version = std::move(mapped.version);
    if (mapped.delta) r.patch_reason = mapped.delta->patch_reason;
    delta = std::move(mapped.delta);
    r.listed = std::move(mapped.descriptions);
  } else {
    WEIGHTSTORE_ASSIGN_OR_RETURN(TensorListing listing, store.ListTensors(name, query));
    query.version = listing.version;  // fetch what was listed, or fail ABORTED
    if (!listing.delta || !listing.delta->delta) query.since_version.clear();
    uint64_t to_receive = 0;
    for (const TensorDescription& d : listing.tensors) {
      if (query.since_version.empty() || !d.unchanged) {
        to_receive = d.spec.byte_size() > max_bytes - std::min(to_receive, max_bytes) ? UINT64_MAX
                                                                                      : to_receive + d.spec.byte_size();
      }
    }
    if (to_receive > max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("'", name, "' lists more than ", max_bytes,
                                                       " bytes of tensors to receive, the most taken into memory"));
    }
    if (!listing.delta || !listing.delta->delta || listing.delta->changed_tensors > 0) {
      CollectingSink sink(query.cancel, /*take_patches=*/query.patches);
      WEIGHTSTORE_RETURN_IF_ERROR(store.FetchTensors(name, query, &sink));
      r.received = std::move(sink.tensors());
      r.patched = std::move(sink.patches());
    }
    r.version = std::move(listing.version);
    if (listing.delta) r.patch_reason = listing.delta->patch_reason;
    delta = std::move(listing.delta);
    r.listed = std::move(listing.tensors);
  }
  r.delta = delta.has_value() && delta->delta;
  if (!r.delta) {
    r.full_reason = !asked   ? "nothing was held"
                    : !delta ? "this store does not tell which tensors changed"
                             : delta->full_reason;
  }
  return r;
}

absl::Status ApplyReceivedPatches(std::span<const ReceivedPatch> patches,
                                  std::span<const std::span<std::byte>> destinations) {
  if (patches.size() != destinations.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(patches.size(), " patches for ", destinations.size(), " destinations"));
  }
  // Two patches into one memory would race (tied weights held under two
  // names): refused before anything is written.
  std::vector<std::span<std::byte>> sorted(destinations.begin(), destinations.end());
  std::sort(sorted.begin(), sorted.end(), [](auto a, auto b) { return a.data() < b.data(); });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i - 1].data() + sorted[i - 1].size() > sorted[i].data()) {
      return absl::InvalidArgumentError("two patched tensors share memory; they are fetched whole");
    }
  }
  std::vector<PatchTarget> targets;
  targets.reserve(patches.size());
  for (size_t i = 0; i < patches.size(); ++i) {
    targets.push_back({patches[i].spec.name, &patches[i].patch, destinations[i]});
  }
  const auto threads = static_cast<unsigned>(std::max(1, UsableCores()));
  WEIGHTSTORE_RETURN_IF_ERROR(ApplyPatches(targets, threads));
  return ParallelFor(patches.size(), threads, [&](size_t i) -> absl::Status {
    const std::string got = DigestBytes(destinations[i]).Hex();
    if (got == patches[i].digest) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat("tensor '", patches[i].spec.name, "' patched has digest ", got,
                                            " where the listing says ", patches[i].digest));
  });
}

absl::Status ApplyPatchesAt(std::span<const ReceivedPatch> patches, std::span<const PatchDestination> destinations) {
  if (patches.size() != destinations.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(patches.size(), " patches for ", destinations.size(), " destinations"));
  }
  struct Group {
    std::vector<ReceivedPatch> patches;
    std::vector<std::span<std::byte>> host;
    std::vector<void*> device;
  };
  // GPUs first (-1, host memory, last).
  std::map<int, Group, std::greater<int>> by_device;
  for (size_t i = 0; i < patches.size(); ++i) {
    const ReceivedPatch& p = patches[i];
    const PatchDestination& to = destinations[i];
    if (to.bytes.data() == nullptr || to.bytes.size() != p.spec.byte_size()) {
      return absl::InvalidArgumentError(absl::StrCat("the destination of tensor '", p.spec.name, "' holds ",
                                                     to.bytes.size(), " bytes, the patch is for ", p.spec.byte_size()));
    }
    if (absl::Status checked = CheckPatch(p.patch); !checked.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the patch of tensor '", p.spec.name, "' is malformed: ", checked.message()));
    }
    Group& group = by_device[std::max(to.device, -1)];
    group.patches.push_back(p);
    if (to.device < 0) {
      group.host.push_back(to.bytes);
    } else {
      group.device.push_back(to.bytes.data());
    }
  }
  for (const auto& [device, group] : by_device) {
    WEIGHTSTORE_RETURN_IF_ERROR(device < 0
                                    ? ApplyReceivedPatches(group.patches, group.host)
                                    : ApplyReceivedPatchesOnDevice(group.patches, group.device, {.device = device}));
  }
  return absl::OkStatus();
}

namespace {

// Whether `held` holds a tensor as `spec` is listed.
bool HoldsAsListed(const std::optional<UpdateDestination::Held>& held, const TensorSpec& spec) {
  return held && held->dtype == spec.dtype && held->shape == spec.shape;
}

// For a fixed_names() destination: every tensor about to be written must be
// held, with its listed shape.
absl::Status CheckFits(const std::string& name, const UpdateDestination& destination, const ChangedTensors& r) {
  if (!destination.fixed_names()) return absl::OkStatus();
  std::vector<std::string> problems;
  auto check = [&](const TensorSpec& spec) {
    const std::optional<UpdateDestination::Held> held = destination.Find(spec.name);
    if (!held) {
      problems.push_back(absl::StrCat(spec.name, ": not held, and these tensors take no new ones"));
    } else if (held->shape != spec.shape) {
      problems.push_back(absl::StrCat(spec.name, ": shape [", absl::StrJoin(spec.shape, ", "), "], held as [",
                                      absl::StrJoin(held->shape, ", "), "]"));
    }
  };
  for (const SharedTensor& t : r.received) check(t.spec);
  for (const ReceivedPatch& p : r.patched) check(p.spec);
  if (problems.empty()) return absl::OkStatus();
  if (problems.size() > 8) problems.resize(8);
  return absl::FailedPreconditionError(
      absl::StrCat("update of '", name, "' does not fit what is held: ", absl::StrJoin(problems, "; ")));
}

// Each patch must stand for one listed tensor that changed, with its
// listed dtype and shape, and not come whole as well: else the daemon lies,
// and nothing is written (a second patch of one name would be written into
// memory the first one's copy was given back with).
absl::Status CheckPatchesListed(const std::string& name, const ChangedTensors& r) {
  absl::flat_hash_map<std::string, const TensorDescription*> listed;
  for (const TensorDescription& d : r.listed) listed.emplace(d.spec.name, &d);
  absl::flat_hash_set<std::string> whole, patched;
  for (const SharedTensor& t : r.received) whole.insert(t.spec.name);
  for (const ReceivedPatch& p : r.patched) {
    auto it = listed.find(p.spec.name);
    if (it == listed.end() || it->second->unchanged || it->second->spec.dtype != p.spec.dtype ||
        it->second->spec.shape != p.spec.shape || whole.contains(p.spec.name) || !patched.insert(p.spec.name).second) {
      return absl::DataLossError(absl::StrCat("update of '", name, "': the daemon sent a patch of tensor '",
                                              p.spec.name,
                                              "' unlike its listing (not listed, listed unchanged or otherwise, "
                                              "sent twice, or also whole)"));
    }
  }
  return absl::OkStatus();
}

// Writes the patches `r` carries where `destination` says, checked; an error
// when a patch does not fit what is held, or fails. `*in_place` says whether
// held memory was handed out.
absl::Status WritePatches(const ChangedTensors& r, UpdateDestination& destination, bool* in_place) {
  for (const ReceivedPatch& p : r.patched) {
    const std::optional<UpdateDestination::Held> held = destination.Find(p.spec.name);
    if (!HoldsAsListed(held, p.spec) || !held->patchable) {
      return absl::FailedPreconditionError(
          absl::StrCat("a patch came for tensor '", p.spec.name, "', which is not held as listed"));
    }
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<PatchDestination> to, destination.PatchInto(r.patched, in_place));
  return ApplyPatchesAt(r.patched, to);
}

// UpdateInto; `*in_place` says whether held memory was handed out for
// patches.
absl::StatusOr<Updated> Update(Store& store, const std::string& name, Query query, const std::string& since,
                               const std::string& since_selection, UpdateDestination& destination, bool* in_place) {
  Updated out;
  UpdateResult& result = out.result;
  result.old_version = since;
  out.selection = SelectionKey(query);
  const bool reselected = !since.empty() && since_selection != out.selection;
  query.since_version = reselected ? "" : since;
  const std::vector<std::string> held_names = destination.Names();
  // Patches are asked for when every held tensor can take one.
  query.patches = !query.since_version.empty();
  for (const std::string& n : held_names) {
    if (!query.patches) break;
    const std::optional<UpdateDestination::Held> held = destination.Find(n);
    query.patches = held && held->patchable;
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(ChangedTensors r, FetchChanged(store, name, query));
  result.delta = r.delta;
  result.patch_reason = r.patch_reason;
  result.full_reason = !reselected ? r.full_reason
                       : since_selection.empty()
                           ? "the held tensors' selection is not recorded, so their selection (shard, dtype, "
                             "renames...) is not known: they were filled otherwise than by an update, or a "
                             "pinned fetch, of this store"
                           : "the held tensors were selected otherwise (another selection: shard, dtype, "
                             "renames...)";
  // What the daemon calls unchanged must be held as listed: else the held
  // tensors came from another query, and everything is received again.
  for (const TensorDescription& d : r.listed) {
    if (!result.delta || !d.unchanged || HoldsAsListed(destination.Find(d.spec.name), d.spec)) continue;
    result.delta = false;
    result.full_reason = absl::StrCat("tensor '", d.spec.name,
                                      "' is not held as the query selects it (missing, or another dtype or shape)");
    query.since_version.clear();
    query.patches = false;
    WEIGHTSTORE_ASSIGN_OR_RETURN(r, FetchChanged(store, name, query));
    break;
  }
  if (!query.patches && !r.patched.empty()) {
    return absl::DataLossError(
        absl::StrCat("update of '", name, "': the daemon sent element patches that were not asked for"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(CheckPatchesListed(name, r));
  WEIGHTSTORE_RETURN_IF_ERROR(CheckFits(name, destination, r));
  if (!r.patched.empty()) {
    if (absl::Status written = WritePatches(r, destination, in_place); written.ok()) {
      for (const ReceivedPatch& p : r.patched) {
        result.patched.push_back(p.spec.name);
        result.fetched_bytes += p.patch.body.size();
      }
    } else {
      // The changed tensors whole, pinned to the version listed.
      result.patch_failure = std::string(written.message());
      query.patches = false;
      query.version = r.version;
      WEIGHTSTORE_ASSIGN_OR_RETURN(r, FetchChanged(store, name, query));
      if (!r.patched.empty()) {
        return absl::DataLossError(
            absl::StrCat("update of '", name, "': the daemon sent element patches that were not asked for"));
      }
      WEIGHTSTORE_RETURN_IF_ERROR(CheckFits(name, destination, r));
    }
  }
  absl::flat_hash_map<std::string, const SharedTensor*> sent;
  for (const SharedTensor& t : r.received) sent.emplace(t.spec.name, &t);
  const absl::flat_hash_set<std::string> came_patched(result.patched.begin(), result.patched.end());
  absl::flat_hash_set<std::string> listed;
  size_t whole = 0;
  for (const TensorDescription& d : r.listed) {
    listed.insert(d.spec.name);
    out.listed.push_back(d.spec.name);
    const std::optional<UpdateDestination::Held> held = destination.Find(d.spec.name);
    if (came_patched.contains(d.spec.name)) {
      result.changed.push_back(d.spec.name);
      ++result.fetched_tensors;
      continue;
    }
    auto f = sent.find(d.spec.name);
    // An unchanged tensor may come all the same: the daemon dropped the
    // since version's digests between the listing and the fetch.
    if (f == sent.end()) {
      // Kept as held; a listing after a failed patch is checked here too.
      if (result.delta && d.unchanged && HoldsAsListed(held, d.spec)) continue;
      return absl::DataLossError(absl::StrCat("update of '", name, "': tensor '", d.spec.name,
                                              "' was not sent although changed (or is not held as listed)"));
    }
    if (f->second->spec.dtype != d.spec.dtype || f->second->spec.shape != d.spec.shape) {
      return absl::DataLossError(
          absl::StrCat("update of '", name, "': tensor '", d.spec.name, "' arrived unlike its listing"));
    }
    if (!(result.delta && d.unchanged)) (held.has_value() ? result.changed : result.added).push_back(d.spec.name);
    result.fetched_bytes += f->second->bytes.size();
    ++result.fetched_tensors;
    ++whole;
  }
  if (r.received.size() != whole) {
    return absl::DataLossError(absl::StrCat("update of '", name, "': the daemon sent ", r.received.size(),
                                            " tensors where the listing called for ", whole));
  }
  for (const std::string& n : held_names) {
    if (!listed.contains(n)) result.removed.push_back(n);
  }
  result.new_version = r.version;
  out.received = std::move(r.received);
  return out;
}

// HeldTensors as an update's destination: every tensor patchable, in place
// where UpdateTensors made its memory and nothing else shares it
// (HostBuffer::SoleWritable), else into a copy.
class HeldDestination final : public UpdateDestination {
 public:
  explicit HeldDestination(const HeldTensors& held) : held_(held) {
    for (const SharedTensor& t : held.tensors) by_name_.emplace(t.spec.name, &t);
  }

  std::optional<Held> Find(const std::string& name) const override {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return std::nullopt;
    return Held{it->second->spec.dtype, it->second->spec.shape, /*patchable=*/true};
  }

  std::vector<std::string> Names() const override {
    std::vector<std::string> names;
    for (const SharedTensor& t : held_.tensors) names.push_back(t.spec.name);
    return names;
  }

  absl::StatusOr<std::vector<PatchDestination>> PatchInto(std::span<const ReceivedPatch> patches,
                                                          bool* in_place) override {
    std::vector<PatchDestination> to;
    std::vector<std::pair<const SharedBytes*, std::span<std::byte>>> to_copy;
    for (const ReceivedPatch& p : patches) {
      const SharedBytes& from = by_name_.at(p.spec.name)->bytes;
      if (from.size() != p.spec.byte_size()) {
        return absl::FailedPreconditionError(
            absl::StrCat("held tensor '", p.spec.name, "' has ", from.size(), " bytes, not ", p.spec.byte_size()));
      }
      std::span<std::byte> own = HostBuffer::SoleWritable(from);
      if (!own.empty()) {
        to.push_back({own});
        *in_place = wrote_in_place_ = true;
        continue;
      }
      WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer copy, HostBuffer::Allocate(p.spec.byte_size()));
      const std::span<std::byte> into = copy.span();  // a HostBuffer keeps its memory when moved
      if (!copies_.try_emplace(p.spec.name, std::move(copy)).second) {
        return absl::FailedPreconditionError(absl::StrCat("two patches came for tensor '", p.spec.name, "'"));
      }
      to.push_back({into});
      to_copy.emplace_back(&from, into);
    }
    WEIGHTSTORE_RETURN_IF_ERROR(
        ParallelFor(to_copy.size(), static_cast<unsigned>(std::max(1, UsableCores())), [&](size_t k) -> absl::Status {
          const auto& [from, into] = to_copy[k];
          std::memcpy(into.data(), from->data(), from->size());
          return absl::OkStatus();
        }));
    return to;
  }

  // `updated` taken in: the tensors held at its new version, in listing order.
  HeldTensors Take(Updated updated) && {
    absl::flat_hash_map<std::string, SharedTensor*> received;
    for (SharedTensor& t : updated.received) received.emplace(t.spec.name, &t);
    const absl::flat_hash_set<std::string> patched(updated.result.patched.begin(), updated.result.patched.end());
    HeldTensors next{updated.result.new_version, {}, std::move(updated.selection)};
    next.tensors.reserve(updated.listed.size());
    for (const std::string& n : updated.listed) {
      if (auto r = received.find(n); r != received.end()) {
        next.tensors.push_back(std::move(*r->second));
        continue;
      }
      SharedTensor kept = *by_name_.at(n);  // unchanged, or patched in place
      if (patched.contains(n)) {
        if (auto copy = copies_.find(n); copy != copies_.end()) kept.bytes = std::move(copy->second).Freeze();
      }
      next.tensors.push_back(std::move(kept));
    }
    return next;
  }

  // Whether PatchInto handed out held memory.
  bool wrote_in_place() const { return wrote_in_place_; }

 private:
  const HeldTensors& held_;
  bool wrote_in_place_ = false;
  absl::flat_hash_map<std::string, const SharedTensor*> by_name_;
  absl::flat_hash_map<std::string, HostBuffer> copies_;  // patched into copies, by name
};

}  // namespace

absl::StatusOr<Updated> UpdateInto(Store& store, const std::string& name, Query query, const std::string& since,
                                   const std::string& since_selection, UpdateDestination& destination) {
  bool in_place = false;
  absl::StatusOr<Updated> updated =
      Update(store, name, std::move(query), since, since_selection, destination, &in_place);
  if (!updated.ok() && in_place) {
    return absl::Status(updated.status().code(),
                        absl::StrCat(updated.status().message(),
                                     " (tensors patched in place may be partly written: update them again from "
                                     "nothing held)"));
  }
  return updated;
}

absl::StatusOr<UpdateResult> UpdateTensors(Store& store, const std::string& name, Query query, HeldTensors* held) {
  HeldDestination destination(*held);
  absl::StatusOr<Updated> updated =
      UpdateInto(store, name, std::move(query), held->version, held->selection, destination);
  if (!updated.ok()) {
    // Held memory written in place is no longer its version's: the next
    // update fetches everything.
    if (destination.wrote_in_place()) held->version.clear();
    return updated.status();
  }
  UpdateResult result = updated->result;
  *held = std::move(destination).Take(*std::move(updated));
  return result;
}

absl::StatusOr<PushPlan> PlanPush(const TensorListing& served, std::span<const SharedTensor> next,
                                  std::span<const SharedTensor> base, uint64_t max_patch_bytes) {
  PushPlan plan;
  plan.request.base_version = served.version;
  absl::flat_hash_map<std::string, const TensorDescription*> in_served;
  for (const TensorDescription& t : served.tensors) {
    in_served.emplace(t.spec.name, &t);
    plan.digests &= !t.digest.empty();
  }
  absl::flat_hash_set<std::string> names;
  for (const SharedTensor& t : next) {
    if (!names.insert(t.spec.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.spec.name, "' is given twice"));
    }
  }
  absl::flat_hash_map<std::string, const SharedTensor*> in_base;
  for (const SharedTensor& t : base) in_base.emplace(t.spec.name, &t);

  // Per tensor of `next`, on threads: its digest, and its patch against
  // `base` where that holds the served bytes.
  struct Planned {
    const TensorDescription* served = nullptr;  // replaced as it is (same dtype and shape)
    std::string digest;
    std::optional<ElementPatch> patch;
  };
  std::vector<Planned> planned(next.size());
  const auto threads = static_cast<unsigned>(std::max(1, UsableCores()));
  WEIGHTSTORE_RETURN_IF_ERROR(ParallelFor(next.size(), threads, [&](size_t i) -> absl::Status {
    const SharedTensor& t = next[i];
    if (t.bytes.size() != t.spec.byte_size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.spec.name, "' has ", t.bytes.size(),
                                                     " bytes; its shape needs ", t.spec.byte_size()));
    }
    auto s = in_served.find(t.spec.name);
    if (s == in_served.end() || s->second->spec.dtype != t.spec.dtype || s->second->spec.shape != t.spec.shape) {
      return absl::OkStatus();
    }
    Planned& p = planned[i];
    p.served = s->second;
    if (!plan.digests) return absl::OkStatus();
    p.digest = DigestBytes(t.bytes.span()).Hex();
    auto b = in_base.find(t.spec.name);
    if (p.digest == p.served->digest || b == in_base.end() || b->second->spec.dtype != t.spec.dtype ||
        b->second->bytes.size() != t.bytes.size() || DigestBytes(b->second->bytes.span()).Hex() != p.served->digest) {
      return absl::OkStatus();
    }
    p.patch = DiffElements(b->second->bytes.span(), t.bytes.span(), PatchElementSize(t.spec.dtype));
    if (p.patch && p.patch->body.size() > max_patch_bytes) p.patch.reset();
    return absl::OkStatus();
  }));

  for (size_t i = 0; i < next.size(); ++i) {
    const SharedTensor& t = next[i];
    Planned& p = planned[i];
    if (p.served == nullptr) {
      if (in_served.contains(t.spec.name)) plan.request.remove.push_back(t.spec.name);  // redefined
      plan.request.allow_new_tensors = true;
    } else if (plan.digests && p.digest == p.served->digest) {
      ++plan.unchanged;
      continue;
    }
    if (p.patch) {
      plan.patch_bytes += p.patch->body.size();
      plan.request.patched.push_back({t.spec, *std::move(p.patch), p.served->digest, std::move(p.digest)});
      continue;
    }
    plan.whole_bytes += t.bytes.size();
    plan.request.tensors.push_back(t);
  }
  for (const TensorDescription& t : served.tensors) {
    if (!names.contains(t.spec.name)) plan.request.remove.push_back(t.spec.name);
  }
  return plan;
}

}  // namespace weightstore::client
