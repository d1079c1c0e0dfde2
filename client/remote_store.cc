// RemoteStore: a Store over weightstored's gRPC API.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/impl/codegen/client_context.h>
#include <grpcpp/impl/codegen/sync_stream.h>
#include <grpcpp/impl/codegen/proto_buffer_reader.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/security/credentials.h>

#include <cstring>
#include <thread>


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
    while (true) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      // The generated stub's reader, but over raw ByteBuffers: chunks are parsed
      // from gRPC's own slices while the next one is being received.
      std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
          grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel_.get(), fetch_method_, &ctx, req));
      grpc::ByteBuffer chunk;
      absl::Status local = absl::OkStatus();
      while (local.ok() && reader->Read(&chunk)) local = Consume(&chunk, &req, sink);
      if (!local.ok()) {
        ctx.TryCancel();
        reader->Finish();
        return local;
      }
      grpc::Status status = reader->Finish();
      if (status.ok()) return absl::OkStatus();
      if (!Resumable(status) || ++resumes > options_.max_resumes || req.version().empty()) return FromGrpc(status);
      current_.reset();  // tensors before start_index are complete; the current one restarts
      std::this_thread::sleep_for(options_.resume_backoff * resumes);
    }
  }

 private:
  struct InProgress {
    TensorSpec spec;
    std::span<std::byte> out;
    uint64_t received = 0;
    uint32_t crc = 0;
  };

  // Parses one TensorChunk from `buffer`. The payload is copied once, from
  // gRPC's slices into the sink's buffer; the small fields are parsed as usual.
  absl::Status Consume(grpc::ByteBuffer* buffer, pb::FetchTensorsRequest* req, TensorSink* sink) {
    using google::protobuf::internal::WireFormatLite;
    grpc::ProtoBufferReader reader(buffer);
    google::protobuf::io::CodedInputStream in(&reader);
    uint64_t index = 0, offset = 0;
    bool last = false, have_offset = false;
    uint32_t crc = 0;
    std::string early_data;  // only if data came before offset (not how we send it)
    bool early = false;
    uint64_t data_size = 0;
    auto bad = [] { return absl::DataLossError("malformed TensorChunk"); };
    while (uint32_t tag = in.ReadTag()) {
      const int field = WireFormatLite::GetTagFieldNumber(tag);
      switch (field) {
        case pb::TensorChunk::kInfoFieldNumber: {
          uint32_t length;
          if (!in.ReadVarint32(&length)) return bad();
          auto limit = in.PushLimit(static_cast<int>(length));
          pb::TensorInfo info;
          if (!info.MergePartialFromCodedStream(&in) || !in.ConsumedEntireMessage()) return bad();
          in.PopLimit(limit);
          TensorDescription d;
          WEIGHTSTORE_RETURN_IF_ERROR(FromProto(info, &d));
          WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out, sink->Begin(d.spec));
          if (out.size() != d.spec.byte_size()) {
            return absl::InternalError(absl::StrCat("sink gave ", out.size(), " bytes for tensor '", d.spec.name, "'"));
          }
          current_ = InProgress{d.spec, out, 0, 0};
          break;
        }
        case pb::TensorChunk::kTensorIndexFieldNumber:
          if (!in.ReadVarint64(&index)) return bad();
          break;
        case pb::TensorChunk::kOffsetFieldNumber:
          if (!in.ReadVarint64(&offset)) return bad();
          have_offset = true;
          break;
        case pb::TensorChunk::kDataFieldNumber: {
          uint32_t length;
          if (!in.ReadVarint32(&length)) return bad();
          data_size = length;
          if (!current_ || !have_offset) {  // unusual field order: keep it aside
            early = true;
            if (!in.ReadString(&early_data, static_cast<int>(length))) return bad();
            break;
          }
          InProgress& t = *current_;
          if (offset != t.received || length > t.out.size() - t.received) {
            return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "': chunk at offset ", offset,
                                                    " does not follow byte ", t.received));
          }
          if (!in.ReadRaw(t.out.data() + t.received, static_cast<int>(length))) return bad();
          break;
        }
        case pb::TensorChunk::kLastFieldNumber: {
          uint64_t v;
          if (!in.ReadVarint64(&v)) return bad();
          last = v != 0;
          break;
        }
        case pb::TensorChunk::kCrc32CFieldNumber:
          if (!in.ReadLittleEndian32(&crc)) return bad();
          break;
        case pb::TensorChunk::kVersionFieldNumber: {
          std::string version;
          if (!WireFormatLite::ReadString(&in, &version)) return bad();
          req->set_version(version);  // pin what we started on
          break;
        }
        default:
          if (!WireFormatLite::SkipField(&in, tag)) return bad();
      }
    }
    if (!current_) {
      if (data_size == 0 && last) return absl::OkStatus();  // an empty selection
      return absl::DataLossError("stream sent data before a tensor's description");
    }
    InProgress& t = *current_;
    if (early) {
      if (offset != t.received || early_data.size() > t.out.size() - t.received) {
        return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "': chunk does not follow byte ", t.received));
      }
      std::memcpy(t.out.data() + t.received, early_data.data(), early_data.size());
    }
    t.crc = Crc32cExtend(t.crc, absl::string_view(reinterpret_cast<const char*>(t.out.data() + t.received), data_size));
    t.received += data_size;
    if (!last) return absl::OkStatus();
    if (t.received != t.out.size()) {
      return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "' ended after ", t.received, " of ",
                                              t.out.size(), " bytes"));
    }
    if (t.crc != crc) {
      return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "' failed its CRC32C check (got ", t.crc,
                                              ", the server sent ", crc, ")"));
    }
    WEIGHTSTORE_RETURN_IF_ERROR(sink->End(t.spec));
    req->set_start_index(index + 1);
    current_.reset();
    return absl::OkStatus();
  }

  void SetDeadline(grpc::ClientContext* ctx) { ctx->set_deadline(std::chrono::system_clock::now() + options_.deadline); }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::WeightStore::Stub> stub_;
  grpc::internal::RpcMethod fetch_method_;
  RemoteOptions options_;
  std::optional<InProgress> current_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> ConnectRemoteStore(const std::string& address, RemoteOptions options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  args.SetMaxSendMessageSize(4 << 20);
  // A connection of its own: channels with equal arguments would otherwise share
  // one connection (and its flow-control window) through gRPC's global pool.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (options.stream_window_bytes > 0) args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, options.stream_window_bytes);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (channel == nullptr) return absl::InvalidArgumentError(absl::StrCat("cannot create a channel to '", address, "'"));
  return std::unique_ptr<Store>(new RemoteStore(std::move(channel), options));
}

}  // namespace weightstore::client
