#include "client/file_sink.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/formats/checkpoint_writer.h"
#include "core/status_macros.h"
#include "core/status_util.h"

namespace weightstore::client {

absl::StatusOr<std::unique_ptr<FileSink>> FileSink::Create(const std::string& path, const FormatSpec& format,
                                                           const std::vector<TensorSpec>& tensors,
                                                           const Metadata& metadata, bool overwrite) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(WritePlan plan, PlanCheckpoint(format, tensors, metadata));
  std::unique_ptr<FileSink> sink(new FileSink());
  WEIGHTSTORE_ASSIGN_OR_RETURN(sink->file_, AtomicFile::Create(path, overwrite));
  WEIGHTSTORE_RETURN_IF_ERROR(sink->file_->Resize(plan.file_size));
  sink->map_size_ = plan.file_size;
  void* map = ::mmap(nullptr, plan.file_size, PROT_READ | PROT_WRITE, MAP_SHARED, sink->file_->fd(), 0);
  if (map == MAP_FAILED) return StatusFromErrno(errno, absl::StrCat("cannot map '", path, "' for writing"));
  sink->map_ = static_cast<std::byte*>(map);
  std::memcpy(sink->map_, plan.header.data(), plan.header.size());
  if (!plan.after.empty() && plan.after.size() != plan.order.size()) {
    return absl::InternalError(absl::StrCat("the ", format.name, " plan has ", plan.after.size(),
                                            " strings to write after ", plan.order.size(), " tensors"));
  }
  for (size_t k = 0; k < plan.order.size(); ++k) {
    const TensorSpec& spec = tensors[plan.order[k]];
    sink->slots_.emplace(spec.name, Slot{spec, plan.offsets[k]});
    sink->total_ += spec.byte_size();
    // What the format puts between tensors (a Burn record's keys and heads),
    // which must end before the next tensor (or the file) begins.
    if (!plan.after.empty()) {
      const uint64_t at = plan.offsets[k] + spec.byte_size();
      const uint64_t limit = k + 1 < plan.order.size() ? plan.offsets[k + 1] : plan.file_size;
      if (at > limit || plan.after[k].size() > limit - at) {
        return absl::InternalError(
            absl::StrCat("the ", format.name, " plan overlaps itself after tensor '", spec.name, "'"));
      }
      std::memcpy(sink->map_ + at, plan.after[k].data(), plan.after[k].size());
    }
  }
  return sink;
}

FileSink::~FileSink() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

absl::StatusOr<std::span<std::byte>> FileSink::Begin(const TensorSpec& spec) {
  auto it = slots_.find(spec.name);
  if (it == slots_.end() || it->second.spec.dtype != spec.dtype || it->second.spec.shape != spec.shape) {
    return absl::DataLossError(absl::StrCat("tensor '", spec.name, "' (", DTypeName(spec.dtype), " ",
                                            ShapeToString(spec.shape),
                                            ") was not in the listing the file was planned from"));
  }
  return std::span<std::byte>(map_ + it->second.offset, spec.byte_size());
}

absl::Status FileSink::End(const TensorSpec& spec) {
  Slot& slot = slots_.at(spec.name);
  if (!slot.done) received_ += spec.byte_size();
  slot.done = true;
  if (progress_) progress_(received_, total_);
  return absl::OkStatus();
}

absl::Status FileSink::Finish() {
  for (const auto& [name, slot] : slots_) {
    if (!slot.done) return absl::FailedPreconditionError(absl::StrCat("tensor '", name, "' never arrived"));
  }
  if (::munmap(map_, map_size_) != 0) return StatusFromErrno(errno, "cannot unmap the output");
  map_ = nullptr;
  return file_->Commit();  // fsync covers what was written through the mapping
}

}  // namespace weightstore::client
