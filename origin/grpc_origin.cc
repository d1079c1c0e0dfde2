#include "origin/grpc_origin.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <filesystem>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/channel.h"
#include "core/crc32c.h"
#include "core/quant_config.h"
#include "core/status_macros.h"
#include "proto/codec/chunk_codec.h"
#include "proto/codec/status.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::origin {

namespace {

class GrpcOrigin : public Origin {
 public:
  GrpcOrigin(std::string url, client::RemoteOptions options, std::vector<std::shared_ptr<grpc::Channel>> channels)
      : url_(std::move(url)), options_(std::move(options)), channels_(std::move(channels)) {
    for (auto& c : channels_) stubs_.push_back(v1::WeightStore::NewStub(c));
  }

  std::string Describe() const override { return url_; }
  int parallel_reads() const override { return static_cast<int>(channels_.size()); }
  bool verifies_reads() const override { return true; }

  void Cancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
  }

  absl::StatusOr<OriginCheckpoint> Find(const std::string& name) override {
    grpc::ClientContext ctx;
    Tracked tracked(this, &ctx);
    v1::ListCheckpointFilesRequest request;
    request.set_name(name);
    v1::ListCheckpointFilesResponse response;
    absl::Status status = FromGrpcStatus(stubs_[0]->ListCheckpointFiles(&ctx, request, &response));
    if (!status.ok()) return status;
    if (response.files().empty() || !response.files().rbegin()->main()) {
      return absl::DataLossError(absl::StrCat("it lists no main file for '", name, "'"));
    }
    // Configs beside are no files of the checkpoint's: bounded apart.
    const size_t beside = absl::c_count_if(response.files(), [](const v1::StoredFile& f) { return f.beside(); });
    if (beside > QuantizationConfig::kFileNames.size()) {
      return absl::DataLossError(absl::StrCat("it lists ", beside, " files beside '", name, "'; at most ",
                                              QuantizationConfig::kFileNames.size(), " are taken"));
    }
    if (static_cast<size_t>(response.files_size()) - beside > max_files()) {
      return absl::FailedPreconditionError(absl::StrCat("it lists ", response.files_size() - beside, " files for '",
                                                        name, "'; a checkpoint of at most ", max_files(),
                                                        " files is pulled"));
    }
    OriginCheckpoint checkpoint;
    checkpoint.name = name;
    checkpoint.version = response.version();
    checkpoint.apart = response.apart();
    const std::string folder = std::filesystem::path(name).parent_path().string();
    for (const v1::StoredFile& f : response.files()) {
      OriginFile file;
      // The node places the main file at the name plus its suffix, and shards
      // beside it; the node cache checks both are paths it may create.
      file.path = f.main() ? absl::StrCat(name, f.path()) : (folder.empty() ? f.path() : folder + "/" + f.path());
      if (f.beside() && (f.main() || !absl::c_linear_search(QuantizationConfig::kFileNames, f.path()) ||
                         f.size() > QuantizationConfig::kMaxFileBytes)) {
        return absl::DataLossError(absl::StrCat(
            "it lists a file beside '", name, "', '", absl::CHexEscape(f.path().substr(0, 256)), "' (", f.size(),
            " bytes), that is no quantization config of at most ", QuantizationConfig::kMaxFileBytes, " bytes"));
      }
      if (!f.main() && absl::StrContains(f.path(), '/')) {
        return absl::DataLossError(absl::StrCat("it names a shard '", absl::CHexEscape(f.path().substr(0, 256)),
                                                "' outside its index's folder"));
      }
      file.beside = f.beside();
      file.checkpoint = name;
      file.key = f.path();
      file.size = f.size();
      // The version id for Find, and the files' own etag where the origin
      // gives one (a version id names content; the etag these bytes).
      file.etag = f.etag().empty() ? response.version() : absl::StrCat(response.version(), ":", f.etag());
      file.crc32c = f.crc32c();
      checkpoint.files.push_back(std::move(file));
    }
    return checkpoint;
  }

  absl::Status Read(const OriginFile& file, uint64_t offset, uint64_t length, const ByteSink& sink) override {
    if (length == 0) return absl::OkStatus();
    grpc::ClientContext ctx;
    Tracked tracked(this, &ctx);
    v1::ReadCheckpointFileRequest request;
    request.set_name(file.checkpoint);
    // "VERSION:ETAG", or a version alone (ids and etags hold no ':').
    const size_t colon = file.etag.find(':');
    request.set_version(file.etag.substr(0, colon));
    if (colon != std::string::npos) request.set_etag(file.etag.substr(colon + 1));
    request.set_path(file.key);
    request.set_offset(offset);
    request.set_length(length);
    // Over raw ByteBuffers: each chunk's data is checked and handed to the
    // sink as views of gRPC's own slices, never copied into a message.
    const size_t channel = next_channel_.fetch_add(1) % channels_.size();
    grpc::internal::RpcMethod method("/weightstore.v1.WeightStore/ReadCheckpointFile",
                                     grpc::internal::RpcMethod::SERVER_STREAMING, channels_[channel]);
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channels_[channel].get(), method, &ctx, request));
    grpc::ByteBuffer buffer;
    wire::FileChunkView chunk;
    uint64_t cursor = offset;
    const uint64_t end = offset + length;
    absl::Status failed;
    while (failed.ok() && reader->Read(&buffer)) {
      failed = wire::DecodeFileChunk(&buffer, &chunk);
      if (!failed.ok()) break;
      if (chunk.offset != cursor || chunk.data_bytes > end - cursor) {
        failed = absl::DataLossError(absl::StrCat("a chunk of '", file.path, "' at offset ", chunk.offset, " (",
                                                  chunk.data_bytes, " bytes) where ", cursor, " was due"));
        break;
      }
      uint32_t crc = 0;
      for (absl::string_view piece : chunk.data) crc = Crc32cExtend(crc, piece);
      if (crc != chunk.crc32c) {
        failed =
            absl::DataLossError(absl::StrCat("the chunk of '", file.path, "' at offset ", cursor, " fails its CRC32C"));
        break;
      }
      for (absl::string_view piece : chunk.data) {
        if (failed = sink(piece); !failed.ok()) break;
      }
      cursor += chunk.data_bytes;
    }
    if (!failed.ok()) {
      ctx.TryCancel();
      (void)reader->Finish();
      return failed;
    }
    absl::Status status = FromGrpcStatus(reader->Finish());
    if (!status.ok()) return status;
    if (cursor != end) {
      return absl::DataLossError(
          absl::StrCat("it sent ", cursor - offset, " of ", length, " bytes of '", file.path, "'"));
    }
    return absl::OkStatus();
  }

 private:
  // Sets a call's deadline and token, and keeps it cancellable by Cancel()
  // while `ctx` lives (Tracked).
  class Tracked {
   public:
    Tracked(GrpcOrigin* origin, grpc::ClientContext* ctx) : origin_(origin), ctx_(ctx) {
      ctx->set_deadline(std::chrono::system_clock::now() + origin->options_.deadline);
      if (!origin->options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + origin->options_.token);
      absl::MutexLock lock(&origin->mu_);
      if (origin->cancelled_) ctx->TryCancel();
      origin->calls_.insert(ctx);
    }
    ~Tracked() {
      absl::MutexLock lock(&origin_->mu_);
      origin_->calls_.erase(ctx_);
    }

   private:
    GrpcOrigin* origin_;
    grpc::ClientContext* ctx_;
  };

  const std::string url_;
  const client::RemoteOptions options_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;  // one connection each
  std::vector<std::unique_ptr<v1::WeightStore::Stub>> stubs_;
  std::atomic<size_t> next_channel_{0};
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

namespace {

// The address of a grpc:// or grpcs:// url; `options` keeps a CA only for
// TLS, which needs one.
absl::StatusOr<std::string> UpstreamAddress(const std::string& url, client::RemoteOptions* options) {
  std::string address;
  const bool tls = absl::StartsWith(url, "grpcs://");
  if (absl::StartsWith(url, "grpc://")) {
    address = url.substr(7);
  } else if (tls) {
    address = url.substr(8);
  }
  if (address.empty() || absl::StrContains(address, '/')) {
    return absl::InvalidArgumentError(
        absl::StrCat("origin '", absl::CHexEscape(url), "' is not grpc://HOST:PORT or grpcs://HOST:PORT"));
  }
  if (tls && options->tls_ca_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("origin '", url, "' uses TLS: give its CA (--origin-ca-file)"));
  }
  if (!tls) options->tls_ca_file.clear();
  return address;
}

}  // namespace

absl::StatusOr<std::unique_ptr<client::Store>> OpenGrpcUpstream(const std::string& url, client::RemoteOptions options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::string address, UpstreamAddress(url, &options));
  return client::ConnectRemoteStore(address, std::move(options));
}

absl::StatusOr<std::unique_ptr<Origin>> OpenGrpcOrigin(const std::string& url, client::RemoteOptions options,
                                                       int parallel_reads) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::string address, UpstreamAddress(url, &options));
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto make_channel, client::ChannelMaker(address, options));
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < std::max(1, parallel_reads); ++i) channels.push_back(make_channel());
  return std::unique_ptr<Origin>(new GrpcOrigin(url, std::move(options), std::move(channels)));
}

}  // namespace weightstore::origin
