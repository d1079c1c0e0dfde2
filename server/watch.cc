#include "server/watch.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <memory>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "proto/codec/chunk_codec.h"

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
class WatchReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  WatchReactor(WatchHub* hub, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw) : hub_(hub), ctx_(ctx) {
    v1::WatchCheckpointsRequest request;
    absl::Status status = wire::ParseMessage(*raw, &request)
                              ? Begin(*ctx, request)
                              : absl::InvalidArgumentError("request is not a WatchCheckpointsRequest");
    if (!status.ok()) {
      FinishOnce(hub_->client_status_(status));
      return;
    }
    Pump();
  }

  // Ends the stream (the daemon is shutting down). A write its watcher is not
  // reading is cancelled, so the stream ends now, not when it reads.
  void Stop() {
    FinishOnce(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the daemon is shutting down"));
    ctx_->TryCancel();
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      event_.Clear();         // its reference to the shared event
      if (pending_finish_) {  // Finish waited for this write
        finished_ = true;
        Finish(*pending_finish_);
        return;
      }
    }
    if (!ok) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the watcher went away"));
      return;
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
    if (slot_) hub_->Remove(this, std::move(slot_));
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
    WEIGHTSTORE_ASSIGN_OR_RETURN(slot_, hub_->Add(this, ctx.peer()));
    cursor_ = std::make_unique<WatchCursor>(hub_->registry_, WatchScope{request.name(), request.prefix()},
                                            std::move(known), &hub_->diffs_);
    {
      absl::MutexLock lock(&handle_->mu);
      handle_->reactor = this;
    }
    // On the publishing thread: only marks, and wakes the writer on the hub's
    // thread, which makes the event.
    listener_ = hub_->registry_->AddListener([hub = hub_, handle = handle_](const std::string& name) {
      // Scheduled under handle->mu (the hub's queue lock is a leaf): the
      // reactor, and so the hub, still live while this runs.
      absl::MutexLock lock(&handle->mu);
      if (handle->reactor == nullptr || !handle->reactor->cursor_->MarkChanged(name)) return;
      hub->Schedule([handle] {
        absl::MutexLock lock(&handle->mu);
        if (handle->reactor != nullptr) handle->reactor->Pump();
      });
    });
    cursor_->Start();
    return absl::OkStatus();
  }

  // Writes the next event the watcher is owed, unless a write is under way.
  // StartWrite and Finish are called under mu_, so neither can come between
  // the other's decision and its call (gRPC runs the reactions they cause on
  // its own threads, never inline).
  void Pump() {
    absl::MutexLock lock(&mu_);
    if (writing_ || finished_ || pending_finish_) return;
    std::optional<CheckpointUpdate> update = cursor_->Next();
    if (!update) return;
    event_ = *hub_->Event(*update);  // a reference to the step's one buffer
    event_bytes_ = event_.Length();
    writing_ = true;
    StartWrite(&event_);
  }

  // Finishes with `status` once: now, or when the write in flight completes.
  void FinishOnce(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    if (finished_ || pending_finish_) return;
    if (writing_) {
      pending_finish_ = status;
      return;
    }
    finished_ = true;
    Finish(status);
  }

  WatchHub* hub_;
  grpc::CallbackServerContext* ctx_;
  std::shared_ptr<Handle> handle_ = std::make_shared<Handle>();
  std::unique_ptr<WatchCursor> cursor_;
  uint64_t listener_ = 0;
  GateTicket slot_;  // from the hub's gate, once admitted
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> pending_finish_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer event_;  // the write in flight: shares the hub's event
  uint64_t event_bytes_ = 0;
};

namespace {

// Watches idle for as long as nothing changes: never watched for stalling; a
// watcher that stops reading holds one event.
StreamLimits GateLimits(const WatchLimits& limits) {
  return StreamLimits{.total = limits.max_watches,
                      .per_peer = limits.max_watches_per_peer,
                      .what = "WatchCheckpoints streams",
                      .total_flag = "--max-watches",
                      .per_peer_flag = "--max-watches-per-peer"};
}

}  // namespace

// Events kept for watchers still to be sent them: the last steps, and at
// most this many bytes (one event's names are bounded by ToProto's 1 MiB).
constexpr size_t kMaxEvents = 256;
constexpr uint64_t kMaxEventBytes = uint64_t{64} << 20;

WatchHub::WatchHub(CheckpointRegistry* registry, const Authenticator* auth, WatchLimits limits,
                   std::function<grpc::Status(const absl::Status&)> client_status)
    : registry_(registry),
      auth_(auth),
      limits_(limits),
      client_status_(std::move(client_status)),
      streams_(GateLimits(limits)),
      worker_([this] { RunScheduled(); }) {}

WatchHub::~WatchHub() {
  Stop();
  {
    absl::MutexLock lock(&work_mu_);
    work_stop_ = true;
  }
  worker_.join();
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchHub::Start(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* request) {
  return new WatchReactor(this, ctx, request);
}

void WatchHub::Schedule(std::function<void()> work) {
  absl::MutexLock lock(&work_mu_);
  work_.push_back(std::move(work));
}

void WatchHub::RunScheduled() {
  while (true) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&work_mu_);
      work_mu_.Await(absl::Condition(this, &WatchHub::HasWork));
      if (work_.empty()) return;  // stopping, nothing left
      work = std::move(work_.front());
      work_.pop_front();
    }
    work();
  }
}

std::shared_ptr<const grpc::ByteBuffer> WatchHub::Event(const CheckpointUpdate& update) {
  const std::string key = absl::StrCat(static_cast<int>(update.kind), "|", update.name.size(), ":", update.name, "|",
                                       update.old_version, "|", update.new_version);
  absl::MutexLock lock(&events_mu_);
  if (auto it = events_.find(key); it != events_.end()) return it->second;
  v1::CheckpointEvent event;
  ToProto(update, &event);
  const std::string bytes = event.SerializeAsString();
  grpc::Slice slice(bytes);
  auto buffer = std::make_shared<const grpc::ByteBuffer>(&slice, 1);
  events_.emplace(key, buffer);
  event_order_.push_back(key);
  event_bytes_ += bytes.size();
  while (event_order_.size() > kMaxEvents || (event_bytes_ > kMaxEventBytes && event_order_.size() > 1)) {
    auto oldest = events_.find(event_order_.front());
    event_bytes_ -= oldest->second->Length();
    events_.erase(oldest);
    event_order_.pop_front();
  }
  return buffer;
}

absl::StatusOr<GateTicket> WatchHub::Add(WatchReactor* reactor, absl::string_view peer) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return absl::UnavailableError("the daemon is shutting down");
  WEIGHTSTORE_ASSIGN_OR_RETURN(GateTicket slot, streams_.Admit(peer));
  reactors_.insert(reactor);
  return slot;
}

void WatchHub::Remove(WatchReactor* reactor, GateTicket slot) {
  slot.Release();
  bool last = false;
  {
    absl::MutexLock lock(&mu_);
    reactors_.erase(reactor);
    last = reactors_.empty();
  }
  // A watch arriving meanwhile only finds the caches empty: it makes its
  // events again.
  if (last) Schedule([this] { ReleaseCaches(); });
}

void WatchHub::ReleaseCaches() {
  {
    absl::MutexLock lock(&events_mu_);
    events_.clear();
    event_order_.clear();
    event_bytes_ = 0;
  }
  diffs_.Clear();
#ifdef __GLIBC__
  malloc_trim(0);  // the events' and diffs' pages, and the watchers' own state
#endif
}

uint64_t WatchHub::cached_bytes() const {
  absl::MutexLock lock(&events_mu_);
  return event_bytes_ + diffs_.bytes();
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
