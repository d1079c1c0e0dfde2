#include "client/updates.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "client/proto_convert.h"
#include "client/usable_cores.h"
#include "core/catalog/manifest.h"
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

absl::StatusOr<ChangedTensors> FetchChanged(Store& store, const std::string& name, Query query) {
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

namespace {

// The changed tensors that came as patches, applied to the held ones
// (`by_name`): in place where UpdateTensors made a held tensor's memory and
// nothing else shares it (HostBuffer::SoleWritable), else into a copy. An
// error when a patch does not fit what is held or fails; `*wrote_in_place`
// then says whether held memory may have been written.
absl::StatusOr<std::vector<SharedTensor>> PatchHeld(
    const std::vector<ReceivedPatch>& patches, const absl::flat_hash_map<std::string, const SharedTensor*>& by_name,
    bool* wrote_in_place) {
  std::vector<std::optional<HostBuffer>> copies(patches.size());
  std::vector<std::span<std::byte>> destinations;
  std::vector<size_t> to_copy;
  for (size_t i = 0; i < patches.size(); ++i) {
    const ReceivedPatch& p = patches[i];
    auto it = by_name.find(p.spec.name);
    if (it == by_name.end() || it->second->spec.dtype != p.spec.dtype || it->second->spec.shape != p.spec.shape) {
      return absl::FailedPreconditionError(
          absl::StrCat("a patch came for tensor '", p.spec.name, "', which is not held as listed"));
    }
    if (it->second->bytes.size() != p.spec.byte_size()) {
      return absl::FailedPreconditionError(absl::StrCat("held tensor '", p.spec.name, "' has ",
                                                        it->second->bytes.size(), " bytes, not ", p.spec.byte_size()));
    }
    std::span<std::byte> own = HostBuffer::SoleWritable(it->second->bytes);
    if (!own.empty()) {
      destinations.push_back(own);
      *wrote_in_place = true;
      continue;
    }
    WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer copy, HostBuffer::Allocate(p.spec.byte_size()));
    destinations.push_back(copy.span());
    copies[i] = std::move(copy);
    to_copy.push_back(i);
  }
  WEIGHTSTORE_RETURN_IF_ERROR(
      ParallelFor(to_copy.size(), static_cast<unsigned>(std::max(1, UsableCores())), [&](size_t k) -> absl::Status {
        const size_t i = to_copy[k];
        const SharedBytes& from = by_name.at(patches[i].spec.name)->bytes;
        std::memcpy(destinations[i].data(), from.data(), from.size());
        return absl::OkStatus();
      }));
  WEIGHTSTORE_RETURN_IF_ERROR(ApplyReceivedPatches(patches, destinations));
  std::vector<SharedTensor> out;
  for (size_t i = 0; i < patches.size(); ++i) {
    out.push_back(
        {patches[i].spec, copies[i] ? std::move(*copies[i]).Freeze() : by_name.at(patches[i].spec.name)->bytes});
  }
  return out;
}

}  // namespace

namespace {

// UpdateTensors; `*wrote_in_place` says whether held memory was written.
absl::StatusOr<UpdateResult> Update(Store& store, const std::string& name, Query query, HeldTensors* held,
                                    bool* wrote_in_place) {
  UpdateResult result;
  result.old_version = held->version;
  absl::flat_hash_map<std::string, const SharedTensor*> by_name;
  for (const SharedTensor& t : held->tensors) by_name.emplace(t.spec.name, &t);

  const std::string selection = SelectionKey(query);
  const bool reselected = !held->version.empty() && held->selection != selection;
  query.since_version = reselected ? "" : held->version;
  query.patches = true;
  WEIGHTSTORE_ASSIGN_OR_RETURN(ChangedTensors r, FetchChanged(store, name, query));
  result.delta = r.delta;
  result.patch_reason = r.patch_reason;
  result.full_reason = !reselected ? r.full_reason
                       : held->selection.empty()
                           ? "the held tensors' selection is not recorded (HeldTensors::selection)"
                           : "the held tensors were selected otherwise (another selection, shard "
                             "or dtype)";
  // What the daemon calls unchanged must be held as listed: else the held
  // tensors came from another query, and everything is received again.
  for (const TensorDescription& d : r.listed) {
    if (!result.delta || !d.unchanged) continue;
    auto it = by_name.find(d.spec.name);
    if (it == by_name.end() || it->second->spec.dtype != d.spec.dtype || it->second->spec.shape != d.spec.shape) {
      result.delta = false;
      result.full_reason = absl::StrCat("tensor '", d.spec.name, "' is not held as the query selects it");
      query.since_version.clear();
      WEIGHTSTORE_ASSIGN_OR_RETURN(r, FetchChanged(store, name, query));
      break;
    }
  }

  if (!r.patched.empty()) {
    absl::StatusOr<std::vector<SharedTensor>> patched = PatchHeld(r.patched, by_name, wrote_in_place);
    if (patched.ok()) {
      for (const ReceivedPatch& p : r.patched) {
        result.patched.push_back(p.spec.name);
        result.fetched_bytes += p.patch.body.size();
      }
      for (SharedTensor& t : *patched) r.received.push_back(std::move(t));
    } else {
      // Fetch the changed tensors whole, pinned to the version listed.
      result.patch_failure = std::string(patched.status().message());
      query.patches = false;
      query.version = r.version;
      WEIGHTSTORE_ASSIGN_OR_RETURN(r, FetchChanged(store, name, query));
    }
  }
  absl::flat_hash_map<std::string, SharedTensor*> sent;
  for (SharedTensor& t : r.received) sent.emplace(t.spec.name, &t);
  absl::flat_hash_set<std::string> came_patched(result.patched.begin(), result.patched.end());
  HeldTensors next{r.version, {}, selection};
  next.tensors.reserve(r.listed.size());
  absl::flat_hash_set<std::string> listed;
  for (const TensorDescription& d : r.listed) {
    listed.insert(d.spec.name);
    auto f = sent.find(d.spec.name);
    // An unchanged tensor may come all the same: the daemon dropped the
    // since version's digests between the listing and the fetch.
    const bool kept = result.delta && d.unchanged && f == sent.end();
    if (!kept && f == sent.end()) {
      return absl::DataLossError(
          absl::StrCat("update of '", name, "': tensor '", d.spec.name, "' was not sent although changed"));
    }
    if (kept) {
      next.tensors.push_back(*by_name.at(d.spec.name));
      continue;
    }
    if (f->second->spec.dtype != d.spec.dtype || f->second->spec.shape != d.spec.shape) {
      return absl::DataLossError(
          absl::StrCat("update of '", name, "': tensor '", d.spec.name, "' arrived unlike its listing"));
    }
    if (!(result.delta && d.unchanged)) {
      (by_name.contains(d.spec.name) ? result.changed : result.added).push_back(d.spec.name);
    }
    if (!came_patched.contains(d.spec.name)) result.fetched_bytes += f->second->bytes.size();
    ++result.fetched_tensors;
    next.tensors.push_back(std::move(*f->second));
  }
  if (r.received.size() != result.fetched_tensors) {
    return absl::DataLossError(absl::StrCat("update of '", name, "': the daemon sent ", r.received.size(),
                                            " tensors where the listing called for ", result.fetched_tensors));
  }
  for (const SharedTensor& t : held->tensors) {
    if (!listed.contains(t.spec.name)) result.removed.push_back(t.spec.name);
  }
  result.new_version = next.version;
  *held = std::move(next);
  return result;
}

}  // namespace

absl::StatusOr<UpdateResult> UpdateTensors(Store& store, const std::string& name, Query query, HeldTensors* held) {
  bool wrote_in_place = false;
  absl::StatusOr<UpdateResult> result = Update(store, name, std::move(query), held, &wrote_in_place);
  // Held memory written in place is no longer its version's: the next update
  // fetches everything.
  if (!result.ok() && wrote_in_place) held->version.clear();
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
