#include "server/stored_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/catalog/registry.h"
#include "core/crc32c.h"
#include "core/shm/unix_socket.h"
#include "core/status_macros.h"
#include "proto/codec/chunk_codec.h"
#include "server/observability.h"

namespace weightstore::server {

namespace {

constexpr uint64_t kFileChunkBytes = uint64_t{1} << 20;

// `length` bytes of `file` from `offset`: a view of the version's mapping, or,
// for an index, read from the file by path after checking that the version's
// files are those it opened. A caller vouching for mapped bytes (a checksum)
// checks version.CheckUnchanged() after reading them: a file truncated under
// the mapping reads as zeros (the SIGBUS guard).
absl::StatusOr<SharedBytes> StoredBytes(const CheckpointVersion& version, const StoredFile& file, uint64_t offset,
                                        uint64_t length) {
  if (offset > file.size || length > file.size - offset) {
    return absl::OutOfRangeError(absl::StrCat("read past the end of '", file.path, "'"));
  }
  if (file.mapped != nullptr) return file.mapped->bytes().Subspan(offset, length);
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::string now, FileVersion(version.path()));
  if (now != version.file_version()) {
    return absl::AbortedError(absl::StrCat("checkpoint '", version.name(), "' was replaced on disk; list it again"));
  }
  UniqueFd fd(::open(file.local_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return absl::NotFoundError(absl::StrCat("cannot open '", file.path, "': ", std::strerror(errno)));
  std::vector<std::byte> out(length);
  for (uint64_t done = 0; done < length;) {
    const ssize_t n = ::pread(fd.get(), out.data() + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::DataLossError(absl::StrCat("'", file.path, "' is shorter than when it was listed"));
    done += static_cast<uint64_t>(n);
  }
  // An index renamed over meanwhile (a follower's step) may have been read.
  WEIGHTSTORE_ASSIGN_OR_RETURN(now, FileVersion(version.path()));
  if (now != version.file_version()) {
    return absl::AbortedError(absl::StrCat("checkpoint '", version.name(), "' was replaced on disk; list it again"));
  }
  return SharedBytes::FromVector(std::move(out));
}

// A file beside (a config) may change while the version stays: its key
// names the bytes on disk too (device, inode, size, times), so a CRC is taken
// once per content, and a listing finds it known only for those bytes.
std::string StoredCrcKey(const StoredFile& file) {
  if (!file.beside) return absl::StrCat("stored-file:", file.path);
  return absl::StrCat("stored-file:", file.path, "@", FileVersion(file.local_path).value_or("gone"));
}

absl::StatusOr<uint32_t> StoredCrc(const CheckpointVersion& version, const StoredFile& file,
                                   const std::function<bool()>& cancelled) {
  return version.checksums().FindOrCompute(
      StoredCrcKey(file),
      [&]() -> absl::StatusOr<uint32_t> {
        uint32_t crc = 0;
        constexpr uint64_t kBlock = uint64_t{8} << 20;
        for (uint64_t offset = 0; offset < file.size; offset += kBlock) {
          if (cancelled && cancelled()) {
            return absl::CancelledError(absl::StrCat("the checksum of '", file.path, "' was cancelled"));
          }
          WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes bytes,
                                       StoredBytes(version, file, offset, std::min(kBlock, file.size - offset)));
          crc = Crc32cExtend(crc, bytes.view());
        }
        return crc;  // kept only if the version is unchanged (ChecksumCache::Store)
      },
      cancelled);
}

}  // namespace

absl::Status DescribeStoredFiles(const CheckpointVersion& version, v1::ListCheckpointFilesResponse* out,
                                 const std::function<bool()>& cancelled) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<StoredFile> files, StoredFiles(version));
  out->set_version(version.version());
  out->set_apart(NameForPath(version.relative_path()) != version.name());
  for (const StoredFile& f : files) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(uint32_t crc, StoredCrc(version, f, cancelled));
    v1::StoredFile* s = out->add_files();
    s->set_path(f.path);
    s->set_main(f.main);
    s->set_beside(f.beside);
    s->set_size(f.size);
    s->set_crc32c(absl::StrFormat("%08x", crc));
    s->set_etag(version.file_version());
  }
  return absl::OkStatus();
}

bool StoredCrcsKnown(const CheckpointVersion& version) {
  absl::StatusOr<std::vector<StoredFile>> files = StoredFiles(version);
  if (!files.ok()) return true;  // its error is quick to report
  return std::all_of(files->begin(), files->end(),
                     [&](const StoredFile& f) { return version.checksums().Find(StoredCrcKey(f)).has_value(); });
}

namespace {

// Streams one ReadCheckpointFile response, one chunk in flight at a time,
// admitted and watched as fetch streams are. A mapped file's bytes go
// out as slices of its mapping, as FetchTensors sends tensors.
class FileReadReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FileReadReactor(const Serving& serving, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw)
      : serving_(serving), ctx_(ctx) {
    v1::ReadCheckpointFileRequest request;
    absl::Status status = wire::ParseMessage(*raw, &request)
                              ? Start(ctx, request)
                              : absl::InvalidArgumentError("request is not a ReadCheckpointFileRequest");
    if (!status.ok()) {
      Done(serving_.client_status(status));
      return;
    }
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    sent_bytes_ += last_write_bytes_;
    watch_.Progress(last_write_bytes_);
    Next();
  }
  void OnCancel() override { cancelled_ = true; }
  void OnDone() override { delete this; }  // the slot goes with its ticket

 private:
  absl::Status Start(grpc::CallbackServerContext* ctx, const v1::ReadCheckpointFileRequest& request) {
    if (absl::Status s = serving_.admit(*ctx, Scope::kRead); !s.ok()) return s;
    Annotate(ctx, request.name());
    if (request.version().empty()) {
      return absl::InvalidArgumentError("version is required: take it from ListCheckpointFiles");
    }
    WEIGHTSTORE_ASSIGN_OR_RETURN(slot_, serving_.streams->Admit(ctx->peer()));
    watch_ = serving_.stalls->Watch(ctx->peer(), *serving_.stream_limits, [ctx] { ctx->TryCancel(); });
    WEIGHTSTORE_ASSIGN_OR_RETURN(version_, serving_.registry->Find(request.name(), request.version()));
    if (!request.etag().empty() && request.etag() != version_->file_version()) {
      return absl::AbortedError(absl::StrCat("checkpoint '", request.name(), "': its files were replaced since they ",
                                             "were listed (version ", version_->version(),
                                             " names the same content in other bytes); list them again"));
    }
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<StoredFile> files, StoredFiles(*version_));
    for (StoredFile& f : files) {
      if (f.path == request.path()) file_ = std::move(f);
    }
    if (file_.local_path.empty()) {
      return absl::NotFoundError(absl::StrCat("checkpoint '", request.name(), "' has no stored file '",
                                              absl::CHexEscape(request.path().substr(0, 256)), "'"));
    }
    if (request.offset() > file_.size) {
      return absl::OutOfRangeError(
          absl::StrCat("offset ", request.offset(), " is past the end of '", file_.path, "' (", file_.size, " bytes)"));
    }
    cursor_ = request.offset();
    const uint64_t left = file_.size - cursor_;
    end_ = cursor_ + (request.length() == 0 ? left : std::min(request.length(), left));
    if (request.length() > left) {
      return absl::OutOfRangeError(absl::StrCat("offset ", request.offset(), " + length ", request.length(),
                                                " is past the end of '", file_.path, "' (", file_.size, " bytes)"));
    }
    return absl::OkStatus();
  }

  void Next() {
    if (cancelled_) {
      Done(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      return;
    }
    if (cursor_ >= end_) {
      Done(grpc::Status::OK);
      return;
    }
    const uint64_t n = std::min(kFileChunkBytes, end_ - cursor_);
    absl::StatusOr<SharedBytes> bytes = StoredBytes(*version_, file_, cursor_, n);
    v1::CheckpointFileChunk header;
    if (bytes.ok()) header.set_crc32c(Crc32c(bytes->view()));
    absl::Status status = bytes.ok() ? version_->CheckUnchanged() : bytes.status();
    if (!status.ok()) {
      Done(serving_.client_status(status));
      return;
    }
    header.set_offset(cursor_);
    buffer_ = wire::EncodeWithPayload(header, v1::CheckpointFileChunk::kDataFieldNumber, *bytes);
    last_write_bytes_ = n;
    cursor_ += n;
    StartWrite(&buffer_);
  }

  // Finishes, telling the request log and the metrics how many file bytes
  // were sent, with the slot freed before the client can see the status.
  void Done(const grpc::Status& status) {
    ctx_->AddTrailingMetadata(kBytesTrailer, std::to_string(sent_bytes_));
    watch_.Unwatch();
    slot_.Release();
    Finish(status);
  }

  const Serving& serving_;
  grpc::CallbackServerContext* ctx_;
  uint64_t sent_bytes_ = 0;
  GateTicket slot_;
  StallWatchdog::Watched watch_;
  std::shared_ptr<const CheckpointVersion> version_;
  StoredFile file_;
  uint64_t cursor_ = 0, end_ = 0;
  grpc::ByteBuffer buffer_;
  uint64_t last_write_bytes_ = 0;
  std::atomic<bool> cancelled_{false};
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* ReadStoredFile(const Serving& serving, grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* request) {
  return new FileReadReactor(serving, ctx, request);
}

}  // namespace weightstore::server
