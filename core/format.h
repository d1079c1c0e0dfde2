// The format registry: one table of the checkpoint file formats weightstore
// reads and writes. Each format describes itself with a FormatSpec in its own
// file under core/formats/, and core/formats/formats.cc lists them. Everything
// else asks the table: Checkpoint::Open's detection, the registry's scan of the
// models folder, uploads, CheckpointWriter and the CLI. Adding a format touches
// only core/formats/ (docs/where-changes-go.md has the recipe).
//
// The table is constant-initialized and immutable: thread-safe.
#ifndef WEIGHTSTORE_CORE_FORMAT_H_
#define WEIGHTSTORE_CORE_FORMAT_H_

#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"

namespace weightstore {

class Checkpoint;
class MappedFile;
struct OpenOptions;
struct WritePlan;
using Metadata = std::map<std::string, std::string>;

struct FormatSpec {
  // Its name in CheckpointInfo.format, `--format` and errors: "safetensors".
  absl::string_view name;
  // File name endings, lower case with the dot, the usual one first. Files with
  // these endings are scanned in the models folder and accepted by uploads.
  std::span<const absl::string_view> extensions;
  // Endings recognized only when a path names the file (an output of the CLI),
  // never scanned: a models folder holds too many other ".bin" files.
  std::span<const absl::string_view> named_extensions;
  // True when `file` (its whole mapping) is this format. The table is asked in
  // order; the last format may take anything, so its reader names the fault.
  bool (*detect)(absl::string_view file) = nullptr;
  absl::StatusOr<std::shared_ptr<const Checkpoint>> (*open)(std::shared_ptr<const MappedFile> file,
                                                            const OpenOptions& options) = nullptr;

  // A checkpoint split over several files has an index file: its name ending
  // (".safetensors.index.json"), how to open it, and the files it names
  // (absolute or relative to the working folder, as the index path is).
  absl::string_view index_suffix;
  absl::StatusOr<std::shared_ptr<const Checkpoint>> (*open_index)(const std::string& path,
                                                                  const OpenOptions& options) = nullptr;
  std::vector<std::string> (*index_files)(const std::string& path) = nullptr;

  // Lays out a file of this format (CheckpointWriter); null: read-only here.
  absl::StatusOr<WritePlan> (*plan)(const std::vector<TensorSpec>& tensors, const Metadata& metadata) = nullptr;
  // `plan` with the tensors in the order given, where `plan` orders them its
  // own way (WriteOptions::keep_order); null: `plan` keeps the order given.
  absl::StatusOr<WritePlan> (*plan_in_order)(const std::vector<TensorSpec>& tensors,
                                             const Metadata& metadata) = nullptr;
  // The endings of the one encoding `plan` writes, when the format reads
  // several (Burn records: ".mpk", not ".mpk.gz"); empty: all of `extensions`.
  std::span<const absl::string_view> write_extensions;

  // burn-store's adapter default for this format: when a selection is applied
  // to a target, map "layers.0", "layers.2" to contiguous indices (PyTorch's
  // nn.Sequential leaves gaps where layers have no parameters).
  bool contiguous_indices_when_applying = false;

  bool writable() const { return plan != nullptr; }

  // Each format is one object in the table: equal means the same object.
  friend bool operator==(const FormatSpec& a, const FormatSpec& b) { return &a == &b; }
  friend std::ostream& operator<<(std::ostream& os, const FormatSpec& f) { return os << f.name; }
};

// Every format, in detection order. Defined in core/formats/formats.cc.
std::span<const FormatSpec* const> Formats();

// The format called `name`, or nullptr.
const FormatSpec* FindFormat(absl::string_view name);
// The format whose extension (or, with `named`, named extension) ends `path`,
// ignoring case; nullptr when none does. Index suffixes count as extensions.
const FormatSpec* FormatForPath(absl::string_view path, bool named = true);
// The format whose index suffix ends `path` (ignoring case), or nullptr.
const FormatSpec* IndexFormatForPath(absl::string_view path);
// `path` without the extension or index suffix FormatForPath(path, false)
// matched, or nullopt when it matches none.
std::optional<std::string> StripFormatExtension(absl::string_view path);
// The first format whose `detect` accepts `file`, or nullptr.
const FormatSpec* DetectFormat(absl::string_view file);

// True when a file at `path` can be written in `format`: it has a plan, and
// when the format reads several encodings but writes one (write_extensions),
// `path` ends with one of that encoding's endings: a Burn record is written
// to "x.mpk", never to "x.mpk.gz" or a bincode "x.bin" (a push in place).
bool CanWrite(const FormatSpec& format, absl::string_view path);

// "safetensors, pytorch, burnpack" (with `writable_only`, those with a plan),
// for help texts and errors.
std::string FormatNames(bool writable_only = false);
// ".bpk, .safetensors, .pt, .pth": every scanned extension (with
// `writable_only`, of the writable formats), for help texts and errors.
std::string FormatExtensions(bool writable_only = false);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMAT_H_
