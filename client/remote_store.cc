// RemoteStore: a Store over weightstored's gRPC API.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/impl/codegen/client_context.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/impl/codegen/sync_stream.h>
#include <grpcpp/security/credentials.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/channel.h"
#include "client/chunk_assembler.h"
#include "client/proto_convert.h"
#include "client/store.h"
#include "client/usable_cores.h"
#include "core/crc32c.h"
#include "core/shm/unix_socket.h"
#include "core/status_macros.h"
#include "proto/codec/data_lane.h"
#include "proto/codec/status.h"
#include "proto/codec/tls.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::client {
namespace {

// Transient failures after which a stream is worth resuming.
bool Resumable(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE || status.error_code() == grpc::StatusCode::INTERNAL ||
         status.error_code() == grpc::StatusCode::UNKNOWN ||
         status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

// While alive, cancels `ctx`'s call within about 20 ms of `cancel` being set,
// a read blocked on a stalled stream included. Without `cancel` it is nothing
// (no thread).
class CancelWatch {
 public:
  CancelWatch(const std::shared_ptr<const std::atomic<bool>>& cancel, grpc::ClientContext* ctx) {
    if (cancel == nullptr) return;
    thread_ = std::thread([this, cancel, ctx] {
      absl::MutexLock lock(&mu_);
      while (!stop_) {
        if (cancel->load()) {
          ctx->TryCancel();
          return;
        }
        mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20));
      }
    });
  }
  CancelWatch(const CancelWatch&) = delete;
  CancelWatch& operator=(const CancelWatch&) = delete;
  ~CancelWatch() {
    if (!thread_.joinable()) return;
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

 private:
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

bool Cancelled(const std::shared_ptr<const std::atomic<bool>>& cancel) { return cancel != nullptr && cancel->load(); }

// Versions a watch says it holds when it reconnects: weightstored's default
// bound (WatchLimits::max_known).
constexpr size_t kMaxKnownVersions = 10000;

// Sleeps `duration` in 20 ms steps; false as soon as `cancel` is set.
bool SleepUnlessCancelled(std::chrono::milliseconds duration, const std::shared_ptr<const std::atomic<bool>>& cancel) {
  for (auto slept = std::chrono::milliseconds(0); slept < duration; slept += std::chrono::milliseconds(20)) {
    if (Cancelled(cancel)) return false;
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(duration - slept, std::chrono::milliseconds(20)));
  }
  return !Cancelled(cancel);
}

CheckpointEvent EventFromProto(const pb::CheckpointEvent& in) {
  CheckpointEvent out;
  switch (in.kind()) {
    case pb::CheckpointEvent::ADDED:
      out.kind = CheckpointEvent::Kind::kAdded;
      break;
    case pb::CheckpointEvent::REPLACED:
      out.kind = CheckpointEvent::Kind::kReplaced;
      break;
    case pb::CheckpointEvent::REMOVED:
      out.kind = CheckpointEvent::Kind::kRemoved;
      break;
    default:
      out.kind = CheckpointEvent::Kind::kSynced;
  }
  out.name = in.name();
  out.old_version = in.old_version();
  out.new_version = in.new_version();
  out.delta = in.delta();
  out.full_reason = in.full_reason();
  out.changed.assign(in.changed_tensors().begin(), in.changed_tensors().end());
  out.added.assign(in.added_tensors().begin(), in.added_tensors().end());
  out.removed.assign(in.removed_tensors().begin(), in.removed_tensors().end());
  out.changed_count = in.changed_count();
  out.added_count = in.added_count();
  out.removed_count = in.removed_count();
  out.unchanged_count = in.unchanged_count();
  out.names_omitted = in.tensor_names_omitted();
  return out;
}

// Hands received chunks from the thread reading a stream to the thread copying
// them into the sink; at most `depth` wait in between.
class ChunkQueue {
 public:
  explicit ChunkQueue(size_t depth) : depth_(depth) {}

  // Blocks while full. Returns false, dropping `chunk`, once abandoned.
  bool Push(grpc::ByteBuffer chunk) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_, absl::Condition(this, &ChunkQueue::HasRoomOrAbandoned));
    if (abandoned_) return false;
    queue_.push_back(std::move(chunk));
    return true;
  }
  // Blocks while empty. Returns false once closed (or abandoned) and empty.
  bool Pop(grpc::ByteBuffer* chunk) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_, absl::Condition(this, &ChunkQueue::HasChunkOrClosed));
    if (queue_.empty()) return false;
    *chunk = std::move(queue_.front());
    queue_.pop_front();
    return true;
  }
  // No more chunks will come; Pop() still returns those queued.
  void Close() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  // The consumer gave up: drops what is queued and refuses further pushes.
  void Abandon() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    abandoned_ = closed_ = true;
    queue_.clear();
  }

 private:
  bool HasRoomOrAbandoned() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.size() < depth_ || abandoned_; }
  bool HasChunkOrClosed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || closed_; }

  const size_t depth_;
  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
};

class RemoteStore final : public Store {
 public:
  // `make_channel` opens a new connection each time it is called.
  RemoteStore(std::function<std::shared_ptr<grpc::Channel>()> make_channel, RemoteOptions options)
      : make_channel_(std::move(make_channel)),
        channel_(make_channel_()),
        stub_(pb::WeightStore::NewStub(channel_)),
        fetch_method_("/weightstore.v1.WeightStore/FetchTensors", grpc::internal::RpcMethod::SERVER_STREAMING,
                      channel_),
        options_(options) {}

  using Store::GetCheckpoint;
  using Store::ListCheckpoints;
  absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints(
      const std::shared_ptr<const std::atomic<bool>>& cancel) override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    pb::ListCheckpointsResponse resp;
    {
      CancelWatch watch(cancel, &ctx);
      absl::Status listed = FromGrpcStatus(stub_->ListCheckpoints(&ctx, pb::ListCheckpointsRequest(), &resp));
      if (absl::IsCancelled(listed) && Cancelled(cancel)) return absl::CancelledError("the listing was cancelled");
      WEIGHTSTORE_RETURN_IF_ERROR(listed);
    }
    std::vector<CheckpointSummary> out(resp.checkpoints_size());
    for (int i = 0; i < resp.checkpoints_size(); ++i) FromProto(resp.checkpoints(i), &out[i]);
    return out;
  }

  absl::StatusOr<CheckpointSummary> GetCheckpoint(const std::string& name,
                                                  const std::shared_ptr<const std::atomic<bool>>& cancel) override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    pb::GetCheckpointRequest req;
    req.set_name(name);
    pb::CheckpointInfo resp;
    {
      CancelWatch watch(cancel, &ctx);
      absl::Status got = FromGrpcStatus(stub_->GetCheckpoint(&ctx, req, &resp));
      if (absl::IsCancelled(got) && Cancelled(cancel)) {
        return absl::CancelledError(absl::StrCat("the call for checkpoint '", name, "' was cancelled"));
      }
      WEIGHTSTORE_RETURN_IF_ERROR(got);
    }
    CheckpointSummary out;
    FromProto(resp, &out);
    return out;
  }

  absl::StatusOr<TensorListing> ListTensors(const std::string& name, const Query& query) override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    pb::ListTensorsRequest req;
    req.set_name(name);
    req.set_with_checksums(query.with_checksums);
    req.set_version(query.version);
    req.set_since_version(query.since_version);
    req.set_patches(query.patches && !query.since_version.empty());
    ToProto(query, req.mutable_selection());
    pb::ListTensorsResponse resp;
    {
      CancelWatch watch(query.cancel, &ctx);  // a listing with checksums can take a while
      absl::Status listed = FromGrpcStatus(stub_->ListTensors(&ctx, req, &resp));
      if (absl::IsCancelled(listed) && query.cancel != nullptr && query.cancel->load()) {
        return absl::CancelledError(absl::StrCat("the listing of '", name, "' was cancelled"));
      }
      WEIGHTSTORE_RETURN_IF_ERROR(listed);
    }
    TensorListing listing;
    listing.version = resp.version();
    for (const pb::TensorInfo& info : resp.tensors()) {
      TensorDescription d;
      WEIGHTSTORE_RETURN_IF_ERROR(FromProto(info, &d));
      listing.tensors.push_back(std::move(d));
    }
    if (resp.has_apply_result()) {
      listing.apply_result.emplace();
      FromProto(resp.apply_result(), &*listing.apply_result);
    }
    if (resp.has_delta()) listing.delta = FromProto(resp.delta());
    return listing;
  }

  // Streams chunks straight into the sink's buffers, checking each tensor's
  // CRC32C. A stream that breaks resumes at the first incomplete tensor, pinned
  // to the version it started on.
  absl::Status FetchTensors(const std::string& name, const Query& query, TensorSink* sink) override {
    pb::FetchTensorsRequest req;
    req.set_name(name);
    req.set_version(query.version);
    req.set_since_version(query.since_version);
    req.set_patches(query.patches && !query.since_version.empty());
    ToProto(query, req.mutable_selection());
    return FetchRange(channel_.get(), std::move(req), query.cancel, sink);
  }

  // With parallel_streams > 1: contiguous ranges of about equal bytes, each on a
  // connection of its own, pinned to the version the listing saw.
  absl::StatusOr<Fetched> FetchVersioned(const std::string& name, const Query& query) override {
    const int parallel = options_.parallel_streams > 0 ? options_.parallel_streams : AutomaticParallelStreams();
    // A delta is one stream: it is the changed part of a checkpoint.
    if (parallel <= 1 || !query.since_version.empty()) return Store::FetchVersioned(name, query);
    Query listing_query = query;
    listing_query.with_checksums = false;
    WEIGHTSTORE_ASSIGN_OR_RETURN(TensorListing listing, ListTensors(name, listing_query));
    const size_t n = listing.tensors.size();
    const size_t streams = std::min<size_t>(static_cast<size_t>(parallel), std::max<size_t>(n, 1));
    if (streams <= 1) return Store::FetchVersioned(name, query);
    uint64_t total = 0;
    for (const auto& t : listing.tensors) total += t.spec.byte_size();
    std::vector<size_t> bounds = {0};  // range r is [bounds[r], bounds[r + 1])
    uint64_t running = 0;
    for (size_t i = 0; i < n && bounds.size() < streams; ++i) {
      running += listing.tensors[i].spec.byte_size();
      if (running * streams >= total * bounds.size() && i + 1 < n) bounds.push_back(i + 1);
    }
    bounds.push_back(n);
    std::vector<grpc::Channel*> channels = Channels(bounds.size() - 1);
    std::vector<CollectingSink> sinks;
    for (size_t r = 0; r + 1 < bounds.size(); ++r) sinks.emplace_back(query.cancel);
    std::vector<absl::Status> results(bounds.size() - 1);
    std::vector<std::thread> workers;
    for (size_t r = 0; r + 1 < bounds.size(); ++r) {
      workers.emplace_back([&, r] {
        pb::FetchTensorsRequest req;
        req.set_name(name);
        req.set_version(listing.version);
        req.set_start_index(bounds[r]);
        req.set_end_index(bounds[r + 1]);
        ToProto(query, req.mutable_selection());
        results[r] = FetchRange(channels[r], std::move(req), query.cancel, &sinks[r]);
      });
    }
    for (auto& w : workers) w.join();
    std::vector<SharedTensor> out;
    out.reserve(n);
    for (size_t r = 0; r < sinks.size(); ++r) {
      WEIGHTSTORE_RETURN_IF_ERROR(results[r]);
      for (SharedTensor& t : sinks[r].tensors()) out.push_back(std::move(t));
    }
    if (out.size() != n) return absl::DataLossError(absl::StrCat("fetched ", out.size(), " of ", n, " tensors"));
    return Fetched{std::move(listing.version), std::move(out)};
  }

  // Reopens a broken watch with the versions the caller holds by then, after
  // resume_backoff (doubling, at most 5 s), for as long as the daemon answers
  // within resume_window.
  absl::Status Watch(const WatchOptions& options,
                     const std::function<bool(const CheckpointEvent&)>& on_event) override {
    pb::WatchCheckpointsRequest req;
    req.set_name(options.name);
    req.set_prefix(options.prefix);
    std::map<std::string, std::string> known = options.known;
    int breaks = 0;
    auto reachable_until = std::chrono::system_clock::now() + options_.resume_window;
    while (true) {
      req.clear_known();
      for (const auto& [name, version] : known) {
        pb::KnownVersion* k = req.add_known();
        k->set_name(name);
        k->set_version(version);
      }
      if (breaks > 0) {
        // Wait for the daemon (it may be restarting), then watch with no
        // deadline: a watch lasts as long as the caller wants it.
        while (!channel_->WaitForConnected(
            std::min(reachable_until, std::chrono::system_clock::now() + std::chrono::milliseconds(100)))) {
          if (Cancelled(options.cancel)) return absl::CancelledError("the watch was cancelled");
          if (std::chrono::system_clock::now() >= reachable_until) {
            return absl::UnavailableError(absl::StrCat("the watch broke and the daemon did not come back within ",
                                                       options_.resume_window.count(), " ms"));
          }
        }
      }
      grpc::ClientContext ctx;
      if (!options_.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.token);
      CancelWatch watch(options.cancel, &ctx);
      std::unique_ptr<grpc::ClientReader<pb::CheckpointEvent>> reader = stub_->WatchCheckpoints(&ctx, req);
      pb::CheckpointEvent event;
      bool stopped = false;
      while (!stopped && reader->Read(&event)) {
        breaks = 0;  // the daemon answered
        CheckpointEvent e = EventFromProto(event);
        // What to say on reconnecting: only checkpoints in scope, and no more
        // than a daemon accepts (those left out come back as ADDED).
        const bool in_scope = options.name.empty() ? absl::StartsWith(e.name, options.prefix) : e.name == options.name;
        if (e.kind == CheckpointEvent::Kind::kRemoved) {
          known.erase(e.name);
        } else if (e.kind != CheckpointEvent::Kind::kSynced && in_scope &&
                   (known.size() < kMaxKnownVersions || known.contains(e.name))) {
          known[e.name] = e.new_version;
        }
        stopped = !on_event(e);
      }
      if (stopped) {
        ctx.TryCancel();
        reader->Finish();
        return absl::OkStatus();
      }
      grpc::Status status = reader->Finish();
      if (Cancelled(options.cancel)) return absl::CancelledError("the watch was cancelled");
      // A stream only ends in error: the daemon went away (or is shutting
      // down), or refused the request.
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE && status.error_code() != grpc::StatusCode::INTERNAL &&
          status.error_code() != grpc::StatusCode::UNKNOWN) {
        return FromGrpcStatus(status);
      }
      if (breaks == 0) reachable_until = std::chrono::system_clock::now() + options_.resume_window;
      if (std::chrono::system_clock::now() >= reachable_until) return FromGrpcStatus(status);
      const auto backoff = std::min<std::chrono::milliseconds>(options_.resume_backoff * (1 << std::min(breaks, 10)),
                                                               std::chrono::seconds(5));
      ++breaks;
      if (!SleepUnlessCancelled(backoff, options.cancel)) return absl::CancelledError("the watch was cancelled");
    }
  }

  // One stream: the header, each tensor's description and its bytes in
  // chunks of at most 1 MiB, the commit.
  absl::StatusOr<CheckpointSummary> Push(const std::string& name, const PushRequest& request) override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    pb::CheckpointInfo info;
    std::unique_ptr<grpc::ClientWriter<pb::PushCheckpointRequest>> writer = stub_->PushCheckpoint(&ctx, &info);
    pb::PushCheckpointRequest msg;
    pb::PushHeader* header = msg.mutable_header();
    header->set_name(name);
    header->set_base_version(request.base_version);
    for (const std::string& r : request.remove) header->add_remove(r);
    header->set_allow_new_tensors(request.allow_new_tensors);
    bool sent = writer->Write(msg);
    // A tensor's description, then its bytes (or its patch's) in chunks.
    auto send = [&](const TensorSpec& spec, const SharedBytes& bytes, const PushRequest::Patched* patched) {
      if (!sent) return;
      msg.Clear();
      pb::PushTensor* tensor = msg.mutable_tensor();
      tensor->set_name(spec.name);
      tensor->set_dtype(std::string(DTypeName(spec.dtype)));
      for (uint64_t d : spec.shape) tensor->add_shape(d);
      tensor->set_crc32c(Crc32c(bytes.view()));
      if (patched != nullptr) {
        pb::TensorPatch* p = tensor->mutable_patch();
        p->set_encoding(std::string(PatchEncodingName(patched->patch.encoding)));
        p->set_element_size(patched->patch.element_size);
        p->set_changed_elements(patched->patch.changed);
        p->set_patch_bytes(bytes.size());
        tensor->set_base_digest(patched->base_digest);
        tensor->set_digest(patched->digest);
      }
      sent = writer->Write(msg);
      constexpr size_t kChunk = 1 << 20;
      for (size_t offset = 0; sent && offset < bytes.size(); offset += kChunk) {
        msg.Clear();
        msg.set_data(std::string(bytes.view().substr(offset, kChunk)));
        sent = writer->Write(msg);
      }
    };
    for (const SharedTensor& t : request.tensors) send(t.spec, t.bytes, nullptr);
    for (const PushRequest::Patched& p : request.patched) send(p.spec, p.patch.body, &p);
    if (sent) {
      msg.Clear();
      msg.mutable_commit()->set_tensors(request.tensors.size() + request.patched.size());
      writer->Write(msg);
    }
    writer->WritesDone();
    WEIGHTSTORE_RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
    CheckpointSummary out;
    FromProto(info, &out);
    return out;
  }

 private:
  // Fetches req's range over `channel` into `sink`, resuming broken streams.
  // Once `cancel` is set, returns Cancelled within about 20 ms: mid-tensor,
  // mid-read and mid-backoff alike.
  absl::Status FetchRange(grpc::Channel* channel, pb::FetchTensorsRequest req,
                          const std::shared_ptr<const std::atomic<bool>>& cancel, TensorSink* sink) {
    const auto cancelled = [&] {
      return absl::CancelledError(
          absl::StrCat("the fetch of '", req.name(), "' was cancelled at tensor ", req.start_index()));
    };
    if (options_.chunk_bytes > 0) req.set_chunk_bytes(options_.chunk_bytes);
    int resumes = 0;
    absl::Status first_break;  // why the stream first broke, for the final error
    const std::string pinned = req.version();
    ChunkAssembler assembler(req.start_index());
    if (!req.since_version().empty()) {
      assembler.AllowSkips();  // a delta leaves out what is unchanged
      if (req.patches()) assembler.AllowPatches();
    } else if (options_.data_lane && options_.tls_ca_file.empty() &&
               std::chrono::steady_clock::now().time_since_epoch().count() >= lane_rests_until_.load()) {
      req.set_data_lane(true);
      assembler.AllowLane();
    }
    std::chrono::system_clock::time_point resume_until;
    while (true) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      if (resumes > 0) {
        // Wait for the daemon to come back (a restart) rather than failing
        // fast, within the resume window.
        ctx.set_wait_for_ready(true);
        ctx.set_deadline(std::min(resume_until, std::chrono::system_clock::now() + options_.deadline));
      }
      // The generated stub's reader, but over raw ByteBuffers: chunks are parsed
      // from gRPC's own slices while the next one is being received.
      CancelWatch watch(cancel, &ctx);
      std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
          grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel, fetch_method_, &ctx, req));
      absl::Status lane_break;  // the lane ended early: the stream's status says why
      bool lane_unreachable = false;
      absl::Status local =
          Receive(reader.get(), &ctx, &assembler, sink, req.data_lane(), cancel, &lane_break, &lane_unreachable);
      if (lane_unreachable && !Cancelled(cancel)) {
        // Asked again without the lane, at once (nothing of it was written):
        // a lane this store could not reach (a firewall, a proxy in between,
        // its handshakes taken) is not asked for again for a minute.
        reader->Finish();
        const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
        const int64_t was = lane_rests_until_.exchange(
            now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(kLaneRest).count());
        if (was <= now) {
          std::fprintf(stderr, "weightstore: %s; fetching over gRPC instead for a minute\n",
                       std::string(lane_break.message()).c_str());
        }
        req.set_data_lane(false);
        assembler.AllowLane(false);
        assembler.StartOver();  // the ticket's version too: unpinned, the fetch may meet a newer one
        continue;
      }
      if (local.ok() && !pinned.empty() && !assembler.version().empty() && assembler.version() != pinned) {
        local = absl::DataLossError(absl::StrCat("the fetch of '", req.name(), "' pinned to version ", pinned,
                                                 " was answered with version ", assembler.version()));
      }
      if (!assembler.version().empty()) req.set_version(assembler.version());  // pin what we started on
      req.set_start_index(assembler.next_index());
      if (!local.ok()) {
        reader->Finish();
        return Cancelled(cancel) ? cancelled() : local;
      }
      grpc::Status status = reader->Finish();
      if (status.ok() && !lane_break.ok()) {  // cut between the two (a middlebox): resumed as a break
        status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              absl::StrCat("the stream ended OK, but its data lane did not: ", lane_break.message()));
      }
      if (status.ok() && assembler.in_tensor()) {  // a daemon's bug, or a forged end: never a whole fetch
        status = grpc::Status(grpc::StatusCode::DATA_LOSS,
                              absl::StrCat("the fetch of '", req.name(), "' ended OK inside a tensor"));
      }
      if (status.ok()) {
        if (!req.version().empty()) sink->OnVersion(req.version());
        return absl::OkStatus();
      }
      if (Cancelled(cancel)) return cancelled();
      if (!Resumable(status) || ++resumes > options_.max_resumes || req.version().empty()) {
        absl::Status failed = FromGrpcStatus(status);
        if (first_break.ok()) return failed;
        return absl::Status(failed.code(),
                            absl::StrCat("the stream broke (", first_break.message(), "); resuming at tensor ",
                                         req.start_index(), " failed: ", failed.message()));
      }
      if (first_break.ok()) first_break = FromGrpcStatus(status);
      if (!lane_break.ok()) {  // a lane cut once: the rest of this fetch on the stream
        req.set_data_lane(false);
        assembler.AllowLane(false);
      }
      assembler.Restart();  // tensors before start_index are complete; the current one restarts
      const auto backoff = std::min<std::chrono::milliseconds>(
          options_.resume_backoff * (1 << std::min(resumes - 1, 10)), std::chrono::seconds(5));
      if (!SleepUnlessCancelled(backoff, cancel)) return cancelled();
      resume_until = std::chrono::system_clock::now() + options_.resume_window;
    }
  }

  // Reads the stream to its end through `assembler` into `sink`, or, when its
  // first message is a data lane's ticket, the lane. Returns the assembler's
  // (or the sink's, or the lane's) first error, after cancelling the call;
  // a lane that ended early goes to `lane_break` instead, for the stream's
  // status to explain (the daemon ends it first, then the stream).
  absl::Status Receive(grpc::ClientReader<grpc::ByteBuffer>* reader, grpc::ClientContext* ctx,
                       ChunkAssembler* assembler, TensorSink* sink, bool asked_lane,
                       const std::shared_ptr<const std::atomic<bool>>& cancel, absl::Status* lane_break,
                       bool* lane_unreachable) {
    grpc::ByteBuffer chunk;
    if (assembler->lane_allowed() && asked_lane) {
      if (!reader->Read(&chunk)) return absl::OkStatus();  // the status says why
      absl::Status status = assembler->Consume(&chunk, sink);
      if (status.ok() && assembler->lane().has_value()) {
        status = ReceiveLane(*assembler->lane(), ctx, cancel, assembler, sink, lane_unreachable);
        if (*lane_unreachable) {
          ctx->TryCancel();
          *lane_break = status;
          return absl::OkStatus();
        }
        if (absl::IsUnavailable(status)) {
          *lane_break = status;
          return absl::OkStatus();
        }
        if (status.ok() && reader->Read(&chunk)) {
          status = absl::DataLossError("the stream sent a chunk after its data lane's ticket");
        }
      }
      if (!status.ok()) {
        ctx->TryCancel();
        return status;
      }
      if (assembler->lane().has_value()) return absl::OkStatus();
      // No lane here: the first chunk was the stream's own; the rest follow.
    }
    const bool pipeline = options_.pipeline.value_or(AutomaticPipeline());
    if (!pipeline) {
      absl::Status status;
      while (status.ok() && reader->Read(&chunk)) status = assembler->Consume(&chunk, sink);
      if (!status.ok()) ctx->TryCancel();
      return status;
    }
    // Chunks hold gRPC's own slices, so queueing them copies nothing. Up to
    // four 1 MiB chunks in between: the one depth measured (docs/benchmarks.md).
    ChunkQueue queue(4);
    absl::Status status;
    std::thread copier([&] {
      grpc::ByteBuffer received;
      while (queue.Pop(&received)) {
        status = assembler->Consume(&received, sink);
        if (!status.ok()) {
          queue.Abandon();
          ctx->TryCancel();  // Read() below returns false
          return;
        }
      }
    });
    while (reader->Read(&chunk) && queue.Push(std::move(chunk))) {
    }
    queue.Close();
    copier.join();
    return status;
  }

  // Receives a stream's chunks over its data lane: connects to the lane's
  // port at the address the stream reached (`peer`), sends the ticket, checks
  // the daemon's proof, and reads frames into the sink until the end frame.
  // Until the proof, every failure sets *unreachable (nothing was written
  // yet: the caller asks again over gRPC). After it, Unavailable for a lane
  // that ended early, the stream's status then saying why.
  absl::Status ReceiveLane(const pb::DataLane& lane, grpc::ClientContext* ctx,
                           const std::shared_ptr<const std::atomic<bool>>& cancel, ChunkAssembler* assembler,
                           TensorSink* sink, bool* unreachable) {
    wire::LaneWait wait;
    wait.cancel = cancel.get();
    // A daemon that stops sending is waited on as a stream is: until the
    // call's deadline.
    wait.idle = options_.deadline;
    wait.deadline = std::chrono::steady_clock::now() + options_.deadline;
    // Until the proof: a daemon answers within its handshake time, so
    // whatever stays silent longer is not one.
    wire::LaneWait opening = wait;
    opening.idle = std::chrono::seconds(15);
    opening.deadline = std::min(wait.deadline, std::chrono::steady_clock::now() + std::chrono::seconds(15));
    absl::StatusOr<UniqueFd> fd = OpenLane(lane, ctx->peer(), opening);
    if (!fd.ok()) {
      *unreachable = !absl::IsCancelled(fd.status());
      return fd.status();
    }
    absl::Status status = ReceiveFrames(fd->get(), wait, assembler, sink);
    // This side ends the fetch (a cancel, bad bytes): the call's cancel goes
    // out before the lane closes, so the daemon counts a cancel, not a broken
    // lane. A lane the daemon ended is explained by the stream's status.
    if (!status.ok() && !absl::IsUnavailable(status)) ctx->TryCancel();
    return status;
  }

  // The lane's frames on `fd`, through `assembler` into `sink`, to the end frame.
  static absl::Status ReceiveFrames(int fd, const wire::LaneWait& wait, ChunkAssembler* assembler, TensorSink* sink) {
    std::array<std::byte, wire::kLaneFrameHeaderBytes> header_bytes;
    std::string meta;
    while (true) {
      WEIGHTSTORE_RETURN_IF_ERROR(wire::LaneReadExactly(fd, header_bytes, wait));
      WEIGHTSTORE_ASSIGN_OR_RETURN(wire::LaneFrameHeader header, wire::DecodeLaneFrameHeader(header_bytes));
      if (header.end()) {
        if (assembler->in_tensor()) return absl::DataLossError("the data lane ended inside a tensor");
        return absl::OkStatus();
      }
      meta.resize(header.meta_bytes);
      WEIGHTSTORE_RETURN_IF_ERROR(wire::LaneReadExactly(fd, std::as_writable_bytes(std::span(meta)), wait));
      grpc::Slice slice(meta);
      grpc::ByteBuffer meta_buffer(&slice, 1);
      WEIGHTSTORE_RETURN_IF_ERROR(assembler->ConsumeLaneFrame(
          &meta_buffer, header.data_bytes,
          [&](std::span<std::byte> out) { return wire::LaneReadExactly(fd, out, wait); }, sink));
    }
  }

  // The lane's connection, once the daemon proved it took it; Cancelled, or
  // why it could not be had, naming where.
  static absl::StatusOr<UniqueFd> OpenLane(const pb::DataLane& lane, const std::string& peer,
                                           const wire::LaneWait& wait) {
    std::optional<std::string> ip = wire::GrpcPeerIp(peer);
    if (!ip || lane.port() == 0 || lane.port() > 65535 || lane.ticket().size() != wire::kLaneTicketBytes ||
        lane.proof().size() != wire::kLaneTicketBytes) {
      return absl::FailedPreconditionError(absl::StrCat("the daemon offered a data lane (port ", lane.port(),
                                                        ") that a stream from '", peer, "' cannot use"));
    }
    const std::string where = absl::StrCat("the data lane at ", *ip, " port ", lane.port());
    WEIGHTSTORE_ASSIGN_OR_RETURN(UniqueFd fd, ConnectLane(*ip, static_cast<int>(lane.port()), wait));
    const std::string hello = std::string(wire::kLaneHello.data(), wire::kLaneHello.size()) + lane.ticket();
    const std::span<const std::byte> parts[] = {std::as_bytes(std::span(hello))};
    std::string answer(hello.size(), '\0');
    absl::Status status = wire::LaneWriteAll(fd.get(), parts, wait);
    if (status.ok()) status = wire::LaneReadExactly(fd.get(), std::as_writable_bytes(std::span(answer)), wait);
    if (absl::IsCancelled(status)) return status;
    if (!status.ok()) {
      return absl::UnavailableError(
          absl::StrCat(where,
                       " closed before the daemon took the connection (it refuses one from another address than the "
                       "stream's, or past its handshakes): ",
                       status.message()));
    }
    if (answer != std::string(wire::kLaneHello.data(), wire::kLaneHello.size()) + lane.proof()) {
      return absl::UnavailableError(absl::StrCat(where, " did not answer with the daemon's proof: not the daemon"));
    }
    return fd;
  }

  // A lane socket connected to `ip`:`port`, or Unavailable.
  static absl::StatusOr<UniqueFd> ConnectLane(const std::string& ip, int port, const wire::LaneWait& wait) {
    sockaddr_storage address{};
    socklen_t length = 0;
    auto* v4 = reinterpret_cast<sockaddr_in*>(&address);
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&address);
    if (inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
      v4->sin_family = AF_INET;
      v4->sin_port = htons(static_cast<uint16_t>(port));
      length = sizeof(sockaddr_in);
    } else if (inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
      v6->sin6_family = AF_INET6;
      v6->sin6_port = htons(static_cast<uint16_t>(port));
      length = sizeof(sockaddr_in6);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("'", ip, "' is not an address"));
    }
    const std::string where = absl::StrCat("the data lane at ", ip, " port ", port);
    UniqueFd fd(socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return absl::UnavailableError(absl::StrCat("cannot reach ", where, ": ", std::strerror(errno)));
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&address), length) != 0 && errno != EINPROGRESS) {
      return absl::UnavailableError(absl::StrCat("cannot reach ", where, ": ", std::strerror(errno)));
    }
    const auto until = std::min(wait.deadline, std::chrono::steady_clock::now() + std::chrono::seconds(10));
    while (true) {
      pollfd p{fd.get(), POLLOUT, 0};
      const int ready = poll(&p, 1, 20);
      if (ready > 0) break;
      if (wait.cancel != nullptr && wait.cancel->load()) return absl::CancelledError("the fetch was cancelled");
      if (std::chrono::steady_clock::now() >= until) {
        return absl::UnavailableError(absl::StrCat("cannot reach ", where, " within 10 s"));
      }
    }
    int error = 0;
    socklen_t error_length = sizeof error;
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &error_length);
    if (error != 0) return absl::UnavailableError(absl::StrCat("cannot reach ", where, ": ", std::strerror(error)));
    const int flags = fcntl(fd.get(), F_GETFL);
    if (flags < 0 || fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
      return absl::InternalError(absl::StrCat("cannot set up ", where, ": ", std::strerror(errno)));
    }
    WEIGHTSTORE_RETURN_IF_ERROR(wire::PrepareLaneSocket(fd.get()));
    return fd;
  }

  // `count` connections: the store's own, then extra ones opened once and kept.
  std::vector<grpc::Channel*> Channels(size_t count) {
    absl::MutexLock lock(&mu_);
    while (extra_channels_.size() + 1 < count) extra_channels_.push_back(make_channel_());
    std::vector<grpc::Channel*> out = {channel_.get()};
    for (size_t i = 0; i + 1 < count; ++i) out.push_back(extra_channels_[i].get());
    return out;
  }

  // Every call: the deadline and, when configured, the bearer token.
  void SetDeadline(grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + options_.deadline);
    if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
  }

  std::function<std::shared_ptr<grpc::Channel>()> make_channel_;
  std::shared_ptr<grpc::Channel> channel_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<grpc::Channel>> extra_channels_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<pb::WeightStore::Stub> stub_;
  grpc::internal::RpcMethod fetch_method_;
  RemoteOptions options_;
  // The lane is not asked for until then (steady clock ticks): it could not
  // be reached a moment ago.
  std::atomic<int64_t> lane_rests_until_{0};
  static constexpr std::chrono::seconds kLaneRest{60};
};

}  // namespace

namespace {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const RemoteOptions& options) {
  return wire::ChannelCredentialsFromPem(options.tls_ca_file, options.tls_cert_file, options.tls_key_file);
}

}  // namespace

int AutomaticParallelStreams() {
  static const int streams = std::clamp(UsableCores() / 4, 1, 4);
  return streams;
}

bool AutomaticPipeline() {
  static const bool on = UsableCores() >= 4;
  return on;
}

absl::StatusOr<std::function<std::shared_ptr<grpc::Channel>()>> ChannelMaker(const std::string& address,
                                                                             const RemoteOptions& options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, Credentials(options));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  args.SetMaxSendMessageSize(4 << 20);
  // A connection of its own: channels with equal arguments would otherwise share
  // one connection (and its flow-control window) through gRPC's global pool.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (options.stream_window_bytes > 0) {  // a fixed window: the BDP probe would grow it
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, options.stream_window_bytes);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  }
  // Each channel has its own subchannel pool, hence a connection of its own.
  return std::function<std::shared_ptr<grpc::Channel>()>(
      [address, credentials, args] { return grpc::CreateCustomChannel(address, credentials, args); });
}

absl::StatusOr<std::unique_ptr<Store>> ConnectRemoteStore(const std::string& address, RemoteOptions options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto make_channel, ChannelMaker(address, options));
  return std::unique_ptr<Store>(new RemoteStore(std::move(make_channel), options));
}

}  // namespace weightstore::client
