// LocalStore: a Store over files read in this process, through the same registry
// and selection code the daemon uses.
#include <algorithm>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/parallel_copy.h"
#include "client/store.h"
#include "core/catalog/registry.h"
#include "core/crc32c.h"
#include "core/format.h"
#include "core/host_buffer.h"
#include "core/select/served.h"
#include "core/select/snapshot.h"
#include "core/status_macros.h"

namespace weightstore::client {
namespace {

CheckpointSummary Summarize(const CheckpointVersion& v) {
  const Checkpoint& c = *v.checkpoint();
  return CheckpointSummary{v.name(),
                           std::string(c.format().name),
                           c.detail(),
                           v.path(),
                           c.total_bytes(),
                           c.size(),
                           c.metadata(),
                           v.version(),
                           v.loaded_at_unix_seconds(),
                           c.quantization() == nullptr ? "" : c.quantization()->Describe()};
}

class LocalStore final : public Store {
 public:
  explicit LocalStore(RegistryOptions options) : registry_(std::move(options)) {}
  CheckpointRegistry& registry() { return registry_; }

  using Store::GetCheckpoint;
  using Store::ListCheckpoints;
  // Local calls do not wait on anyone: `cancel` has nothing to end.
  absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints(
      const std::shared_ptr<const std::atomic<bool>>&) override {
    std::vector<CheckpointSummary> out;
    for (const auto& v : registry_.List()) out.push_back(Summarize(*v));
    return out;
  }

  absl::StatusOr<CheckpointSummary> GetCheckpoint(const std::string& name,
                                                  const std::shared_ptr<const std::atomic<bool>>&) override {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto v, registry_.Find(name));
    return Summarize(*v);
  }

  absl::StatusOr<TensorListing> ListTensors(const std::string& name, const Query& query) override {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto v, registry_.Find(name, query.version));
    TensorListing listing;
    listing.version = v->version();
    std::shared_ptr<const Snapshot> snapshot;
    WEIGHTSTORE_RETURN_IF_ERROR(Resolve(*v, query, &snapshot, &listing.apply_result));
    for (const SnapshotTensor& t : snapshot->tensors()) {
      TensorDescription d = Describe(t);
      if (query.with_checksums) {
        WEIGHTSTORE_ASSIGN_OR_RETURN(d.crc32c,
                                     ServedChecksum(*snapshot, PlanServedTensor(*snapshot, t), v->checksums()));
      }
      listing.tensors.push_back(std::move(d));
    }
    return listing;
  }

  // A tensor is written about 64 MiB at a time on one thread, and in pieces
  // of about 4 MiB on several (client/parallel_copy.h); the cancel flag is
  // asked before each piece. Tensors are begun a batch at a time (as many as
  // the sink lets open, up to kBatchBytes) and their pieces copied together,
  // so a model's many small tensors fill every core.
  static constexpr uint64_t kCopyPiece = uint64_t{64} << 20;
  static constexpr uint64_t kBatchBytes = uint64_t{64} << 20;

  absl::Status FetchTensors(const std::string& name, const Query& query, TensorSink* sink) override {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto v, registry_.Find(name, query.version));
    std::shared_ptr<const Snapshot> snapshot;
    std::optional<ApplyResult> result;
    WEIGHTSTORE_RETURN_IF_ERROR(Resolve(*v, query, &snapshot, &result));
    sink->OnVersion(v->version());
    // A tensor begun: where it goes, how it is made, and what of its source
    // may be dropped once copied (empty, or the served bytes: Releasable).
    struct Open {
      const SnapshotTensor* tensor;
      std::span<std::byte> out;
      ServedTensorPlan plan;
      std::span<const std::byte> release;
    };
    std::vector<Open> batch;
    uint64_t batch_bytes = 0;
    auto flush = [&]() -> absl::Status {
      const bool parallel = CopyThreads() > 1;
      std::vector<CopyJob> jobs;
      jobs.reserve(batch.size());
      for (const Open& o : batch) {
        jobs.push_back({o.out.size(), ServedPieceBytes(o.plan, parallel ? kCopyPieceBytes : kCopyPiece),
                        [&o, &snapshot, &query](uint64_t at, uint64_t length) -> absl::Status {
                          if (query.cancel != nullptr && query.cancel->load()) {
                            return absl::CancelledError(absl::StrCat("cancelled in tensor '", o.tensor->spec.name,
                                                                     "' at byte ", at, " of ", o.out.size()));
                          }
                          const std::span<std::byte> to = o.out.subspan(at, length);
                          PrefaultForWriting(to);
                          WEIGHTSTORE_RETURN_IF_ERROR(MaterializeServed(*snapshot, o.plan, at, to));
                          if (!o.release.empty()) ReleaseCopiedPages(o.release.subspan(at, length));
                          return absl::OkStatus();
                        }});
      }
      if (absl::Status copied = RunCopyJobs(jobs); !copied.ok()) {
        return absl::Status(copied.code(), absl::StrCat("fetch of '", name, "': ", copied.message()));
      }
      for (const Open& o : batch) WEIGHTSTORE_RETURN_IF_ERROR(sink->End(o.tensor->spec));
      batch.clear();
      batch_bytes = 0;
      return absl::OkStatus();
    };
    const size_t open_ahead = std::max<size_t>(sink->OpenAhead(), 1);
    for (const SnapshotTensor& t : snapshot->tensors()) {
      if (!batch.empty() && (batch.size() >= open_ahead || batch_bytes + t.spec.byte_size() > kBatchBytes)) {
        WEIGHTSTORE_RETURN_IF_ERROR(flush());
      }
      WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out, sink->Begin(t.spec));
      WEIGHTSTORE_RETURN_IF_ERROR(CheckDestination(t.spec, out.size()));
      const ServedTensorPlan plan = PlanServedTensor(*snapshot, t);
      const std::span<const std::byte> release =
          query.release_source_pages ? Releasable(*snapshot, plan) : std::span<const std::byte>();
      batch_bytes += out.size();
      batch.push_back({&t, out, plan, release});
    }
    return flush();
  }

 private:
  // The bytes `plan` copies byte for byte, where they lie in a mapped file
  // (read-only: its pages stay in the page cache once dropped); empty for
  // bytes of any other kind (read with pread, inflated, fixed up, cast),
  // which are never dropped. The snapshot keeps them alive.
  static std::span<const std::byte> Releasable(const Snapshot& snapshot, const ServedTensorPlan& plan) {
    // A BOOL tensor to fix up would be copied just to be found not in a file.
    if (!plan.is_byte_range() || plan.tensor->source->layout.normalize_bool) return {};
    absl::StatusOr<SharedBytes> view = ReadServedView(snapshot, plan);
    if (!view.ok()) return {};
    const std::optional<FileExtent> extent = snapshot.checkpoint().Locate(*view);
    if (!extent || !snapshot.checkpoint().files()[extent->file]->is_mapped()) return {};
    return view->span();
  }

  static absl::Status Resolve(const CheckpointVersion& v, const Query& query, std::shared_ptr<const Snapshot>* out,
                              std::optional<ApplyResult>* result) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto selection, Selection::Compile(query.selection));
    if (!query.target) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(*out, Snapshot::Select(v.checkpoint(), *selection));
      return absl::OkStatus();
    }
    ApplyOptions options;
    options.allow_partial = query.allow_partial;
    WEIGHTSTORE_ASSIGN_OR_RETURN(Applied applied, Apply(v.checkpoint(), *selection, *query.target, options));
    *result = applied.result;
    if (!applied.status.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(applied.status.message(), "\n", applied.result.Summary()));
    }
    *out = applied.snapshot;
    return absl::OkStatus();
  }

  CheckpointRegistry registry_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> OpenLocalStore(const std::string& path, const OpenOptions& open) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool folder = fs::is_directory(path, ec);
  // A folder holding a sharded index is one checkpoint; any other folder is a models folder.
  bool sharded = false;
  if (folder) {
    for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
      if (IndexFormatForPath(it->path().filename().string()) != nullptr) sharded = true;
    }
  }
  if (folder && !sharded) {
    auto store = std::make_unique<LocalStore>(RegistryOptions{.models_dir = path, .open = open});
    ScanReport report = store->registry().Rescan();
    if (!report.errors.empty() && store->registry().List().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("no checkpoint could be read under '", path, "': ", report.errors[0]));
    }
    return std::unique_ptr<Store>(std::move(store));
  }
  fs::path p(path);
  const fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
  auto store = std::make_unique<LocalStore>(RegistryOptions{.models_dir = parent.string(), .open = open});
  WEIGHTSTORE_RETURN_IF_ERROR(store->registry().Load(path, "").status());
  return std::unique_ptr<Store>(std::move(store));
}

}  // namespace weightstore::client
