// PushSession, and CheckpointRegistry's BeginPush and FinishPush.
#include "core/push.h"

#include <fcntl.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/mapped_file.h"
#include "core/registry.h"
#include "core/status_macros.h"
#include "core/status_util.h"

namespace weightstore {

absl::Status PushSession::BeginTensor(const TensorSpec& spec, uint32_t crc32c) {
  if (current_) WEIGHTSTORE_RETURN_IF_ERROR(EndTensor());
  const std::string where = absl::StrCat("push to '", name_, "': tensor '", spec.name.substr(0, 256), "'");
  if (spec.name.empty() || spec.name.size() > max_name_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': a tensor name of ", spec.name.size(),
                                                   " bytes (1 to ", max_name_bytes_, ")"));
  }
  std::optional<uint64_t> numel = CheckedNumElements(spec.shape);
  if (spec.shape.size() > kMaxRank || !numel || !CheckedMul(*numel, DTypeSize(spec.dtype))) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has a shape whose byte size overflows"));
  }
  if (pushed_.size() >= max_tensors_) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": more than ", max_tensors_, " tensors pushed"));
  }
  if (by_name_.contains(spec.name)) return absl::InvalidArgumentError(absl::StrCat(where, " was pushed twice"));
  if (removed_.contains(spec.name)) return absl::InvalidArgumentError(absl::StrCat(where, " is also removed"));
  const CheckpointEntry* before = base_->checkpoint()->Find(spec.name);
  if (before == nullptr && !options_.allow_new_tensors) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " is not in version ", base_->version(), " (pushing new tensors needs allow_new_tensors)"));
  }
  if (before != nullptr && (before->spec.dtype != spec.dtype || before->spec.shape != spec.shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " is ", DTypeName(spec.dtype), " ", ShapeToString(spec.shape), ", but ", DTypeName(before->spec.dtype),
        " ", ShapeToString(before->spec.shape), " in version ", base_->version()));
  }
  if (spec.byte_size() > max_bytes_ - bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": the push passes ", max_bytes_, " bytes"));
  }
  by_name_.emplace(spec.name, pushed_.size());
  pushed_.push_back({spec, staging_->bytes_written(), {}});
  current_.emplace();
  current_->index = pushed_.size() - 1;
  current_->expected_crc = crc32c;
  bytes_ += spec.byte_size();
  return absl::OkStatus();
}

absl::Status PushSession::Append(absl::string_view data) {
  if (!current_) return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': data before a tensor"));
  const Pushed& t = pushed_[current_->index];
  if (data.size() > t.spec.byte_size() - current_->received) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': tensor '", t.spec.name, "' has ",
                                                   t.spec.byte_size(), " bytes; more arrived"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(staging_->Append(data));
  current_->received += data.size();
  current_->crc = Crc32cExtend(current_->crc, data);
  current_->digest.Update(data);
  return absl::OkStatus();
}

absl::Status PushSession::EndTensor() {
  if (!current_) return absl::OkStatus();
  Pushed& t = pushed_[current_->index];
  if (current_->received != t.spec.byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': tensor '", t.spec.name, "' ended after ",
                                                   current_->received, " of ", t.spec.byte_size(), " bytes"));
  }
  if (current_->crc != current_->expected_crc) {
    return absl::DataLossError(absl::StrCat("push to '", name_, "': tensor '", t.spec.name,
                                            "' failed its CRC32C check (the client sent ", current_->expected_crc,
                                            ", the bytes make ", current_->crc, ")"));
  }
  t.digest = current_->digest.Finish();
  current_.reset();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PushSession>> CheckpointRegistry::BeginPush(const std::string& name,
                                                                           PushOptions options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const CheckpointVersion> base, Find(name));
  if (options.base_version != base->version()) {
    return absl::AbortedError(absl::StrCat("push to '", name, "': its base version '",
                                           options.base_version.substr(0, 64), "' is not the current one, ",
                                           base->version()));
  }
  const Checkpoint& checkpoint = *base->checkpoint();
  if (!checkpoint.format().writable() || checkpoint.files().size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "push to '", name, "': it is ", checkpoint.files().size() == 1 ? "" : "a multi-file ", checkpoint.format().name,
        ", and pushes write one file of a writable format (", FormatNames(/*writable_only=*/true), ")"));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = served_.find(name);
    if (it != served_.end() && it->second.pinned) {
      return absl::FailedPreconditionError(
          absl::StrCat("push to '", name, "': it was loaded from outside the models folder"));
    }
  }
  if (options.remove.size() > checkpoint.size()) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name, "' removes ", options.remove.size(),
                                                   " tensors; version ", base->version(), " has ", checkpoint.size()));
  }
  auto session = std::make_unique<PushSession>();
  for (const std::string& r : options.remove) {
    if (checkpoint.Find(r) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("push to '", name, "' removes tensor '", r.substr(0, 256),
                                                     "', which version ", base->version(), " does not have"));
    }
    session->removed_.insert(r);
  }
  session->name_ = name;
  session->base_ = base;
  session->options_ = std::move(options);
  session->max_bytes_ = options_.max_put_bytes;
  session->max_tensors_ = options_.open.max_tensors;
  session->max_name_bytes_ = options_.open.max_name_bytes;
  // Beside the checkpoint, so the final write reads it from the same disk.
  WEIGHTSTORE_ASSIGN_OR_RETURN(session->staging_, AtomicFile::Create(base->path() + ".push", /*overwrite=*/true));
  return session;
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::FinishPush(
    std::unique_ptr<PushSession> session) {
  WEIGHTSTORE_RETURN_IF_ERROR(session->EndTensor());
  const std::string& name = session->name_;
  const CheckpointVersion& base = *session->base_;
  // One at a time with scans and loads: the base must still be current when
  // the new version replaces it.
  NotifyOnExit notify(this);
  absl::MutexLock scan_lock(&scan_mu_);
  std::shared_ptr<const CheckpointVersion> current = Get(name);
  if (current == nullptr || current->version() != base.version()) {
    return absl::AbortedError(absl::StrCat("push to '", name, "': version ", base.version(),
                                           " was replaced while the push was sent; nothing was published"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(session->staging_->Flush());
  const int fd = ::fcntl(session->staging_->fd(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return StatusFromErrno(errno, absl::StrCat("cannot read '", session->staging_->temp_path(), "'"));
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> staged,
                               MappedFile::FromDescriptor(fd, session->staging_->temp_path()));
  const Checkpoint& checkpoint = *base.checkpoint();
  // The unchanged tensors are read from the base while the file is written:
  // it must still be as opened once they all are, before the file replaces it
  // (after, the replaced file's link count, and so its ctime, has changed).
  WEIGHTSTORE_ASSIGN_OR_RETURN(
      auto writer, CheckpointWriter::Create(base.path(), checkpoint.format(), {.overwrite = true, .before_commit = [&] {
                                                                                 return base.CheckUnchanged();
                                                                               }}));
  writer->SetMetadata(checkpoint.metadata());
  // The known digests of what is written: the base's, and the pushed ones.
  std::vector<ManifestTensor> known;
  auto push_bytes = [&](const PushSession::Pushed& p) -> BytesProducer {
    known.push_back({p.spec.name, p.spec.dtype, p.spec.shape, p.digest});
    SharedBytes bytes = staged->bytes().Subspan(p.offset, p.spec.byte_size());
    return [bytes] { return absl::StatusOr<SharedBytes>(bytes); };
  };
  for (const CheckpointEntry& entry : checkpoint.entries()) {
    if (session->removed_.contains(entry.spec.name)) continue;
    TensorSpec spec = entry.spec;
    if (auto p = session->by_name_.find(spec.name); p != session->by_name_.end()) {
      WEIGHTSTORE_RETURN_IF_ERROR(writer->Add(std::move(spec), push_bytes(session->pushed_[p->second])));
      continue;
    }
    if (base.manifest() != nullptr) known.push_back(*base.manifest()->Find(spec.name));
    std::shared_ptr<const Checkpoint> source = base.checkpoint();
    const CheckpointEntry* e = &entry;
    WEIGHTSTORE_RETURN_IF_ERROR(writer->Add(std::move(spec), [source, e]() -> absl::StatusOr<SharedBytes> {
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, source->Read(*e));
      return std::move(t.bytes);
    }));
  }
  for (const PushSession::Pushed& p : session->pushed_) {
    if (checkpoint.Find(p.spec.name) == nullptr) WEIGHTSTORE_RETURN_IF_ERROR(writer->Add(p.spec, push_bytes(p)));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(writer->Finish());
  const CheckpointManifest known_manifest("", std::move(known));
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto version, OpenVersion(name, base.path(), current.get(), &known_manifest));
  {
    absl::MutexLock lock(&mu_);
    (void)Watch(name, *version);  // best effort: the synchronous checks remain
    Published(name, version.get());
    served_[name].current = version;
  }
  notify.Add(name);
  return version;
}

}  // namespace weightstore
