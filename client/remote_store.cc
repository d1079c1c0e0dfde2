// RemoteStore: a Store over weightstored's gRPC API.
#include <grpcpp/create_channel.h>
#include <grpcpp/impl/codegen/client_context.h>
#include <grpcpp/impl/codegen/sync_stream.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/security/credentials.h>

#include <cstring>
#include <thread>


#include "absl/strings/str_cat.h"
#include "core/pem.h"
#include "client/chunk_assembler.h"
#include "client/proto_convert.h"
#include "client/store.h"
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
      : channel_(channel),
        stub_(pb::WeightStore::NewStub(channel)),
        fetch_method_("/weightstore.v1.WeightStore/FetchTensors", grpc::internal::RpcMethod::SERVER_STREAMING, channel),
        options_(options) {}

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
    if (options_.chunk_bytes > 0) req.set_chunk_bytes(options_.chunk_bytes);
    ToProto(query, req.mutable_selection());
    int resumes = 0;
    ChunkAssembler assembler;
    while (true) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      // The generated stub's reader, but over raw ByteBuffers: chunks are parsed
      // from gRPC's own slices while the next one is being received.
      std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
          grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel_.get(), fetch_method_, &ctx, req));
      grpc::ByteBuffer chunk;
      absl::Status local = absl::OkStatus();
      while (local.ok() && reader->Read(&chunk)) {
        local = assembler.Consume(&chunk, sink);
        if (!assembler.version().empty()) req.set_version(assembler.version());  // pin what we started on
        req.set_start_index(assembler.next_index());
      }
      if (!local.ok()) {
        ctx.TryCancel();
        reader->Finish();
        return local;
      }
      grpc::Status status = reader->Finish();
      if (status.ok()) return absl::OkStatus();
      if (!Resumable(status) || ++resumes > options_.max_resumes || req.version().empty()) return FromGrpc(status);
      assembler.Restart();  // tensors before start_index are complete; the current one restarts
      std::this_thread::sleep_for(options_.resume_backoff * resumes);
    }
  }

 private:
  // Every call: the deadline and, when configured, the bearer token.
  void SetDeadline(grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + options_.deadline);
    if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::WeightStore::Stub> stub_;
  grpc::internal::RpcMethod fetch_method_;
  RemoteOptions options_;
};

}  // namespace

namespace {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const RemoteOptions& options) {
  if (options.tls_ca_file.empty()) {
    if (!options.tls_cert_file.empty()) return absl::InvalidArgumentError("a client certificate needs --tls-ca too");
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  WEIGHTSTORE_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPemFile(options.tls_ca_file, "CA certificate"));
  if (!options.tls_cert_file.empty()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPemFile(options.tls_cert_file, "client certificate"));
    WEIGHTSTORE_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPemFile(options.tls_key_file, "client key"));
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> ConnectRemoteStore(const std::string& address, RemoteOptions options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, Credentials(options));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  args.SetMaxSendMessageSize(4 << 20);
  // A connection of its own: channels with equal arguments would otherwise share
  // one connection (and its flow-control window) through gRPC's global pool.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (options.stream_window_bytes > 0) args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, options.stream_window_bytes);
  auto channel = grpc::CreateCustomChannel(address, credentials, args);
  if (channel == nullptr) return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to '", address, "'"));
  return std::unique_ptr<Store>(new RemoteStore(std::move(channel), options));
}

}  // namespace weightstore::client
