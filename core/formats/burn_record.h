// Reader of Burn's legacy "record" files, written by the Recorders of Burn 0.7
// to 0.21: MessagePack (.mpk), JSON (.json) and bincode (.bin), each also
// gzipped (.mpk.gz, .json.gz, .bin.gz); and writer of NamedMpk (.mpk) records
// in Burn >= 0.14's layout, which Burn 0.14 to 0.21 load.
//
// The encoding is detected from the content (a gzip stream is inflated, then
// detected again), and the tensor layout from the structure: Burn >= 0.14's
// TensorData {bytes, shape, dtype} or <= 0.13's {value, shape}, whose dtype
// comes from the record's metadata. Tensors are named by their module path
// (`layers.0.norm_x.gamma`), as burn-store names them; ParamIds that decode to
// Burn's u64 are kept. MessagePack and bincode tensor bytes are zero-copy views
// of the file (or of the inflated record); JSON and <= 0.13 values are
// converted once, at open. Bincode stores no names, so it is read with a
// RecordLayout. The writer (burn_record_writer.cc) plans the MessagePack
// around each tensor, so tensor bytes stream from their source as in every
// format. Byte layouts and what is refused: core/formats/FORMAT.md.
#ifndef WEIGHTSTORE_CORE_FORMATS_BURN_RECORD_H_
#define WEIGHTSTORE_CORE_FORMATS_BURN_RECORD_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/checkpoint.h"
#include "core/format.h"
#include "core/formats/write_plan.h"

namespace weightstore {

// The format's entry in the table (core/format.h): ".mpk", ".mpk.gz",
// ".json.gz" and ".bin.gz" files (and ".json" when named). Its plan writes a
// NamedMpk record (uncompressed MessagePack: a ".mpk" file), refusing with
// InvalidArgument, naming the tensor, a dtype Burn has no name for (the F8,
// F6 and F4 types, C64), a tensor of 4 GiB or more, an array index missing
// from 0..n-1, and a path that is both a tensor and a module. A ".bin" record
// is told from a PyTorch ".bin" by its content.
extern const FormatSpec kBurnRecordFormat;

// A bincode record's parameters, in the module's declaration order: a target
// schema (core/target_schema.h, which parses it) of which only each path and
// shape are used, bounded for the bincode reader's search.
struct RecordLayout {
  struct Parameter {
    std::string path;
    std::vector<uint64_t> shape;
  };
  std::vector<Parameter> parameters;

  // Returns InvalidArgument naming `source` and the field on bad input.
  static absl::StatusOr<RecordLayout> FromJson(absl::string_view json, absl::string_view source);
  // Reads and parses the file at `path` (at most 64 MiB).
  static absl::StatusOr<RecordLayout> Load(const std::string& path);
};

// True if `file` starts like a Burn record (after inflating a gzip stream's
// first few hundred bytes). Never true for a zip, pickle or TAR file.
bool IsBurnRecord(absl::string_view file);

// Parses a record held in `bytes`; `path` names it in errors. A bincode record
// is read with `layout`, or else with options.record_layout's file; without
// either it is refused with InvalidArgument saying a layout is needed. Returns
// InvalidArgument naming `path` and the field (`item.layers.0.weight.param`)
// for anything malformed.
absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseBurnRecord(SharedBytes bytes, const std::string& path,
                                                                  const OpenOptions& options,
                                                                  const RecordLayout* layout = nullptr);

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadBurnRecord(std::shared_ptr<const MappedFile> file,
                                                                 const OpenOptions& options);

// The plan of a NamedMpk record laid out as `record_template` (the bytes of
// an uncompressed NamedMpk record of Burn >= 0.14, named `path` in errors:
// one the target application saved from its own model, as initialized) with
// its tensors' bytes replaced by `tensors`' of the same names. Every other
// byte of the template stays as that Burn version wrote it: metadata,
// ParamIds, constants (`[nil, nil]` arrays before 0.21, `EmptyRecord` after),
// dtype encodings (`"Bool"` or `{"Bool": "Native"}`), so that version loads
// the result. Each template tensor must be given with its dtype and shape,
// and no other tensor: InvalidArgument naming the first that is not (or a
// template of another kind: gzipped, JSON, bincode, the <= 0.13 layout).
absl::StatusOr<WritePlan> PlanFromRecordTemplate(const SharedBytes& record_template, const std::string& path,
                                                 const std::vector<TensorSpec>& tensors);

// Burn's ParamId from its string: base32hex (RFC 4648, lowercase, no padding;
// 13 characters since Burn 0.15, 10 in 0.14) of at most 8 little-endian bytes.
// nullopt for anything else (a <= 0.13 UUID).
std::optional<uint64_t> DecodeBurnParamId(absl::string_view id);
// The 13-character string Burn >= 0.15 writes for ParamId `id`: base32hex of
// its 8 little-endian bytes. DecodeBurnParamId(EncodeBurnParamId(id)) == id.
std::string EncodeBurnParamId(uint64_t id);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_BURN_RECORD_H_
