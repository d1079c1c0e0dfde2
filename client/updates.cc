#include "client/updates.h"

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace weightstore::client {

absl::StatusOr<UpdateResult> UpdateTensors(Store& store, const std::string& name, Query query, HeldTensors* held) {
  UpdateResult result;
  result.old_version = held->version;
  absl::flat_hash_map<std::string, const SharedTensor*> by_name;
  for (const SharedTensor& t : held->tensors) by_name.emplace(t.spec.name, &t);

  query.since_version = held->version;
  WEIGHTSTORE_ASSIGN_OR_RETURN(TensorListing listing, store.ListTensors(name, query));
  result.delta = listing.delta.has_value() && listing.delta->delta;
  if (held->version.empty()) {
    result.full_reason = "nothing was held";
  } else if (!listing.delta.has_value()) {
    result.full_reason = "this store does not tell which tensors changed";
  } else if (!listing.delta->delta) {
    result.full_reason = listing.delta->full_reason;
  }
  // What the listing calls unchanged must be held as listed: else the held
  // tensors came from another query, and everything is fetched.
  for (const TensorDescription& d : listing.tensors) {
    if (!result.delta || !d.unchanged) continue;
    auto it = by_name.find(d.spec.name);
    if (it == by_name.end() || it->second->spec.dtype != d.spec.dtype || it->second->spec.shape != d.spec.shape) {
      result.delta = false;
      result.full_reason = absl::StrCat("tensor '", d.spec.name, "' is not held as the query selects it");
      break;
    }
  }
  query.version = listing.version;  // fetch what was listed, or fail ABORTED
  if (!result.delta) query.since_version.clear();
  CollectingSink sink(query.cancel);
  WEIGHTSTORE_RETURN_IF_ERROR(store.FetchTensors(name, query, &sink));

  absl::flat_hash_map<std::string, SharedTensor*> fetched;
  for (SharedTensor& t : sink.tensors()) fetched.emplace(t.spec.name, &t);
  HeldTensors next{listing.version, {}};
  next.tensors.reserve(listing.tensors.size());
  absl::flat_hash_set<std::string> listed;
  for (const TensorDescription& d : listing.tensors) {
    listed.insert(d.spec.name);
    auto f = fetched.find(d.spec.name);
    // An unchanged tensor may come all the same: the daemon dropped the
    // since version's digests between the listing and the fetch.
    const bool kept = result.delta && d.unchanged && f == fetched.end();
    if (!kept && f == fetched.end()) {
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
    result.fetched_bytes += f->second->bytes.size();
    ++result.fetched_tensors;
    next.tensors.push_back(std::move(*f->second));
  }
  if (sink.tensors().size() != result.fetched_tensors) {
    return absl::DataLossError(absl::StrCat("update of '", name, "': the daemon sent ", sink.tensors().size(),
                                            " tensors where the listing called for ", result.fetched_tensors));
  }
  for (const SharedTensor& t : held->tensors) {
    if (!listed.contains(t.spec.name)) result.removed.push_back(t.spec.name);
  }
  result.new_version = next.version;
  *held = std::move(next);
  return result;
}

}  // namespace weightstore::client
