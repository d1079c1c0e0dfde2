#include "server/uploads.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/catalog/push.h"
#include "core/status_macros.h"
#include "server/observability.h"
#include "server/proto_convert.h"

namespace weightstore::server {

namespace {

// What PutCheckpoint and PushCheckpoint share: admission (the admin scope, a
// slot of the uploads gate, the stall watchdog), one reading loop that counts
// every message's bytes as progress, and an end that frees the slot before
// the client can see the status (as fetch_stream.cc does). Only a commit message
// commits: the end of the stream reads the same whether the client finished
// or was cancelled.
template <typename Request>
class UploadReactor : public grpc::ServerReadReactor<Request> {
 public:
  void OnReadDone(bool ok) override {
    if (!ok) {
      return Fail(
          absl::CancelledError(absl::StrCat(Unfinished(), " ended without a commit message; nothing was ", Kept())));
    }
    watch_.Progress(request_.ByteSizeLong());
    absl::StatusOr<bool> more = Take(request_);
    if (!more.ok()) return Fail(more.status());
    if (*more) this->StartRead(&request_);
  }
  void OnDone() override { delete this; }  // the slot goes with its ticket

 protected:
  UploadReactor(const Serving& serving, grpc::CallbackServerContext* ctx) : serving_(serving), ctx_(ctx) {}
  virtual ~UploadReactor() = default;
  // Admits the upload and reads its first message, or finishes with why not.
  // The last call of a subclass's constructor.
  void Start() {
    absl::Status status = serving_.admit(*ctx_, Scope::kAdmin);
    if (status.ok()) {
      absl::StatusOr<GateTicket> slot = serving_.uploads->Admit(ctx_->peer());
      status = slot.status();
      if (slot.ok()) slot_ = *std::move(slot);
    }
    if (!status.ok()) {
      this->Finish(serving_.client_status(status));
      return;
    }
    // An upload that stalls holds temporary files and descriptors: its slot
    // is taken back like a stalled fetch's.
    grpc::CallbackServerContext* ctx = ctx_;
    watch_ = serving_.stalls->Watch(ctx->peer(), serving_.options->uploads, [ctx] { ctx->TryCancel(); });
    this->StartRead(&request_);
  }
  // Takes one message: true to read the next, false once it answered (End),
  // or the error the upload fails with.
  virtual absl::StatusOr<bool> Take(const Request& request) = 0;
  // "the upload of 'NAME'", for the error of a stream that ends early.
  virtual std::string Unfinished() const = 0;
  // What an upload that fails leaves: "stored", "published".
  virtual const char* Kept() const = 0;
  // Drops what the upload wrote so far (its session's temporary files).
  virtual void Abandon() = 0;
  // The commit's work (writing a version) can take long: the client is not
  // stalled meanwhile.
  void Committing() { watch_.Busy(); }
  void End(const grpc::Status& status) {
    watch_.Unwatch();
    slot_.Release();
    this->Finish(status);
  }

  const Serving& serving_;
  CheckpointRegistry* const registry_ = serving_.registry;
  grpc::CallbackServerContext* const ctx_;

 private:
  void Fail(const absl::Status& status) {
    Abandon();
    End(serving_.client_status(status));
  }

  Request request_;
  GateTicket slot_;
  StallWatchdog::Watched watch_;
};

// Receives an upload into a temporary file; validates and stores it when its
// commit message arrives.
class PutReactor : public UploadReactor<v1::PutCheckpointRequest> {
 public:
  PutReactor(const Serving& serving, v1::CheckpointInfo* response, grpc::CallbackServerContext* ctx)
      : UploadReactor(serving, ctx), response_(response) {
    Start();
  }

 private:
  absl::StatusOr<bool> Take(const v1::PutCheckpointRequest& request) override {
    switch (request.part_case()) {
      case v1::PutCheckpointRequest::kHeader: {
        if (session_ != nullptr) return absl::InvalidArgumentError("a second header");
        const v1::PutHeader& h = request.header();
        Annotate(ctx_, h.name());
        WEIGHTSTORE_ASSIGN_OR_RETURN(session_, registry_->BeginPut(h.name(), h.extension(), h.overwrite(), h.size()));
        return true;
      }
      case v1::PutCheckpointRequest::kData:
        if (session_ == nullptr) return absl::InvalidArgumentError("data before the header");
        WEIGHTSTORE_RETURN_IF_ERROR(session_->Append(request.data()));
        return true;
      case v1::PutCheckpointRequest::kCommit: {
        const v1::PutCommit& commit = request.commit();
        if (session_ == nullptr) return absl::InvalidArgumentError("a commit before the header");
        if (commit.size() != session_->bytes() || commit.crc32c() != session_->crc32c()) {
          return absl::DataLossError(absl::StrCat("upload of '", session_->name(), "': the commit says ", commit.size(),
                                                  " bytes with CRC32C ", commit.crc32c(), ", ", session_->bytes(),
                                                  " bytes with CRC32C ", session_->crc32c(),
                                                  " arrived; nothing was stored"));
        }
        Committing();
        WEIGHTSTORE_ASSIGN_OR_RETURN(auto version, registry_->FinishPut(std::move(session_)));
        ToProto(*version, response_);
        End(grpc::Status::OK);
        return false;
      }
      default:
        return absl::InvalidArgumentError("a PutCheckpointRequest with no part");
    }
  }
  std::string Unfinished() const override {
    return absl::StrCat("the upload", session_ == nullptr ? "" : absl::StrCat(" of '", session_->name(), "'"));
  }
  const char* Kept() const override { return "stored"; }
  void Abandon() override { session_.reset(); }  // removes the temporary file

  v1::CheckpointInfo* response_;
  std::unique_ptr<PutSession> session_;
};

// Receives a push: the header starts a PushSession on the base, each tensor's
// bytes go to its staging file, and only the commit message publishes.
class PushReactor : public UploadReactor<v1::PushCheckpointRequest> {
 public:
  PushReactor(const Serving& serving, v1::CheckpointInfo* response, grpc::CallbackServerContext* ctx)
      : UploadReactor(serving, ctx), response_(response) {
    Start();
  }

 private:
  absl::StatusOr<bool> Take(const v1::PushCheckpointRequest& request) override {
    switch (request.part_case()) {
      case v1::PushCheckpointRequest::kHeader: {
        if (session_ != nullptr) return absl::InvalidArgumentError("a second header");
        const v1::PushHeader& h = request.header();
        Annotate(ctx_, h.name());
        PushOptions options{h.base_version(), {h.remove().begin(), h.remove().end()}, h.allow_new_tensors()};
        WEIGHTSTORE_ASSIGN_OR_RETURN(session_, registry_->BeginPush(h.name(), std::move(options)));
        return true;
      }
      case v1::PushCheckpointRequest::kTensor: {
        if (session_ == nullptr) return absl::InvalidArgumentError("a tensor before the header");
        WEIGHTSTORE_ASSIGN_OR_RETURN(PushedTensor t, FromProto(request.tensor(), session_->name()));
        WEIGHTSTORE_RETURN_IF_ERROR(
            t.patch ? session_->BeginPatchedTensor(t.spec, t.crc32c, *t.patch, t.patch_bytes, t.base_digest, t.digest)
                    : session_->BeginTensor(t.spec, t.crc32c));
        return true;
      }
      case v1::PushCheckpointRequest::kData:
        if (session_ == nullptr) return absl::InvalidArgumentError("data before the header");
        WEIGHTSTORE_RETURN_IF_ERROR(session_->Append(request.data()));
        return true;
      case v1::PushCheckpointRequest::kCommit: {
        if (session_ == nullptr) return absl::InvalidArgumentError("a commit before the header");
        if (request.commit().tensors() != session_->tensors()) {
          return absl::DataLossError(absl::StrCat("push to '", session_->name(), "': the commit says ",
                                                  request.commit().tensors(), " tensors, ", session_->tensors(),
                                                  " arrived; nothing was published"));
        }
        Committing();
        WEIGHTSTORE_ASSIGN_OR_RETURN(auto version, registry_->FinishPush(std::move(session_)));
        ToProto(*version, response_);
        End(grpc::Status::OK);
        return false;
      }
      default:
        return absl::InvalidArgumentError("a PushCheckpointRequest with no part");
    }
  }
  std::string Unfinished() const override {
    return absl::StrCat("the push", session_ == nullptr ? "" : absl::StrCat(" to '", session_->name(), "'"));
  }
  const char* Kept() const override { return "published"; }
  void Abandon() override { session_.reset(); }  // removes the staging file

  v1::CheckpointInfo* response_;
  std::unique_ptr<PushSession> session_;
};

}  // namespace

grpc::ServerReadReactor<v1::PutCheckpointRequest>* ReceivePut(const Serving& serving, grpc::CallbackServerContext* ctx,
                                                              v1::CheckpointInfo* response) {
  return new PutReactor(serving, response, ctx);
}

grpc::ServerReadReactor<v1::PushCheckpointRequest>* ReceivePush(const Serving& serving,
                                                                grpc::CallbackServerContext* ctx,
                                                                v1::CheckpointInfo* response) {
  return new PushReactor(serving, response, ctx);
}

}  // namespace weightstore::server
