#include "server/watch.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace weightstore::server {

void ToProto(const CheckpointUpdate& update, v1::CheckpointEvent* out, size_t max_name_bytes) {
  using Kind = CheckpointUpdate::Kind;
  switch (update.kind) {
    case Kind::kAdded:
      out->set_kind(v1::CheckpointEvent::ADDED);
      break;
    case Kind::kReplaced:
      out->set_kind(v1::CheckpointEvent::REPLACED);
      break;
    case Kind::kRemoved:
      out->set_kind(v1::CheckpointEvent::REMOVED);
      break;
    case Kind::kSynced:
      out->set_kind(v1::CheckpointEvent::SYNCED);
      break;
  }
  out->set_name(update.name);
  out->set_old_version(update.old_version);
  out->set_new_version(update.new_version);
  out->set_full_reason(update.full_reason);
  if (!update.diff) return;
  const ManifestDiff& d = *update.diff;
  out->set_delta(true);
  out->set_changed_count(d.changed.size());
  out->set_added_count(d.added.size());
  out->set_removed_count(d.removed.size());
  out->set_unchanged_count(d.unchanged);
  size_t bytes = 0;
  for (const auto* list : {&d.changed, &d.added, &d.removed}) {
    for (const std::string& name : *list) bytes += name.size();
  }
  if (bytes > max_name_bytes) {
    out->set_tensor_names_omitted(true);
    return;
  }
  for (const std::string& name : d.changed) out->add_changed_tensors(name);
  for (const std::string& name : d.added) out->add_added_tensors(name);
  for (const std::string& name : d.removed) out->add_removed_tensors(name);
}

// One WatchCheckpoints stream: a registry listener marks names on its cursor,
// and one event at a time is written from it.
class WatchReactor : public grpc::ServerWriteReactor<v1::CheckpointEvent> {
 public:
  WatchReactor(WatchHub* hub, grpc::CallbackServerContext* ctx, const v1::WatchCheckpointsRequest* request)
      : hub_(hub) {
    absl::Status status = Begin(*ctx, *request);
    if (!status.ok()) {
      FinishOnce(hub_->client_status_(status));
      return;
    }
    Pump();
  }

  // Ends the stream (the daemon is shutting down).
  void Stop() { FinishOnce(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the daemon is shutting down")); }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away"));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
    }
    Pump();
  }
  void OnCancel() override { FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")); }
  void OnDone() override {
    {
      absl::MutexLock lock(&handle_->mu);  // waits out a listener call under way
      handle_->reactor = nullptr;
    }
    if (listener_ != 0) hub_->registry_->RemoveListener(listener_);
    if (added_) hub_->Remove(this);
    delete this;
  }

 private:
  // What the registry listener reaches; outlives the reactor.
  struct Handle {
    absl::Mutex mu;
    WatchReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
  };

  absl::Status Begin(const grpc::CallbackServerContext& ctx, const v1::WatchCheckpointsRequest& request) {
    WEIGHTSTORE_RETURN_IF_ERROR(hub_->auth_->Check(ctx, Scope::kRead));
    const size_t max_name = hub_->registry_->options().max_name_bytes;
    if (!request.name().empty()) {
      WEIGHTSTORE_RETURN_IF_ERROR(CheckCheckpointName(request.name(), max_name));
    }
    if (request.prefix().size() > max_name) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix of ", request.prefix().size(), " bytes is longer than any name (", max_name, ")"));
    }
    if (request.known_size() > hub_->limits_.max_known) {
      return absl::InvalidArgumentError(absl::StrCat("known lists ", request.known_size(), " versions, more than ",
                                                     hub_->limits_.max_known, " (one per checkpoint)"));
    }
    std::map<std::string, std::string> known;
    for (const v1::KnownVersion& k : request.known()) {
      WEIGHTSTORE_RETURN_IF_ERROR(CheckCheckpointName(k.name(), max_name));
      if (k.version().empty() || k.version().size() > 64) {
        return absl::InvalidArgumentError(absl::StrCat("known version of '", k.name(), "' has ", k.version().size(),
                                                       " bytes: not a version this daemon issues"));
      }
      if (!known.emplace(k.name(), k.version()).second) {
        return absl::InvalidArgumentError(absl::StrCat("known lists '", k.name(), "' twice"));
      }
    }
    absl::Status admitted;
    if (!hub_->Add(this, &admitted)) return admitted;
    added_ = true;
    cursor_ =
        std::make_unique<WatchCursor>(hub_->registry_, WatchScope{request.name(), request.prefix()}, std::move(known));
    {
      absl::MutexLock lock(&handle_->mu);
      handle_->reactor = this;
    }
    listener_ = hub_->registry_->AddListener([handle = handle_](const std::string& name) {
      absl::MutexLock lock(&handle->mu);
      if (handle->reactor != nullptr && handle->reactor->cursor_->MarkChanged(name)) handle->reactor->Pump();
    });
    cursor_->Start();
    return absl::OkStatus();
  }

  // Writes the next event the watcher is owed, unless a write is under way.
  void Pump() {
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      std::optional<CheckpointUpdate> update = cursor_->Next();
      if (!update) return;
      event_.Clear();
      ToProto(*update, &event_);
      writing_ = true;
    }
    StartWrite(&event_);
  }

  void FinishOnce(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
    }
    Finish(status);
  }

  WatchHub* hub_;
  std::shared_ptr<Handle> handle_ = std::make_shared<Handle>();
  std::unique_ptr<WatchCursor> cursor_;
  uint64_t listener_ = 0;
  bool added_ = false;
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  v1::CheckpointEvent event_;  // the write in flight
};

WatchHub::WatchHub(CheckpointRegistry* registry, const Authenticator* auth, WatchLimits limits,
                   std::function<grpc::Status(const absl::Status&)> client_status)
    : registry_(registry), auth_(auth), limits_(limits), client_status_(std::move(client_status)) {}

WatchHub::~WatchHub() { Stop(); }

grpc::ServerWriteReactor<v1::CheckpointEvent>* WatchHub::Start(grpc::CallbackServerContext* ctx,
                                                               const v1::WatchCheckpointsRequest* request) {
  return new WatchReactor(this, ctx, request);
}

bool WatchHub::Add(WatchReactor* reactor, absl::Status* status) {
  absl::MutexLock lock(&mu_);
  if (stopped_) {
    *status = absl::UnavailableError("the daemon is shutting down");
    return false;
  }
  if (static_cast<int>(reactors_.size()) >= limits_.max_watches) {
    *status = absl::ResourceExhaustedError(
        absl::StrCat("this daemon serves ", limits_.max_watches, " watches at once (weightstored --max-watches)"));
    return false;
  }
  reactors_.insert(reactor);
  return true;
}

void WatchHub::Remove(WatchReactor* reactor) {
  absl::MutexLock lock(&mu_);
  reactors_.erase(reactor);
}

void WatchHub::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  for (WatchReactor* reactor : reactors_) reactor->Stop();
}

int WatchHub::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(reactors_.size());
}

}  // namespace weightstore::server
