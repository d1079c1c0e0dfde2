#include "core/formats/checkpoint_writer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/atomic_file.h"
#include "core/status_macros.h"
#include "core/status_util.h"

namespace weightstore {

absl::StatusOr<WritePlan> PlanCheckpoint(const FormatSpec& format, const std::vector<TensorSpec>& specs,
                                         const Metadata& metadata) {
  if (!format.writable()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", format.name, " files (writable: ", FormatNames(/*writable_only=*/true), ")"));
  }
  return format.plan(specs, metadata);
}

namespace {

// Maps in the pages behind `bytes` with one madvise call (Linux 5.14+; a no-op
// elsewhere, where write() faults them in as before).
void PopulateForRead(absl::string_view bytes) {
#ifdef MADV_POPULATE_READ
  constexpr int kPopulateRead = MADV_POPULATE_READ;
#else
  constexpr int kPopulateRead = 22;
#endif
  if (bytes.size() < (64 << 10)) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size();
  ::madvise(reinterpret_cast<void*>(begin), end - begin, kPopulateRead);
}

// Runs `producer` for `spec`: its error, or bytes of another size, name the
// tensor.
absl::StatusOr<SharedBytes> Produce(const TensorSpec& spec, const BytesProducer& producer) {
  absl::StatusOr<SharedBytes> bytes = producer();
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(), absl::StrCat("tensor '", spec.name, "': ", bytes.status().message()));
  }
  if (bytes->size() != spec.byte_size()) {
    return absl::InternalError(
        absl::StrCat("tensor '", spec.name, "' produced ", bytes->size(), " bytes, expected ", spec.byte_size()));
  }
  return bytes;
}

// Calls write(offset, window) over `bytes` in 8 MiB windows, each populated
// in one call first: faulting a mapping in page by page inside write() is
// the slow part of a copy.
template <typename Write>
absl::Status ForEachWindow(absl::string_view bytes, Write write) {
  constexpr size_t kWindow = 8 << 20;
  for (size_t off = 0; off < bytes.size(); off += kWindow) {
    const absl::string_view window = bytes.substr(off, kWindow);
    PopulateForRead(window);
    WEIGHTSTORE_RETURN_IF_ERROR(write(off, window));
  }
  return absl::OkStatus();
}

// Streams the plan to `sink`, producing each tensor's bytes once, in file order.
template <typename Sink>
absl::Status WritePlanned(const WritePlan& plan, const std::vector<TensorSpec>& specs,
                          const std::vector<BytesProducer>& producers, const WriteOptions& options, Sink& sink) {
  if (!plan.after.empty() && plan.after.size() != plan.order.size()) {
    return absl::InternalError(
        absl::StrCat("the write plan has ", plan.after.size(), " `after` strings for ", plan.order.size(), " tensors"));
  }
  // A plan that overlaps itself would make a gap wrap around to 2^64 zeros.
  auto gap = [](uint64_t pos, uint64_t next) -> absl::StatusOr<uint64_t> {
    if (next < pos) return absl::InternalError(absl::StrCat("the write plan overlaps itself at offset ", next));
    return next - pos;
  };
  WEIGHTSTORE_RETURN_IF_ERROR(sink.Append(plan.header));
  uint64_t pos = plan.header.size();
  for (size_t k = 0; k < plan.order.size(); ++k) {
    const size_t i = plan.order[k];
    const TensorSpec& spec = specs[i];
    WEIGHTSTORE_ASSIGN_OR_RETURN(const uint64_t zeros, gap(pos, plan.offsets[k]));
    WEIGHTSTORE_RETURN_IF_ERROR(sink.AppendZeros(zeros));
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes bytes, Produce(spec, producers[i]));
    WEIGHTSTORE_RETURN_IF_ERROR(
        ForEachWindow(bytes.view(), [&](uint64_t, absl::string_view window) { return sink.Append(window); }));
    pos = plan.offsets[k] + spec.byte_size();
    if (!plan.after.empty()) {
      WEIGHTSTORE_RETURN_IF_ERROR(sink.Append(plan.after[k]));
      pos += plan.after[k].size();
    }
    if (options.progress) options.progress(pos, plan.file_size);
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(const uint64_t zeros, gap(pos, plan.file_size));
  return sink.AppendZeros(zeros);
}

struct StringSink {
  std::string out;
  absl::Status Append(absl::string_view data) {
    out.append(data.data(), data.size());
    return absl::OkStatus();
  }
  absl::Status AppendZeros(uint64_t n) {
    out.append(n, '\0');
    return absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Create(std::string path, const FormatSpec& format,
                                                                           WriteOptions options) {
  if (!format.writable()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", format.name, " files (writable: ", FormatNames(/*writable_only=*/true), ")"));
  }
  std::unique_ptr<CheckpointWriter> writer(new CheckpointWriter());
  writer->path_ = std::move(path);
  writer->format_ = &format;
  writer->options_ = std::move(options);
  return writer;
}

absl::Status CheckpointWriter::Add(TensorSpec spec, BytesProducer bytes) {
  if (spec.name.empty()) return absl::InvalidArgumentError("a tensor has an empty name");
  if (!names_.insert(spec.name).second) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", spec.name, "'"));
  }
  specs_.push_back(std::move(spec));
  producers_.push_back(std::move(bytes));
  return absl::OkStatus();
}

absl::StatusOr<WritePlan> CheckpointWriter::Plan() const {
  if (options_.plan) return options_.plan(specs_, metadata_);
  if (options_.keep_order && format_->plan_in_order != nullptr) return format_->plan_in_order(specs_, metadata_);
  return PlanCheckpoint(*format_, specs_, metadata_);
}

absl::Status CheckpointWriter::Finish() {
  WEIGHTSTORE_ASSIGN_OR_RETURN(WritePlan plan, Plan());
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file, AtomicFile::Create(path_, options_.overwrite));
  clone_result_ = AtomicFile::CloneResult::kUnsupported;
  // Shared extents cost nothing, so half the bytes kept is enough; a copy in
  // the kernel writes the file and then the changed tensors again.
  if (const Kept k = PlanClonesSource(plan); k.kept > 0 && k.kept >= k.written) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(clone_result_, file->CloneFrom(clone_source_->fd(), clone_source_->size(),
                                                                /*copy=*/k.kept / 9 >= k.written));
    if (clone_result_ != AtomicFile::CloneResult::kUnsupported) {
      WEIGHTSTORE_RETURN_IF_ERROR(WriteOverClone(plan, *file));
      return file->Commit();
    }
  }
  WEIGHTSTORE_RETURN_IF_ERROR(WritePlanned(plan, specs_, producers_, options_, *file));
  return file->Commit();
}

absl::Status CheckpointWriter::AddUnchanged(TensorSpec spec, SharedBytes view) {
  uint64_t at = 0;
  const bool in_source = clone_source_ != nullptr && clone_source_->Contains(view, &at);
  WEIGHTSTORE_RETURN_IF_ERROR(Add(std::move(spec), [view]() -> absl::StatusOr<SharedBytes> { return view; }));
  unchanged_at_.resize(specs_.size());
  if (in_source) unchanged_at_.back() = clone_source_->offset() + at;
  return absl::OkStatus();
}

CheckpointWriter::Kept CheckpointWriter::PlanClonesSource(const WritePlan& plan) const {
  // A file read into memory (a small one) is checked here but copied from
  // disk: only a mapping is the file's own bytes.
  if (clone_source_ == nullptr || !clone_source_->is_mapped() || clone_source_->offset() != 0 ||
      clone_source_->size() != plan.file_size || plan.order.size() != specs_.size() ||
      plan.offsets.size() != specs_.size() || (!plan.after.empty() && plan.after.size() != specs_.size())) {
    return {};
  }
  const absl::string_view source = clone_source_->bytes().view();
  auto unchanged_at = [&](size_t i) { return i < unchanged_at_.size() ? unchanged_at_[i] : std::nullopt; };
  auto zeros = [&](uint64_t from, uint64_t to) {
    return from <= to && to <= source.size() &&
           source.substr(from, to - from).find_first_not_of('\0') == absl::string_view::npos;
  };
  if (!absl::StartsWith(source, plan.header)) return {};
  uint64_t pos = plan.header.size(), kept = 0, written = 0;
  for (size_t k = 0; k < plan.order.size(); ++k) {
    const size_t i = plan.order[k];
    const uint64_t size = specs_[i].byte_size();
    if (!zeros(pos, plan.offsets[k]) || plan.offsets[k] > source.size() || size > source.size() - plan.offsets[k]) {
      return {};
    }
    if (const std::optional<uint64_t> at = unchanged_at(i); at.has_value()) {
      if (*at != plan.offsets[k]) return {};
      kept += size;
    } else {
      written += size;
    }
    pos = plan.offsets[k] + size;
    if (!plan.after.empty()) {
      if (source.substr(pos, plan.after[k].size()) != plan.after[k]) return {};
      pos += plan.after[k].size();
    }
  }
  if (!zeros(pos, plan.file_size)) return {};
  return {kept, written};
}

absl::Status CheckpointWriter::WriteOverClone(const WritePlan& plan, AtomicFile& file) const {
  for (size_t k = 0; k < plan.order.size(); ++k) {
    const size_t i = plan.order[k];
    if (i < unchanged_at_.size() && unchanged_at_[i].has_value()) continue;
    const TensorSpec& spec = specs_[i];
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes bytes, Produce(spec, producers_[i]));
    WEIGHTSTORE_RETURN_IF_ERROR(ForEachWindow(bytes.view(), [&](uint64_t off, absl::string_view window) {
      for (size_t done = 0; done < window.size();) {
        const ssize_t n = ::pwrite(file.fd(), window.data() + done, window.size() - done,
                                   static_cast<off_t>(plan.offsets[k] + off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          return StatusFromErrno(n < 0 ? errno : EIO,
                                 absl::StrCat("cannot write tensor '", spec.name, "' to '", file.temp_path(), "'"));
        }
        done += static_cast<size_t>(n);
      }
      return absl::OkStatus();
    }));
    if (options_.progress) options_.progress(plan.offsets[k] + spec.byte_size(), plan.file_size);
  }
  return absl::OkStatus();
}

namespace {

// Adds every item's spec with a producer that reads it through `read`, then writes.
template <typename Items, typename Read>
absl::Status WriteAll(const Items& items, Read read, const std::string& path, const FormatSpec& format,
                      const Metadata& metadata, const WriteOptions& options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                               CheckpointWriter::Create(path, format, options));
  writer->SetMetadata(metadata);
  for (const auto& item : items) {
    WEIGHTSTORE_RETURN_IF_ERROR(writer->Add(item.spec, [&read, &item]() -> absl::StatusOr<SharedBytes> {
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, read(item));
      return t.bytes;
    }));
  }
  return writer->Finish();
}

}  // namespace

absl::Status WriteCheckpoint(const Checkpoint& checkpoint, const std::string& path, const FormatSpec& format,
                             const Metadata& metadata, const WriteOptions& options) {
  return WriteAll(
      checkpoint.entries(), [&](const CheckpointEntry& e) { return checkpoint.Read(e); }, path, format, metadata,
      options);
}

absl::StatusOr<std::string> SerializeCheckpoint(const FormatSpec& format, const std::vector<SharedTensor>& tensors,
                                                const Metadata& metadata) {
  std::vector<TensorSpec> specs;
  std::vector<BytesProducer> producers;
  for (const SharedTensor& t : tensors) {
    specs.push_back(t.spec);
    producers.push_back([bytes = t.bytes]() -> absl::StatusOr<SharedBytes> { return bytes; });
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(WritePlan plan, PlanCheckpoint(format, specs, metadata));
  StringSink sink;
  WEIGHTSTORE_RETURN_IF_ERROR(WritePlanned(plan, specs, producers, WriteOptions{}, sink));
  return std::move(sink.out);
}

}  // namespace weightstore
