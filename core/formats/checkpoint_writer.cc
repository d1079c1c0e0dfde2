#include "core/formats/checkpoint_writer.h"

#include <sys/mman.h>
#include <unistd.h>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/atomic_file.h"
#include "core/status_macros.h"

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
    absl::StatusOr<SharedBytes> bytes = producers[i]();
    if (!bytes.ok()) {
      return absl::Status(bytes.status().code(), absl::StrCat("tensor '", spec.name, "': ", bytes.status().message()));
    }
    if (bytes->size() != spec.byte_size()) {
      return absl::InternalError(
          absl::StrCat("tensor '", spec.name, "' produced ", bytes->size(), " bytes, expected ", spec.byte_size()));
    }
    // Write in 8 MiB windows, each populated in one call first: faulting a
    // mapping in page by page inside write() is the slow part of a copy.
    constexpr size_t kWindow = 8 << 20;
    absl::string_view view = bytes->view();
    for (size_t off = 0; off < view.size(); off += kWindow) {
      absl::string_view window = view.substr(off, kWindow);
      PopulateForRead(window);
      WEIGHTSTORE_RETURN_IF_ERROR(sink.Append(window));
    }
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
  WEIGHTSTORE_RETURN_IF_ERROR(WritePlanned(plan, specs_, producers_, options_, *file));
  return file->Commit();
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
