// RemoteStore: a Store over weightstored's gRPC API.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/proto_convert.h"
#include "client/store.h"
#include "core/crc32c.h"
#include "core/status_macros.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::client {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// Transient failures after which a stream is worth resuming.
bool Resumable(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE || status.error_code() == grpc::StatusCode::INTERNAL ||
         status.error_code() == grpc::StatusCode::UNKNOWN || status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

class RemoteStore final : public Store {
 public:
  RemoteStore(std::shared_ptr<grpc::Channel> channel, RemoteOptions options)
      : stub_(pb::WeightStore::NewStub(channel)), options_(options) {}

  absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints() override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    pb::ListCheckpointsResponse resp;
    WEIGHTSTORE_RETURN_IF_ERROR(FromGrpc(stub_->ListCheckpoints(&ctx, pb::ListCheckpointsRequest(), &resp)));
    std::vector<CheckpointSummary> out(resp.checkpoints_size());
    for (int i = 0; i < resp.checkpoints_size(); ++i) FromProto(resp.checkpoints(i), &out[i]);
    return out;
  }

  absl::StatusOr<CheckpointSummary> GetCheckpoint(const std::string& name) override {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    pb::GetCheckpointRequest req;
    req.set_name(name);
    pb::CheckpointInfo resp;
    WEIGHTSTORE_RETURN_IF_ERROR(FromGrpc(stub_->GetCheckpoint(&ctx, req, &resp)));
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
    ToProto(query, req.mutable_selection());
    pb::ListTensorsResponse resp;
    WEIGHTSTORE_RETURN_IF_ERROR(FromGrpc(stub_->ListTensors(&ctx, req, &resp)));
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
    return listing;
  }

  // Streams chunks straight into the sink's buffers, checking each tensor's
  // CRC32C. A stream that breaks resumes at the first incomplete tensor, pinned
  // to the version it started on.
  absl::Status FetchTensors(const std::string& name, const Query& query, TensorSink* sink) override {
    pb::FetchTensorsRequest req;
    req.set_name(name);
    ToProto(query, req.mutable_selection());
    int resumes = 0;
    while (true) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      std::unique_ptr<grpc::ClientReader<pb::TensorChunk>> reader = stub_->FetchTensors(&ctx, req);
      pb::TensorChunk chunk;
      absl::Status local = absl::OkStatus();
      while (local.ok() && reader->Read(&chunk)) local = Consume(chunk, &req, sink);
      if (!local.ok()) {
        ctx.TryCancel();
        reader->Finish();
        return local;
      }
      grpc::Status status = reader->Finish();
      if (status.ok()) return absl::OkStatus();
      if (!Resumable(status) || ++resumes > options_.max_resumes || req.version().empty()) return FromGrpc(status);
      // Resume: tensors before start_index are complete; the current one restarts.
      current_.reset();
    }
  }

 private:
  struct InProgress {
    TensorSpec spec;
    std::span<std::byte> out;
    uint64_t received = 0;
    uint32_t crc = 0;
  };

  absl::Status Consume(const pb::TensorChunk& chunk, pb::FetchTensorsRequest* req, TensorSink* sink) {
    if (!chunk.version().empty()) req->set_version(chunk.version());  // pin what we started on
    if (chunk.has_info()) {
      TensorDescription d;
      WEIGHTSTORE_RETURN_IF_ERROR(FromProto(chunk.info(), &d));
      WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out, sink->Begin(d.spec));
      if (out.size() != d.spec.byte_size()) {
        return absl::InternalError(absl::StrCat("sink gave ", out.size(), " bytes for tensor '", d.spec.name, "'"));
      }
      current_ = InProgress{d.spec, out, 0, 0};
    }
    if (!current_) {
      if (chunk.data().empty() && chunk.last()) return absl::OkStatus();  // an empty selection
      return absl::DataLossError("stream sent data before a tensor's description");
    }
    InProgress& t = *current_;
    const std::string& data = chunk.data();
    if (chunk.offset() != t.received || data.size() > t.out.size() - t.received) {
      return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "': chunk at offset ", chunk.offset(),
                                              " does not follow byte ", t.received));
    }
    if (!data.empty()) std::memcpy(t.out.data() + t.received, data.data(), data.size());
    t.crc = Crc32cExtend(t.crc, data);
    t.received += data.size();
    if (!chunk.last()) return absl::OkStatus();
    if (t.received != t.out.size()) {
      return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "' ended after ", t.received, " of ",
                                              t.out.size(), " bytes"));
    }
    if (t.crc != chunk.crc32c()) {
      return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "' failed its CRC32C check (got ", t.crc,
                                              ", the server sent ", chunk.crc32c(), ")"));
    }
    WEIGHTSTORE_RETURN_IF_ERROR(sink->End(t.spec));
    req->set_start_index(chunk.tensor_index() + 1);
    current_.reset();
    return absl::OkStatus();
  }

  void SetDeadline(grpc::ClientContext* ctx) { ctx->set_deadline(std::chrono::system_clock::now() + options_.deadline); }

  std::unique_ptr<pb::WeightStore::Stub> stub_;
  RemoteOptions options_;
  std::optional<InProgress> current_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> ConnectRemoteStore(const std::string& address, RemoteOptions options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  args.SetMaxSendMessageSize(4 << 20);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (channel == nullptr) return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to '", address, "'"));
  return std::unique_ptr<Store>(new RemoteStore(std::move(channel), options));
}

}  // namespace weightstore::client
