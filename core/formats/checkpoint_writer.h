// CheckpointWriter: writes a checkpoint file of any writable format in the
// table (core/format.h), atomically.
//
// Like LevelDB's TableBuilder: Add() every tensor, then Finish(). The layout is
// planned from the specs alone, then each tensor's bytes are produced once, in
// file order, and written straight from their source (for a mapped input, from
// the page cache), so peak memory is about one tensor. A failed or abandoned
// write leaves no file behind. Thread-compatible.
#ifndef WEIGHTSTORE_CORE_FORMATS_CHECKPOINT_WRITER_H_
#define WEIGHTSTORE_CORE_FORMATS_CHECKPOINT_WRITER_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "core/atomic_file.h"
#include "core/checkpoint.h"
#include "core/format.h"
#include "core/formats/write_plan.h"
#include "core/mapped_file.h"

namespace weightstore {

struct WriteOptions {
  // Replace an existing file. Default: false (AlreadyExists).
  bool overwrite = false;
  // Called after each tensor with (bytes written, total bytes). Default: none.
  std::function<void(uint64_t, uint64_t)> progress;
  // Lays the file out instead of the format's own plan (a Burn record
  // template: RecordTemplatePlan). Default: none.
  std::function<absl::StatusOr<WritePlan>(const std::vector<TensorSpec>&, const Metadata&)> plan;
  // Writes the tensors in the order added, where the format lets a writer
  // choose (FormatSpec::plan_in_order). Default: the format's own order.
  bool keep_order = false;
};

// Produces one tensor's bytes; called once, during Finish().
using BytesProducer = std::function<absl::StatusOr<SharedBytes>()>;

class CheckpointWriter {
 public:
  // Returns InvalidArgument unless `format` is writable.
  static absl::StatusOr<std::unique_ptr<CheckpointWriter>> Create(std::string path, const FormatSpec& format,
                                                                  WriteOptions options = {});

  void SetMetadata(Metadata metadata) { metadata_ = std::move(metadata); }
  // Returns InvalidArgument for a duplicate or empty name.
  absl::Status Add(TensorSpec spec, BytesProducer bytes);
  // A file the new one may start as a copy of (AtomicFile::CloneFrom): when
  // the plan lays out `source` exactly (the same bytes before the first
  // tensor, between tensors and after the last, the same size, and each
  // AddUnchanged tensor where its view lies), Finish() clones it where the
  // filesystem shares extents, or copies it in the kernel where nine tenths
  // of its tensor bytes are kept, and writes only the other tensors over it.
  // The file is the same bytes either way. Default: none.
  void SetCloneSource(std::shared_ptr<const MappedFile> source) { clone_source_ = std::move(source); }
  // As Add, for a tensor whose bytes are `view`: where the view lies in the
  // clone source (set first), a copy of it need not write them.
  absl::Status AddUnchanged(TensorSpec spec, SharedBytes view);
  // Writes the file. Returns an error naming the tensor whose bytes failed.
  absl::Status Finish();
  // After Finish(): how the clone source was used (kUnsupported: not at all,
  // every byte was written).
  AtomicFile::CloneResult clone_result() const { return clone_result_; }

  // Returns the planned layout of what Finish() would write.
  absl::StatusOr<WritePlan> Plan() const;

 private:
  CheckpointWriter() = default;

  std::string path_;
  const FormatSpec* format_ = nullptr;
  WriteOptions options_;
  Metadata metadata_;
  std::vector<TensorSpec> specs_;
  std::vector<BytesProducer> producers_;
  absl::flat_hash_set<std::string> names_;
  std::shared_ptr<const MappedFile> clone_source_;
  std::vector<std::optional<uint64_t>> unchanged_at_;  // per tensor added: its offset in the clone source
  AtomicFile::CloneResult clone_result_ = AtomicFile::CloneResult::kUnsupported;

  // What of `plan` clone_source_ holds: nothing unless the plan lays it out
  // exactly; else the tensor bytes kept and those to be written over it.
  struct Kept {
    uint64_t kept = 0, written = 0;
  };
  Kept PlanClonesSource(const WritePlan& plan) const;
  // Writes the tensors not in the clone source over its copy in `file`.
  absl::Status WriteOverClone(const WritePlan& plan, AtomicFile& file) const;
};

// Lays out a file of `format` holding `tensors`; InvalidArgument when the
// format is not writable.
absl::StatusOr<WritePlan> PlanCheckpoint(const FormatSpec& format, const std::vector<TensorSpec>& tensors,
                                         const Metadata& metadata);

// Writes every tensor of `checkpoint` (in its order) to `path` in `format`,
// with `metadata`.
absl::Status WriteCheckpoint(const Checkpoint& checkpoint, const std::string& path, const FormatSpec& format,
                             const Metadata& metadata, const WriteOptions& options);

// WriteOptions::plan for a file of `format` laid out as the Burn record at
// `template_path` (mapped now; PlanFromRecordTemplate in burn_record.h when
// writing). InvalidArgument unless `format` is the Burn record format; the
// file's errors. Defined in burn_record_writer.cc.
absl::StatusOr<decltype(WriteOptions::plan)> RecordTemplatePlan(const FormatSpec& format,
                                                                const std::string& template_path);

// Serializes tensors to memory (tests, fuzzing and small payloads).
absl::StatusOr<std::string> SerializeCheckpoint(const FormatSpec& format, const std::vector<SharedTensor>& tensors,
                                                const Metadata& metadata);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_CHECKPOINT_WRITER_H_
