// SharedMemoryStore: a Store over weightstored's same-host socket.
#include <fcntl.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <string_view>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/parallel_copy.h"
#include "client/proto_convert.h"
#include "client/store.h"
#include "core/crc32c.h"
#include "core/mapped_file.h"
#include "core/shm/filled_memfd.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "core/status_macros.h"
#include "weightstore/v1/shm.pb.h"

namespace weightstore::client {
namespace {

absl::Status FromResponse(const pb::ShmResponse& response) {
  if (response.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(response.code()), response.message());
}

// Checks a received descriptor against its declared segment and maps it.
absl::StatusOr<std::shared_ptr<const MappedFile>> MapSegment(UniqueFd fd, const pb::Segment& segment, size_t index,
                                                             bool copy_on_write) {
  const std::string what = absl::StrCat("segment ", index, " ('", segment.description(), "')");
  struct stat st;
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::DataLossError(absl::StrCat(what, " is not a regular file or memfd"));
  }
  if (static_cast<uint64_t>(st.st_size) != segment.size()) {
    return absl::DataLossError(absl::StrCat(what, " has ", st.st_size, " bytes; the daemon declared ", segment.size()));
  }
  if (segment.kind() == pb::Segment::SEALED_MEMFD) WEIGHTSTORE_RETURN_IF_ERROR(CheckSealed(fd.get(), what));
  if (segment.kind() == pb::Segment::FILLED_MEMFD) WEIGHTSTORE_RETURN_IF_ERROR(CheckFilledSeals(fd.get(), what));
  // Only the window the tensors lie in (FromDescriptor checks it fits), or all of it.
  const bool whole = segment.map_offset() == 0 && segment.map_size() == 0;
  return MappedFile::FromDescriptor(fd.release(), segment.description(), whole ? 0 : segment.map_offset(),
                                    whole ? segment.size() : segment.map_size(), copy_on_write);
}

// Whether a copying fetch reads the segments with pread (the default) or
// copies from their mappings ($WEIGHTSTORE_PREAD_COPIES=0, for measuring).
bool PreadCopies() {
  static const bool on = [] {
    const char* env = std::getenv("WEIGHTSTORE_PREAD_COPIES");
    return env == nullptr || std::string_view(env) != "0";
  }();
  return on;
}

// The most bytes of tensors a copying fetch begins before it ends them.
constexpr uint64_t kBatchBytes = uint64_t{64} << 20;

class ShmStore final : public SharedMemoryStore {
 public:
  ShmStore(std::string path, SharedMemoryOptions options) : path_(std::move(path)), options_(options) {}

  absl::Status Connect() {
    absl::MutexLock lock(&mu_);
    return ConnectLocked();
  }

  using Store::GetCheckpoint;
  using Store::ListCheckpoints;
  absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints(
      const std::shared_ptr<const std::atomic<bool>>& cancel) override {
    pb::ShmRequest request;
    request.mutable_list_checkpoints();
    WEIGHTSTORE_ASSIGN_OR_RETURN(Reply reply, Call(request, cancel));
    const auto& list = reply.response.list_checkpoints().checkpoints();
    std::vector<CheckpointSummary> out(list.size());
    for (int i = 0; i < list.size(); ++i) FromProto(list[i], &out[i]);
    return out;
  }

  absl::StatusOr<CheckpointSummary> GetCheckpoint(const std::string& name,
                                                  const std::shared_ptr<const std::atomic<bool>>& cancel) override {
    pb::ShmRequest request;
    request.mutable_get_checkpoint()->set_name(name);
    WEIGHTSTORE_ASSIGN_OR_RETURN(Reply reply, Named(Call(request, cancel), name));
    CheckpointSummary out;
    FromProto(reply.response.checkpoint(), &out);
    return out;
  }

  absl::StatusOr<TensorListing> ListTensors(const std::string& name, const Query& query) override {
    pb::ShmRequest request;
    Fill(name, query, request.mutable_map_tensors());
    request.mutable_map_tensors()->set_table_only(true);
    request.mutable_map_tensors()->set_skip_checksums(!query.with_checksums);
    WEIGHTSTORE_ASSIGN_OR_RETURN(Reply reply, Named(Call(request, query.cancel), name));
    const pb::MapTensorsResponse& map = reply.response.map_tensors();
    TensorListing listing;
    listing.version = map.version();
    listing.tensors.resize(map.tensors_size());
    for (int i = 0; i < map.tensors_size(); ++i) {
      WEIGHTSTORE_RETURN_IF_ERROR(FromProto(map.tensors(i).info(), &listing.tensors[i]));
    }
    if (map.has_apply_result()) FromProto(map.apply_result(), &listing.apply_result.emplace());
    listing.delta = DeltaFromProto(map);
    return listing;
  }

  absl::StatusOr<MappedTensors> MapTensors(const std::string& name, const Query& query) override {
    pb::ShmRequest request;
    Fill(name, query, request.mutable_map_tensors());
    WEIGHTSTORE_ASSIGN_OR_RETURN(Reply reply, Named(Call(request, query.cancel), name));
    const pb::MapTensorsResponse& map = reply.response.map_tensors();
    if (reply.fds.size() != static_cast<size_t>(map.segments_size())) {
      return absl::DataLossError(
          absl::StrCat("the daemon sent ", reply.fds.size(), " descriptors for ", map.segments_size(), " segments"));
    }
    MappedTensors out;
    out.version = map.version();
    for (int i = 0; i < map.segments_size(); ++i) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> segment,
                                   MapSegment(std::move(reply.fds[i]), map.segments(i), i, options_.copy_on_write));
      out.segments.push_back(std::move(segment));
    }
    out.tensors.reserve(map.tensors_size());
    out.descriptions.resize(map.tensors_size());
    absl::flat_hash_set<absl::string_view> names;  // of out.descriptions, which stay put
    for (int i = 0; i < map.tensors_size(); ++i) {
      const pb::MappedTensor& t = map.tensors(i);
      TensorDescription& d = out.descriptions[i];
      WEIGHTSTORE_RETURN_IF_ERROR(FromProto(t.info(), &d));
      if (!names.insert(d.spec.name).second) {
        return absl::DataLossError(absl::StrCat("the daemon sent tensor '", d.spec.name, "' twice"));
      }
      if (d.unchanged) {  // the caller keeps what it mapped
        if (query.since_version.empty()) {
          return absl::DataLossError(absl::StrCat("tensor '", d.spec.name, "' came unchanged, unasked"));
        }
        out.tensors.push_back({d.spec, SharedBytes()});
        continue;
      }
      std::optional<ElementPatch> patch;
      if (d.patched) {
        if (!query.patches || query.since_version.empty()) {
          return absl::DataLossError(absl::StrCat("tensor '", d.spec.name, "' came as an element patch, unasked"));
        }
        absl::StatusOr<ElementPatch> header = FromProto(t.info().patch(), d.spec);
        if (!header.ok()) {
          return absl::DataLossError(absl::StrCat("the daemon sent an invalid patch of tensor '", d.spec.name,
                                                  "': ", header.status().message()));
        }
        patch = *std::move(header);
      }
      // Offsets count from the segment's start; the mapping from its window's.
      const uint64_t size = patch ? t.info().patch().patch_bytes() : d.spec.byte_size();
      const MappedFile* segment = t.segment() < out.segments.size() ? out.segments[t.segment()].get() : nullptr;
      if (segment == nullptr || t.offset() < segment->offset() || t.offset() - segment->offset() > segment->size() ||
          size > segment->size() - (t.offset() - segment->offset())) {
        return absl::DataLossError(absl::StrCat(patch ? "the patch of tensor '" : "tensor '", d.spec.name,
                                                "' lies outside segment ", t.segment(), "'s mapped bytes"));
      }
      // A patch is parsed twice (checked, then applied): its bytes must be
      // ones no one can change, as the daemon's sealed memfds are.
      if (patch && map.segments(static_cast<int>(t.segment())).kind() != pb::Segment::SEALED_MEMFD) {
        return absl::DataLossError(absl::StrCat("the patch of tensor '", d.spec.name, "' lies in segment ", t.segment(),
                                                ", which is not a sealed memfd"));
      }
      SharedBytes bytes = out.segments[t.segment()]->bytes().Subspan(t.offset() - segment->offset(), size);
      if (patch) {  // applied by the caller, checked against the digest
        patch->body = std::move(bytes);
        out.patches.push_back({d.spec, d.digest, *std::move(patch)});
        out.tensors.push_back({d.spec, SharedBytes()});
        continue;
      }
      out.tensors.push_back({d.spec, std::move(bytes)});
    }
    if (map.has_apply_result()) FromProto(map.apply_result(), &out.apply_result.emplace());
    out.delta = DeltaFromProto(map);
    return out;
  }

  absl::Status FetchTensors(const std::string& name, const Query& query, TensorSink* sink) override {
    WEIGHTSTORE_ASSIGN_OR_RETURN(MappedTensors mapped, MapTensors(name, query));
    // Shared memory (a memfd, or a file on tmpfs: either has seals) is read
    // with pread, which builds no page tables for it; a file the daemon
    // hands out is copied from its mapping, whose page-cache folios map in
    // few faults
    // (shm_bench: pread 1.10-1.13x the mapping for a memfd, 0.89-0.93x for
    // a file).
    std::vector<bool> shared_memory(mapped.segments.size());
    for (size_t k = 0; k < mapped.segments.size(); ++k) {
      shared_memory[k] = ::fcntl(mapped.segments[k]->fd(), F_GET_SEALS) >= 0;
    }
    // The daemon checksums every tensor a fetch maps; one without its CRC32C
    // would be copied unchecked, from a file that may change. Checked before
    // anything is written.
    for (size_t i = 0; i < mapped.tensors.size(); ++i) {
      const TensorDescription& d = mapped.descriptions[i];
      if (!d.unchanged && !d.patched && !d.crc32c) {
        return absl::DataLossError(absl::StrCat("the daemon sent tensor '", d.spec.name, "' without its CRC32C"));
      }
    }
    sink->OnVersion(mapped.version);
    // Tensors are begun a batch at a time (as many as the sink lets open,
    // up to kBatchBytes), the pieces of all of them copied together on
    // several threads (client/parallel_copy.h), then ended in order: a
    // model's many tensors under a piece each fill every core. A piece of
    // shared memory is read through the segment's descriptor, never
    // touching the mapping (unless WEIGHTSTORE_PREAD_COPIES=0); else the
    // segments are this call's own mappings, never written, whose pages
    // may be dropped as the copy goes. Each is checksummed as it is written.
    struct Open {
      size_t index;
      std::span<std::byte> to;
      CopySource source;
      std::vector<uint32_t> crcs;  // of each piece
    };
    std::vector<Open> batch;
    uint64_t batch_bytes = 0;
    auto flush = [&]() -> absl::Status {
      std::vector<CopyJob> jobs;
      jobs.reserve(batch.size());
      for (Open& o : batch) {
        o.crcs.resize((o.to.size() + kCopyPieceBytes - 1) / kCopyPieceBytes);
        jobs.push_back({o.to.size(), kCopyPieceBytes, [&o, &query, &name, &mapped](uint64_t at, uint64_t length) {
                          if (query.cancel != nullptr && query.cancel->load()) {
                            return absl::CancelledError(absl::StrCat("fetch of '", name, "': cancelled in tensor '",
                                                                     mapped.tensors[o.index].spec.name, "' at byte ",
                                                                     at, " of ", o.to.size()));
                          }
                          absl::StatusOr<uint32_t> crc =
                              CopyPiece(o.to.subspan(at, length), o.source, at, /*checksum=*/true);
                          if (!crc.ok()) return crc.status();
                          o.crcs[at / kCopyPieceBytes] = *crc;
                          return absl::OkStatus();
                        }});
      }
      WEIGHTSTORE_RETURN_IF_ERROR(RunCopyJobs(jobs));
      for (const Open& o : batch) {
        const SharedTensor& t = mapped.tensors[o.index];
        if (const std::optional<uint32_t>& crc = mapped.descriptions[o.index].crc32c) {
          uint32_t got = o.crcs.empty() ? 0 : o.crcs[0];
          for (size_t k = 1; k < o.crcs.size(); ++k) {
            got = Crc32cConcat(got, o.crcs[k], std::min(kCopyPieceBytes, o.to.size() - k * kCopyPieceBytes));
          }
          if (got != *crc)
            return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "' does not match its CRC32C"));
        }
        WEIGHTSTORE_RETURN_IF_ERROR(sink->End(t.spec));
      }
      batch.clear();
      batch_bytes = 0;
      return absl::OkStatus();
    };
    const size_t open_ahead = std::max<size_t>(sink->OpenAhead(), 1);
    size_t next_patch = 0;
    for (size_t i = 0; i < mapped.tensors.size(); ++i) {
      const SharedTensor& t = mapped.tensors[i];
      if (mapped.descriptions[i].unchanged) continue;  // a delta leaves it out
      if (mapped.descriptions[i].patched) {
        WEIGHTSTORE_RETURN_IF_ERROR(flush());  // a patch is begun with no tensor open
        const ReceivedPatch& p = mapped.patches[next_patch++];
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out,
                                     sink->BeginPatch(p.spec, p.patch, p.patch.body.size(), p.digest));
        if (out.size() != p.patch.body.size()) {
          return absl::InternalError(
              absl::StrCat("sink gave ", out.size(), " bytes for the patch of '", p.spec.name, "'"));
        }
        std::memcpy(out.data(), p.patch.body.data(), out.size());
        WEIGHTSTORE_RETURN_IF_ERROR(sink->EndPatch(p.spec));
        continue;
      }
      if (!batch.empty() && (batch.size() >= open_ahead || batch_bytes + t.bytes.size() > kBatchBytes)) {
        WEIGHTSTORE_RETURN_IF_ERROR(flush());
      }
      WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out, sink->Begin(t.spec));
      WEIGHTSTORE_RETURN_IF_ERROR(CheckDestination(t.spec, out.size()));
      // An empty tensor's view may be null: no piece reads it.
      Open o{i, out.first(t.bytes.size()), {.from = t.bytes.data(), .release_from = query.release_source_pages}, {}};
      if (PreadCopies() && !t.bytes.empty()) {
        for (size_t k = 0; k < mapped.segments.size(); ++k) {
          uint64_t at = 0;
          if (mapped.segments[k]->Contains(t.bytes, &at)) {
            if (shared_memory[k]) {
              const MappedFile& from = *mapped.segments[k];
              o.source = {.fd = from.fd(), .offset = from.offset() + at, .what = from.path()};
            }
            break;
          }
        }
      }
      batch_bytes += t.bytes.size();
      batch.push_back(std::move(o));
    }
    WEIGHTSTORE_RETURN_IF_ERROR(flush());
    return absl::OkStatus();
  }

 private:
  struct Reply {
    pb::ShmResponse response;
    std::vector<UniqueFd> fds;
  };

  // A wait that was cancelled or timed out names the checkpoint it was for
  // (the daemon's own errors name it already).
  static absl::StatusOr<Reply> Named(absl::StatusOr<Reply> reply, const std::string& name) {
    if (reply.ok() || (!absl::IsCancelled(reply.status()) && !absl::IsDeadlineExceeded(reply.status()))) return reply;
    return absl::Status(reply.status().code(), absl::StrCat("checkpoint '", name, "': ", reply.status().message()));
  }

  static void Fill(const std::string& name, const Query& query, pb::MapTensorsRequest* out) {
    out->set_name(name);
    out->set_version(query.version);
    out->set_since_version(query.since_version);
    out->set_patches(query.patches);
    ToProto(query, out->mutable_selection());
  }

  static std::optional<DeltaInfo> DeltaFromProto(const pb::MapTensorsResponse& map) {
    if (!map.has_delta()) return std::nullopt;
    return FromProto(map.delta());
  }

  absl::Status ConnectLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(socket_, ConnectUnixSocket(path_));
    return SetSocketTimeouts(socket_.get(), options_.timeout);
  }

  // Sends `request` and returns the answer. A connection the daemon closed
  // (a restart) is replaced once; requests have no side effects, so resending
  // is safe. With `cancel`, the wait for the answer (a cast being made, a
  // checkpoint being pulled) ends within about 20 ms of it being set, and the
  // connection is dropped so that its late answer is never read.
  absl::StatusOr<Reply> Call(const pb::ShmRequest& request,
                             const std::shared_ptr<const std::atomic<bool>>& cancel = nullptr) {
    const std::string bytes = request.SerializeAsString();
    // Calls take turns on the connection, in order; one waiting for its turn
    // (another is waiting for its answer) is as cancellable as its own wait.
    if (!TakeTurn(cancel.get())) {
      return absl::CancelledError(
          absl::StrCat("weightstored socket '", path_, "': cancelled while another call on this store held it"));
    }
    absl::Cleanup give_turn = [this] {
      absl::MutexLock lock(&turn_mu_);
      busy_ = false;
    };
    absl::MutexLock lock(&mu_);  // uncontended: the turn is this call's
    return CallLocked(bytes, cancel.get());
  }

  // Waits until no other call holds the connection and takes it; false once
  // `cancel` (may be null) is set first.
  bool TakeTurn(const std::atomic<bool>* cancel) {
    absl::MutexLock lock(&turn_mu_);
    const absl::Condition free(
        +[](bool* busy) { return !*busy; }, &busy_);
    while (!turn_mu_.AwaitWithTimeout(free, absl::Milliseconds(20))) {
      if (cancel != nullptr && cancel->load()) return false;
    }
    busy_ = true;
    return true;
  }

  absl::StatusOr<Reply> CallLocked(const std::string& bytes, const std::atomic<bool>* cancel)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Status status;
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (!socket_.valid()) WEIGHTSTORE_RETURN_IF_ERROR(ConnectLocked());
      Reply reply;
      std::string frame;
      status = SendFrame(socket_.get(), bytes);
      if (status.ok() && cancel != nullptr) {
        if (absl::Status ready = WaitReadable(socket_.get(), *cancel, options_.timeout); !ready.ok()) {
          socket_.reset();
          return absl::Status(ready.code(), absl::StrCat("weightstored socket '", path_, "': ", ready.message()));
        }
      }
      // Even when sending failed, the daemon may have answered first and closed
      // (a refusal on connect): read what is queued. The whole answer within
      // the timeout, not each read of it, and cancellable throughout.
      FrameWait wait{.cancelled = cancel};
      if (options_.timeout.count() > 0) wait.deadline = std::chrono::steady_clock::now() + options_.timeout;
      absl::Status received = RecvFrame(socket_.get(), options_.max_response_bytes, &frame, &reply.fds, wait);
      if (status.ok() || received.ok()) status = received;
      if (status.ok()) {
        if (!reply.response.ParseFromString(frame))
          return absl::DataLossError("the daemon's answer is not a ShmResponse");
        WEIGHTSTORE_RETURN_IF_ERROR(FromResponse(reply.response));
        return reply;
      }
      socket_.reset();
      if (!absl::IsUnavailable(status) && !absl::IsOutOfRange(status)) break;
    }
    return absl::Status(status.code(), absl::StrCat("weightstored socket '", path_, "': ", status.message()));
  }

  const std::string path_;
  const SharedMemoryOptions options_;
  absl::Mutex turn_mu_;
  bool busy_ ABSL_GUARDED_BY(turn_mu_) = false;  // a call holds the connection
  absl::Mutex mu_;
  UniqueFd socket_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status MappedTensors::Verify() const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i < descriptions.size() && descriptions[i].crc32c &&
        Crc32c(tensors[i].bytes.view()) != *descriptions[i].crc32c) {
      return absl::DataLossError(absl::StrCat("tensor '", tensors[i].spec.name, "' does not match its CRC32C"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SharedMemoryStore>> ConnectSharedMemoryStore(const std::string& socket_path,
                                                                            SharedMemoryOptions options) {
  auto store = std::make_unique<ShmStore>(socket_path, options);
  WEIGHTSTORE_RETURN_IF_ERROR(store->Connect());
  return std::unique_ptr<SharedMemoryStore>(std::move(store));
}

}  // namespace weightstore::client
