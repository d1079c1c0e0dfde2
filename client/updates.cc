#include "client/updates.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "client/proto_convert.h"
#include "core/status_macros.h"

namespace weightstore::client {

namespace {

// What `query` selects, as bytes that are equal exactly when two queries
// select alike: its Selection message, serialized deterministically.
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

}  // namespace

absl::StatusOr<ChangedTensors> FetchChanged(Store& store, const std::string& name, Query query) {
  ChangedTensors r;
  const bool asked = !query.since_version.empty();
  std::optional<DeltaInfo> delta;
  if (auto* shm = dynamic_cast<SharedMemoryStore*>(&store)) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(MappedTensors mapped, shm->MapTensors(name, query));
    for (size_t i = 0; i < mapped.tensors.size(); ++i) {
      if (!mapped.descriptions[i].unchanged) r.received.push_back(std::move(mapped.tensors[i]));
    }
    r.version = std::move(mapped.version);
    delta = std::move(mapped.delta);
    r.listed = std::move(mapped.descriptions);
  } else {
    WEIGHTSTORE_ASSIGN_OR_RETURN(TensorListing listing, store.ListTensors(name, query));
    query.version = listing.version;  // fetch what was listed, or fail ABORTED
    if (!listing.delta || !listing.delta->delta) query.since_version.clear();
    if (!listing.delta || !listing.delta->delta || listing.delta->changed_tensors > 0) {
      CollectingSink sink(query.cancel);
      WEIGHTSTORE_RETURN_IF_ERROR(store.FetchTensors(name, query, &sink));
      r.received = std::move(sink.tensors());
    }
    r.version = std::move(listing.version);
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

absl::StatusOr<UpdateResult> UpdateTensors(Store& store, const std::string& name, Query query, HeldTensors* held) {
  UpdateResult result;
  result.old_version = held->version;
  absl::flat_hash_map<std::string, const SharedTensor*> by_name;
  for (const SharedTensor& t : held->tensors) by_name.emplace(t.spec.name, &t);

  const std::string selection = SelectionKey(query);
  const bool reselected = !held->version.empty() && !held->selection.empty() && held->selection != selection;
  query.since_version = reselected ? "" : held->version;
  WEIGHTSTORE_ASSIGN_OR_RETURN(ChangedTensors r, FetchChanged(store, name, query));
  result.delta = r.delta;
  result.full_reason =
      reselected ? "the held tensors were selected otherwise (another selection, shard or dtype)" : r.full_reason;
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

  absl::flat_hash_map<std::string, SharedTensor*> sent;
  for (SharedTensor& t : r.received) sent.emplace(t.spec.name, &t);
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
    result.fetched_bytes += f->second->bytes.size();
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

}  // namespace weightstore::client
