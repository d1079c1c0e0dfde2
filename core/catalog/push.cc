// PushSession, and CheckpointRegistry's BeginPush and FinishPush.
#include "core/catalog/push.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/catalog/registry.h"
#include "core/checked_math.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/mapped_file.h"
#include "core/status_macros.h"
#include "core/status_util.h"

namespace weightstore {
namespace fs = std::filesystem;

absl::Status PushSession::BeginTensor(const TensorSpec& spec, std::optional<uint32_t> crc32c) {
  if (current_) WEIGHTSTORE_RETURN_IF_ERROR(EndTensor());
  return StartTensor(spec, crc32c);
}

absl::Status PushSession::BeginPatchedTensor(const TensorSpec& spec, std::optional<uint32_t> crc32c,
                                             const ElementPatch& patch, uint64_t patch_bytes,
                                             const TensorDigest& base_digest, const TensorDigest& digest) {
  if (current_) WEIGHTSTORE_RETURN_IF_ERROR(EndTensor());
  const std::string where = absl::StrCat("push to '", name_, "': the patch of tensor '", spec.name.substr(0, 256), "'");
  const CheckpointEntry* before = base_->checkpoint()->Find(spec.name);
  if (before == nullptr || removed_.contains(spec.name)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a patch replaces a tensor of version ", base_->version(),
                                                   ", which has none by that name"));
  }
  const ManifestTensor* base = base_->manifest() != nullptr ? base_->manifest()->Find(spec.name) : nullptr;
  if (base == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": the daemon keeps no digests (--tensor-digests=false); push the tensor whole"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(StartTensor(spec, crc32c));  // dtype, shape and bounds, as a whole tensor's
  const uint32_t element_size = PatchElementSize(spec.dtype);
  auto refuse = [&](absl::Status status) {
    current_.reset();  // nothing of it was staged
    return status;
  };
  if (base->digest != base_digest) {
    return refuse(absl::AbortedError(absl::StrCat(where, " was made against bytes with digest ", base_digest.Hex(),
                                                  "; version ", base_->version(), " has ", base->digest.Hex())));
  }
  if (patch.element_size != element_size || patch.elements != spec.byte_size() / element_size ||
      patch.changed > patch.elements) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        where, " is for ", patch.elements, " elements of ", patch.element_size, " bytes, changing ", patch.changed,
        "; the tensor is ", spec.byte_size() / element_size, " elements of ", element_size)));
  }
  if (patch_bytes == 0 || patch_bytes >= spec.byte_size() || patch_bytes > max_patch_bytes_) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(where, " is ", patch_bytes,
                                                            " bytes; a patch is smaller than its tensor (",
                                                            spec.byte_size(), ") and at most ", max_patch_bytes_)));
  }
  Patch p{patch, {}, patch_bytes, digest};
  p.body.reserve(patch_bytes);
  patch_ = std::move(p);
  return absl::OkStatus();
}

absl::Status PushSession::StartTensor(const TensorSpec& spec, std::optional<uint32_t> crc32c) {
  patch_.reset();
  const std::string where = absl::StrCat("push to '", name_, "': tensor '", spec.name.substr(0, 256), "'");
  if (spec.name.empty() || spec.name.size() > max_name_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': a tensor name of ", spec.name.size(),
                                                   " bytes (1 to ", max_name_bytes_, ")"));
  }
  std::optional<uint64_t> numel = CheckedNumElements(spec.shape);
  if (spec.shape.size() > kMaxRank || !numel || !DTypeBytes(spec.dtype, *numel)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " has a shape whose byte size overflows or is not a whole number of bytes"));
  }
  if (by_name_.contains(spec.name)) return absl::InvalidArgumentError(absl::StrCat(where, " was pushed twice"));
  // A removed tensor pushed again is redefined: another dtype or shape.
  const bool redefined = removed_.contains(spec.name);
  if (redefined && !options_.allow_new_tensors) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " is also removed (redefining a tensor needs allow_new_tensors)"));
  }
  const CheckpointEntry* before = redefined ? nullptr : base_->checkpoint()->Find(spec.name);
  if (before == nullptr && !redefined) {
    if (!options_.allow_new_tensors) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is not in version ", base_->version(),
                                                     " (pushing new tensors needs allow_new_tensors)"));
    }
    // The new version's tensor count: the base's, less the removed, plus the new.
    if (base_->checkpoint()->size() - removed_.size() + new_tensors_ >= max_tensors_) {
      return absl::ResourceExhaustedError(
          absl::StrCat(where, ": the new version would have more than ", max_tensors_, " tensors"));
    }
    ++new_tensors_;
  }
  if (before != nullptr && (before->spec.dtype != spec.dtype || before->spec.shape != spec.shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " is ", DTypeName(spec.dtype), " ", ShapeToString(spec.shape), ", but ", DTypeName(before->spec.dtype),
        " ", ShapeToString(before->spec.shape), " in version ", base_->version()));
  }
  // Names count too: a push of many empty tensors still costs their names.
  const uint64_t cost = spec.byte_size() + spec.name.size();
  if (cost > max_bytes_ - bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": the push passes ", max_bytes_, " bytes"));
  }
  by_name_.emplace(spec.name, pushed_.size());
  pushed_.push_back({spec, staging_->bytes_written(), {}});
  current_.emplace(Current{pushed_.size() - 1, 0, 0, crc32c, DigestBuilder()});
  bytes_ += cost;
  return absl::OkStatus();
}

absl::Status PushSession::Append(absl::string_view data) {
  if (!current_) return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': data before a tensor"));
  const Pushed& t = pushed_[current_->index];
  if (patch_) {
    if (data.size() > patch_->patch_bytes - current_->received) {
      return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': the patch of tensor '", t.spec.name,
                                                     "' has ", patch_->patch_bytes, " bytes; more arrived"));
    }
    const auto* bytes = reinterpret_cast<const std::byte*>(data.data());
    patch_->body.insert(patch_->body.end(), bytes, bytes + data.size());
    current_->received += data.size();
    if (current_->expected_crc) current_->crc = Crc32cExtend(current_->crc, data);
    return absl::OkStatus();
  }
  if (data.size() > t.spec.byte_size() - current_->received) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': tensor '", t.spec.name, "' has ",
                                                   t.spec.byte_size(), " bytes; more arrived"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(staging_->Append(data));
  current_->received += data.size();
  if (current_->expected_crc) current_->crc = Crc32cExtend(current_->crc, data);
  current_->digest.Update(data);
  return absl::OkStatus();
}

absl::Status PushSession::EndTensor() {
  if (!current_) return absl::OkStatus();
  Pushed& t = pushed_[current_->index];
  if (patch_) return EndPatchedTensor(t);
  if (current_->received != t.spec.byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name_, "': tensor '", t.spec.name, "' ended after ",
                                                   current_->received, " of ", t.spec.byte_size(), " bytes"));
  }
  if (current_->expected_crc && current_->crc != *current_->expected_crc) {
    return absl::DataLossError(absl::StrCat("push to '", name_, "': tensor '", t.spec.name,
                                            "' failed its CRC32C check (the client sent ", *current_->expected_crc,
                                            ", the bytes make ", current_->crc, ")"));
  }
  t.digest = current_->digest.Finish();
  current_.reset();
  return absl::OkStatus();
}

absl::Status PushSession::EndPatchedTensor(Pushed& t) {
  Patch p = *std::exchange(patch_, std::nullopt);
  const std::string where = absl::StrCat("push to '", name_, "': the patch of tensor '", t.spec.name, "'");
  if (current_->received != p.patch_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " ended after ", current_->received, " of ", p.patch_bytes, " bytes"));
  }
  if (current_->expected_crc && current_->crc != *current_->expected_crc) {
    return absl::DataLossError(absl::StrCat(where, " failed its CRC32C check (the client sent ",
                                            *current_->expected_crc, ", the bytes make ", current_->crc, ")"));
  }
  p.header.body = SharedBytes::FromVector(std::move(p.body));
  if (absl::Status valid = CheckPatch(p.header); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", valid.message()));
  }
  const CheckpointEntry* entry = base_->checkpoint()->Find(t.spec.name);
  absl::StatusOr<SharedTensor> base = base_->checkpoint()->Read(*entry);
  if (!base.ok()) return absl::DataLossError(absl::StrCat(where, ": ", base.status().message()));
  // Pieces are as small as an element: gathered into pieces of about 1 MiB.
  std::string buffer;
  buffer.reserve(1 << 20);
  WEIGHTSTORE_RETURN_IF_ERROR(WritePatched(p.header, base->bytes.span(), [&](absl::string_view bytes) {
    if (buffer.size() + bytes.size() > (1 << 20)) {
      current_->digest.Update(buffer);
      buffer.clear();
    }
    if (bytes.size() >= (1 << 20)) {  // a long unchanged stretch goes as it is
      current_->digest.Update(bytes);
    } else {
      buffer.append(bytes.data(), bytes.size());
    }
    return absl::OkStatus();
  }));
  current_->digest.Update(buffer);
  t.digest = current_->digest.Finish();
  current_.reset();
  if (t.digest != p.expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " makes bytes with digest ", t.digest.Hex(), "; the client said ", p.expected.Hex()));
  }
  // Staged, so that a push holds one patch in memory at a time, however many
  // it sends.
  t.offset = staging_->bytes_written();
  t.patch_bytes = p.header.body.size();
  WEIGHTSTORE_RETURN_IF_ERROR(staging_->Append(p.header.body.view()));
  p.header.body = SharedBytes();
  t.patch = std::move(p.header);
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
  if (base->preloaded_bytes() > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("push to '", name, "': it is preloaded into memory (--preload); pushes rewrite files"));
  }
  // One file of a writable format, or the shards of a SafeTensors index, each
  // in the index's folder: a push rewrites the shards its tensors are in.
  const std::vector<std::shared_ptr<const MappedFile>>& files = checkpoint.files();
  const bool single = files.size() == 1 && files[0]->path() == base->path();
  const bool sharded = !single && !files.empty() && IndexFormatForPath(base->path()) == &checkpoint.format() &&
                       std::all_of(files.begin(), files.end(), [&](const auto& f) {
                         return fs::path(f->path()).parent_path() == fs::path(base->path()).parent_path();
                       });
  const bool writable =
      checkpoint.format().writable() && (single || sharded) &&
      std::all_of(files.begin(), files.end(), [&](const auto& f) { return CanWrite(checkpoint.format(), f->path()); });
  if (!writable) {
    return absl::FailedPreconditionError(absl::StrCat(
        "push to '", name, "': it is '", checkpoint.path(), "', ", single ? "a " : "a multi-file ",
        checkpoint.format().name, " checkpoint, and pushes write one file of a writable format and ending (",
        FormatExtensions(/*writable_only=*/true), "), or the shards of a SafeTensors index in its folder"));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = served_.find(name);
    if (it != served_.end() && it->second.outside_models) {
      return absl::FailedPreconditionError(
          absl::StrCat("push to '", name, "': it was loaded from outside the models folder"));
    }
  }
  {
    // The files are written where they lie: under the models folder, through
    // no symlink (which could lead out of it), and none a symlink itself.
    std::error_code ec;
    const fs::path models = fs::canonical(options_.models_dir, ec);
    const fs::path file = fs::absolute(base->path(), ec).lexically_normal();
    const fs::path relative = file.lexically_relative(fs::absolute(options_.models_dir, ec).lexically_normal());
    const fs::path real = fs::canonical(file, ec);
    bool symlink = fs::is_symlink(fs::symlink_status(file, ec));
    for (const auto& f : files) symlink = symlink || fs::is_symlink(fs::symlink_status(f->path(), ec));
    if (ec || relative.empty() || *relative.begin() == ".." || real != models / relative || symlink) {
      return absl::FailedPreconditionError(absl::StrCat(
          "push to '", name,
          "': its file is reached through a symlink; pushes rewrite only real files in the models folder"));
    }
  }
  if (sharded) {
    // Each shard keeps its tensors; the index is never rewritten. The
    // record of its renames names each shard on a line of its own, and a
    // shard another index also names would change that checkpoint too.
    for (const auto& f : files) {
      const std::string shard = fs::path(f->path()).filename().string();
      if (std::any_of(shard.begin(), shard.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; })) {
        return absl::FailedPreconditionError(
            absl::StrCat("push to '", name, "': its shard '", absl::CHexEscape(shard), "' has a control character"));
      }
    }
    std::error_code ec;
    const fs::path folder = fs::path(base->path()).parent_path();
    for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string other = it->path().string();
      if (other == base->path() || IndexFormatForPath(other) == nullptr) continue;
      const std::set<std::string> named = FilesOfIndex(other);
      for (const auto& f : files) {
        if (named.contains(f->path())) {
          return absl::FailedPreconditionError(absl::StrCat("push to '", name, "': its shard '", f->path(),
                                                            "' is also named by the index '", other, "'"));
        }
      }
    }
    if (!options.remove.empty() || options.allow_new_tensors) {
      return absl::FailedPreconditionError(
          absl::StrCat("push to '", name, "': it is sharded (", files.size(),
                       " files), and a push to it replaces tensors in their shards, with their dtype and shape; "
                       "it cannot add, remove or redefine tensors"));
    }
    if (options.metadata.has_value() && *options.metadata != checkpoint.metadata()) {
      return absl::FailedPreconditionError(
          absl::StrCat("push to '", name, "': it is sharded, and a push to it cannot change its index's metadata"));
    }
    // A follower's copy keeps its upstream's order, which the shards fix.
    if (options.expected.has_value()) {
      bool same_order = options.expected->size() == checkpoint.size();
      for (size_t i = 0; same_order && i < checkpoint.size(); ++i) {
        same_order = (*options.expected)[i].name == checkpoint.entries()[i].spec.name;
      }
      if (!same_order) {
        return absl::FailedPreconditionError(
            absl::StrCat("push to '", name,
                         "': it is sharded, and the version expected orders or places its tensors otherwise "
                         "(its index changed)"));
      }
    }
  }
  if (options.remove.size() > checkpoint.size()) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name, "' removes ", options.remove.size(),
                                                   " tensors; version ", base->version(), " has ", checkpoint.size()));
  }
  if (!options.version_id.empty() && !ValidVersionId(options.version_id)) {
    return absl::InvalidArgumentError(absl::StrCat("push to '", name, "': the version id '",
                                                   absl::CHexEscape(options.version_id.substr(0, 64)),
                                                   "' is not 1 to 64 bytes of [0-9A-Za-z._-]"));
  }
  if (options.expected.has_value()) {
    if (!options_.tensor_digests) {
      return absl::FailedPreconditionError(
          absl::StrCat("push to '", name, "': its tensors cannot be checked without digests (--tensor-digests)"));
    }
    if (options.expected->size() > options_.open.max_tensors) {
      return absl::InvalidArgumentError(absl::StrCat("push to '", name, "' expects ", options.expected->size(),
                                                     " tensors; a checkpoint has at most ", options_.open.max_tensors));
    }
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
  session->sharded_ = sharded;
  session->options_ = std::move(options);
  session->max_bytes_ = options_.max_put_bytes;
  session->max_patch_bytes_ = options_.max_push_patch_bytes;
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
  // A follower's push may change only the metadata, or only the id (the
  // upstream re-saved the same tensors, or its config beside them changed).
  const bool new_metadata =
      session->options_.metadata.has_value() && *session->options_.metadata != base.checkpoint()->metadata();
  const bool new_id = !session->options_.version_id.empty() && session->options_.version_id != base.version();
  if (session->pushed_.empty() && session->removed_.empty() && !new_metadata && !new_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("push to '", name, "' changes nothing: no tensor was pushed or removed"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(session->staging_->Flush());
  const int fd = ::fcntl(session->staging_->fd(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return StatusFromErrno(errno, absl::StrCat("cannot read '", session->staging_->temp_path(), "'"));
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> staged,
                               MappedFile::FromDescriptor(fd, session->staging_->temp_path()));
  // Read from here through `staged` alone: the temporary goes now, so that
  // no one sees it beside the version it becomes (listeners run before this
  // call returns).
  session->staging_.reset();

  // 1. The new files, written beside the base's without the scan lock
  //    (scans, loads and other checkpoints' pushes go on), under temporaries'
  //    names: the whole checkpoint, or the shards holding a pushed tensor.
  const Checkpoint& checkpoint = *base.checkpoint();
  std::vector<ManifestTensor> known;  // digests of what is written: the base's and the pushed
  // The patches pushed, their bodies read from the staging file: applied
  // below, and the step kept for clients of the base (no diff needed).
  absl::flat_hash_map<std::string, ElementPatch> patches;
  for (const PushSession::Pushed& p : session->pushed_) {
    if (!p.patch) continue;
    ElementPatch patch = *p.patch;
    patch.body = staged->bytes().Subspan(p.offset, p.patch_bytes);
    patches.emplace(p.spec.name, std::move(patch));
  }
  auto push_bytes = [&](const PushSession::Pushed& p) -> BytesProducer {
    known.push_back({p.spec.name, p.spec.dtype, p.spec.shape, p.digest});
    if (p.patch) {  // the base's bytes with the patch applied, one tensor at a time
      std::shared_ptr<const Checkpoint> source = base.checkpoint();
      const CheckpointEntry* e = source->Find(p.spec.name);
      const ElementPatch* patch = &patches.at(p.spec.name);
      const TensorDigest digest = p.digest;
      return [source, e, patch, digest]() -> absl::StatusOr<SharedBytes> {
        WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, source->Read(*e));
        std::vector<std::byte> bytes(t.bytes.data(), t.bytes.data() + t.bytes.size());
        WEIGHTSTORE_RETURN_IF_ERROR(ApplyPatch(*patch, bytes));
        // The digest published is of these bytes, even should the base have
        // changed since the patch was checked against it.
        if (DigestBytes(bytes) != digest) {
          return absl::AbortedError("the base changed while the push was sent; nothing was published");
        }
        return SharedBytes::FromVector(std::move(bytes));
      };
    }
    SharedBytes bytes = staged->bytes().Subspan(p.offset, p.spec.byte_size());
    return [bytes] { return absl::StatusOr<SharedBytes>(bytes); };
  };
  if (const auto& expected = session->options_.expected; expected.has_value()) {
    // Nothing is written that the version expected lacks (CheckExpected
    // then finds what it has that was not written).
    absl::flat_hash_set<absl::string_view> wanted;
    for (const ManifestTensor& t : *expected) wanted.insert(t.name);
    auto unwanted = [&](const std::string& tensor) {
      return absl::DataLossError(absl::StrCat("push to '", name, "' wrote tensor '", tensor.substr(0, 256),
                                              "', which the version expected does not have; nothing was published"));
    };
    for (const PushSession::Pushed& p : session->pushed_) {
      if (!wanted.contains(p.spec.name)) return unwanted(p.spec.name);
    }
    for (const CheckpointEntry& entry : checkpoint.entries()) {
      if (!wanted.contains(entry.spec.name) && !session->removed_.contains(entry.spec.name)) {
        return unwanted(entry.spec.name);
      }
    }
  }
  // One tensor of the new version, written by `writer`: pushed (replaced,
  // redefined or new), or the base's unchanged. With `clone_source` (the
  // writer may copy the base's file the new one replaces), an unchanged one
  // is given as its view of the file, so the copy need not write it.
  auto add = [&](CheckpointWriter& writer, const std::string& tensor, bool clone_source) -> absl::Status {
    if (auto p = session->by_name_.find(tensor); p != session->by_name_.end()) {
      const PushSession::Pushed& pushed = session->pushed_[p->second];
      return writer.Add(pushed.spec, push_bytes(pushed));
    }
    const CheckpointEntry* e = checkpoint.Find(tensor);
    if (e == nullptr || session->removed_.contains(tensor)) return absl::OkStatus();
    if (base.manifest() != nullptr) known.push_back(*base.manifest()->Find(tensor));
    std::shared_ptr<const Checkpoint> source = base.checkpoint();
    BytesProducer bytes = [source, e]() -> absl::StatusOr<SharedBytes> {
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, source->Read(*e));
      return std::move(t.bytes);
    };
    // Only a view of the file, read without producing anything: a tensor
    // stored contiguously and as served.
    if (clone_source && e->layout.strides.empty() && !e->layout.normalize_bool && e->layout.storage->ready()) {
      absl::StatusOr<SharedTensor> view = source->Read(*e);
      if (view.ok()) return writer.AddUnchanged(e->spec, std::move(view->bytes));
    }
    return writer.Add(e->spec, std::move(bytes));
  };
  struct Planned {
    std::unique_ptr<CheckpointWriter> writer;
    std::string path, replaces;
  };
  std::vector<Planned> planned;
  if (!session->sharded_) {
    Planned file{nullptr, NewFilePathBeside(base.path()), base.path()};
    // A follower's copy keeps its upstream's order (PushOptions::expected), so
    // that contiguous index ranges select the same tensors on both.
    WEIGHTSTORE_ASSIGN_OR_RETURN(file.writer,
                                 CheckpointWriter::Create(file.path, checkpoint.format(),
                                                          {.keep_order = session->options_.expected.has_value()}));
    file.writer->SetMetadata(session->options_.metadata.value_or(checkpoint.metadata()));
    const bool clone_source = checkpoint.files().size() == 1;
    if (clone_source) file.writer->SetCloneSource(checkpoint.files()[0]);
    if (const auto& expected = session->options_.expected; expected.has_value()) {
      // In the upstream's order; what it lacks is found by CheckExpected.
      absl::flat_hash_set<absl::string_view> written;
      for (const ManifestTensor& t : *expected) {
        if (!written.insert(t.name).second) {
          return absl::DataLossError(absl::StrCat("push to '", name, "' expects tensor '", t.name.substr(0, 256),
                                                  "' twice; nothing was published"));
        }
        WEIGHTSTORE_RETURN_IF_ERROR(add(*file.writer, t.name, clone_source));
      }
    } else {
      // The base's order, with new tensors last, in push order.
      for (const CheckpointEntry& entry : checkpoint.entries()) {
        WEIGHTSTORE_RETURN_IF_ERROR(add(*file.writer, entry.spec.name, clone_source));
      }
      for (const PushSession::Pushed& p : session->pushed_) {
        if (checkpoint.Find(p.spec.name) == nullptr) {
          WEIGHTSTORE_RETURN_IF_ERROR(file.writer->Add(p.spec, push_bytes(p)));
        }
      }
    }
    planned.push_back(std::move(file));
  } else {
    // Each shard holding a pushed tensor is written whole, in its own order
    // and with its own metadata; the others, and the index, stay as they are.
    // (A sharded push neither adds nor removes tensors: BeginPush.)
    for (const std::shared_ptr<const MappedFile>& shard : checkpoint.files()) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> held,
                                   checkpoint.format().open(shard, options_.open));
      const bool pushed_to = std::any_of(held->entries().begin(), held->entries().end(), [&](const CheckpointEntry& e) {
        return session->by_name_.contains(e.spec.name);
      });
      if (!pushed_to) {
        for (const CheckpointEntry& e : held->entries()) {
          if (base.manifest() != nullptr) known.push_back(*base.manifest()->Find(e.spec.name));
        }
        continue;
      }
      Planned file{nullptr, NewFilePathBeside(shard->path()), shard->path()};
      WEIGHTSTORE_ASSIGN_OR_RETURN(file.writer,
                                   CheckpointWriter::Create(file.path, checkpoint.format(), {.keep_order = true}));
      file.writer->SetMetadata(held->metadata());
      file.writer->SetCloneSource(shard);
      for (const CheckpointEntry& e : held->entries()) {
        WEIGHTSTORE_RETURN_IF_ERROR(add(*file.writer, e.spec.name, true));
      }
      planned.push_back(std::move(file));
    }
  }
  uint64_t new_bytes = 0;
  for (const Planned& file : planned) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(WritePlan plan, file.writer->Plan());
    new_bytes = CheckedAdd(new_bytes, plan.file_size).value_or(UINT64_MAX);
  }
  struct statvfs disk;
  if (::statvfs(fs::path(base.path()).parent_path().c_str(), &disk) == 0 &&
      static_cast<uint64_t>(disk.f_bavail) * disk.f_frsize < new_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("push to '", name, "': its new files need ", new_bytes,
                                                     " bytes; their disk has ",
                                                     static_cast<uint64_t>(disk.f_bavail) * disk.f_frsize));
  }
  // From here each file written is removed unless it is put in place. A
  // shared lock keeps a rescan from taking one for an abandoned temporary.
  struct Written {
    std::vector<NewFile> files;
    size_t renamed = 0;  // the first ones, put in place
    ~Written() {
      for (size_t i = 0; i < files.size(); ++i) {
        if (i >= renamed) ::unlink(files[i].path.c_str());
        if (files[i].fd >= 0) ::close(files[i].fd);
      }
    }
  } written;
  for (Planned& file : planned) {
    WEIGHTSTORE_RETURN_IF_ERROR(file.writer->Finish());
    switch (file.writer->clone_result()) {
      case AtomicFile::CloneResult::kCloned:
        files_cloned_.fetch_add(1, std::memory_order_relaxed);
        break;
      case AtomicFile::CloneResult::kCopied:
        files_copied_.fetch_add(1, std::memory_order_relaxed);
        break;
      case AtomicFile::CloneResult::kUnsupported:
        files_whole_.fetch_add(1, std::memory_order_relaxed);
        break;
    }
    written.files.push_back({file.path, -1, file.replaces});
    NewFile& f = written.files.back();
    f.fd = ::open(f.path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (f.fd < 0 || ::flock(f.fd, LOCK_SH) != 0) {
      return StatusFromErrno(errno, absl::StrCat("cannot open '", f.path, "'"));
    }
  }
  return PublishOver(base,
                     {written.files, session->options_.version_id, session->options_.expected, std::move(known),
                      &patches, absl::StrCat("push to '", name, "'")},
                     &written.renamed);
}

}  // namespace weightstore
