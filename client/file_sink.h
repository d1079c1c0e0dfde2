// FileSink: a TensorSink that writes fetched tensors straight into a checkpoint
// file. The layout is planned from the listing first; the temporary sibling of
// the output is sized and mapped, and each tensor's bytes land at their planned
// offset (in whatever order they arrive), with no intermediate buffer. Finish()
// commits atomically; a FileSink destroyed before Finish() leaves nothing behind.
// Thread-compatible.
#ifndef WEIGHTSTORE_CLIENT_FILE_SINK_H_
#define WEIGHTSTORE_CLIENT_FILE_SINK_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "client/store.h"
#include "core/atomic_file.h"
#include "core/formats/write_plan.h"

namespace weightstore::client {

class FileSink final : public TensorSink {
 public:
  // `tensors` in the order the writer should lay them out (Burnpack keeps it).
  static absl::StatusOr<std::unique_ptr<FileSink>> Create(const std::string& path, const FormatSpec& format,
                                                          const std::vector<TensorSpec>& tensors,
                                                          const Metadata& metadata, bool overwrite);
  ~FileSink() override;

  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override;
  absl::Status End(const TensorSpec& spec) override;
  // Returns FailedPrecondition unless every planned tensor arrived.
  absl::Status Finish();

  // Called after each tensor with (bytes received, total bytes).
  void set_progress(std::function<void(uint64_t, uint64_t)> progress) { progress_ = std::move(progress); }

 private:
  FileSink() = default;
  std::unique_ptr<AtomicFile> file_;
  std::byte* map_ = nullptr;
  size_t map_size_ = 0;
  struct Slot {
    TensorSpec spec;
    uint64_t offset;
    bool done = false;
  };
  absl::flat_hash_map<std::string, Slot> slots_;
  uint64_t received_ = 0, total_ = 0;
  std::function<void(uint64_t, uint64_t)> progress_;
};

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_FILE_SINK_H_
