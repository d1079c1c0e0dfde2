// Shared by the Burn record reader's files (burn_record.h is the interface):
// building entries, the walker that the MessagePack and JSON tokenizers drive,
// the bincode reader, and the NamedMpk writer's plan. Not for use outside
// core/formats/burn_record*.cc.
#ifndef WEIGHTSTORE_CORE_FORMATS_BURN_RECORD_INTERNAL_H_
#define WEIGHTSTORE_CORE_FORMATS_BURN_RECORD_INTERNAL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/checkpoint.h"
#include "core/formats/burn_record.h"
#include "core/formats/write_plan.h"

namespace weightstore::burn_record_internal {

inline constexpr size_t kMaxDepth = 64;  // nested maps and arrays; real records nest < 15
inline constexpr size_t kMaxRank = 64;
// A RecordLayout's parameter path: at most this many bytes and '.'-separated
// parts (a real module path is < 200 bytes and < 15 parts).
inline constexpr size_t kMaxLayoutPathBytes = 4096;
inline constexpr size_t kMaxLayoutPathParts = 64;
// What a record's parser produces, before Checkpoint::Create.
struct ParsedRecord {
  Metadata metadata;
  std::vector<CheckpointEntry> entries;
};

// A tensor's element type as the record states it. BOOL comes 1 byte an
// element, or 4 for Burn 0.21's Bool(U32), which is served as 1-byte BOOL.
struct RecordDType {
  DType dtype = DType::kF32;
  uint32_t bool_bytes = 1;
};

// The bytes one record's converted tensors (JSON bytes arrays, <= 0.13 values
// that are not views of the file) may take in all, fixed before converting:
// 2 x the record's (inflated) size + 64 MiB, and at most
// options.max_record_inflated_bytes.
uint64_t ConvertedBudget(uint64_t record_bytes, const OpenOptions& options);

// The dtype of a record's element type name (metadata "float" / "int"): "f32",
// "f64", "half::binary16::f16", "i32", "i64" or "i16"; nullopt for others.
std::optional<DType> ElementDType(absl::string_view type_name);

// The tensor `name` (found at `where`, e.g. "item.fc.weight.param") as an
// entry over `bytes`. Returns InvalidArgument naming `where` unless the rank is
// at most 64, bytes.size() == numel x element size (overflow-checked), every
// BOOL element is 0 or 1 (4-byte BOOLs are narrowed into a new buffer), and the
// name fits options.max_name_bytes.
absl::StatusOr<CheckpointEntry> MakeEntry(std::string name, std::optional<uint64_t> param_id, RecordDType dtype,
                                          std::vector<uint64_t> shape, SharedBytes bytes, absl::string_view where,
                                          const OpenOptions& options);

// The kind of a <= 0.13 tensor's values, which with the record's metadata
// gives its dtype.
enum class ValueKind : uint8_t { kNone, kFloat32, kFloat64, kFloatText, kInteger, kBool };

// The tensor map of a Param that RecordWalker is reading.
struct PendingTensor {
  std::string name;
  std::string where;
  bool has_bytes = false, has_shape = false, has_dtype = false, has_value = false;
  SharedBytes view;             // a MessagePack bin
  std::vector<std::byte> data;  // JSON bytes or <= 0.13 values, converted
  std::vector<uint64_t> shape;
  RecordDType dtype;
  ValueKind element = ValueKind::kNone;
  uint64_t values = 0;
};

// Builds a self-describing record (MessagePack or JSON) from its tokens, in
// document order, without a tree of the document: the root map's "metadata"
// strings, and every Param under "item", named by its path. A Param is a map
// with the keys "id" (a string) and "param" (a tensor map), in any order and
// beside any other keys, as serde-derive reads ParamSerde; its entry is made
// when the map closes. The tokenizer guarantees balanced containers and map
// keys between containers' values; the walker checks the rest (depth,
// duplicate keys, UTF-8, tensor fields, Param ids) and bounds the bytes that
// converted tensors take (ConvertedBudget). Each event returns false once an
// error is recorded, which stops the tokenizer. Thread-compatible.
class RecordWalker {
 public:
  // `base` holds the document: Bin() views are kept as subspans of it.
  RecordWalker(SharedBytes base, const OpenOptions& options);

  bool StartMap();
  bool StartArray();
  bool EndMap() { return End(); }
  bool EndArray() { return End(); }
  bool Key(absl::string_view key);
  bool Nil();
  bool Bool(bool value);
  bool Uint(uint64_t value);
  bool Int(int64_t value);
  // `bits`: 64 (MessagePack's 0xcb), or 0 (JSON: the width comes from the
  // record's metadata).
  bool Float(double value, int bits);
  // A MessagePack f32 (0xca), as its bits: stored as they are, so a
  // signalling NaN stays one.
  bool Float32(uint32_t bits);
  bool Str(absl::string_view value);
  // REQUIRES: `value` lies inside `base`.
  bool Bin(absl::string_view value);

  // Records `what` at the current position ("item.fc.weight.param.bytes:
  // what"); the first error wins. Returns false.
  bool Fail(absl::string_view what);
  bool failed() const { return !error_.empty(); }
  const std::string& error() const { return error_; }
  // True once the root map has closed.
  bool done() const { return done_; }

  // The record. REQUIRES: done() and !failed().
  ParsedRecord Take() { return std::move(record_); }

 private:
  // kParamValue: a map under a module map's "param" key, until its first key
  // says whether it is a tensor map (or a module).
  enum class Kind : uint8_t { kRoot, kMetadata, kModule, kParamValue, kTensor, kShape, kBytes, kValue, kDType, kSkip };
  struct Frame {
    Kind kind;
    bool is_map;
    size_t path_size;    // path_'s length before this frame's component
    uint64_t count = 0;  // a map's keys, an array's elements so far
    std::string key;     // a map's current key
    absl::flat_hash_set<std::string> keys;
    // A module map's Param fields, seen in any order:
    std::optional<std::string> id;         // "id", when a string
    std::string id_not_string;             // else what it is ("null", "a map")
    std::optional<CheckpointEntry> param;  // "param", a tensor map: its entry, id to come
    std::string param_not_tensor;          // else what "param" is ("an array")
  };

  bool Start(bool is_map);
  // Takes a scalar's path component; false outside the root map.
  bool BeginScalar();
  bool End();
  // The current value's path component (a key, or an array index, counted).
  std::string NextComponent();
  // The path of the value now arriving, for errors.
  std::string Where() const;
  // A scalar in the top frame: routes by frame kind.
  bool Scalar(absl::string_view what);
  bool Dimension(uint64_t value);
  bool Byte(uint64_t value);
  bool ParseDTypeName(absl::string_view name);
  bool BoolStore(absl::string_view store);
  // Appends one <= 0.13 value: `element` says its kind; `u`, `i`, `f` carry it.
  bool Value(ValueKind element, uint64_t u, int64_t i, double f);
  bool StartValues(ValueKind element);
  // Appends `bits`' low `bytes` bytes (LE) to the pending tensor's converted
  // data (its `field`, for errors), within the record's budget: the buffer
  // never grows past what the budget leaves it.
  bool Append(uint64_t bits, int bytes, absl::string_view field);
  // Starts the tensor map of the Param map below the top frame.
  void BeginTensor();
  // The tensor map closed: its entry waits in the Param map (the top frame).
  bool FinishTensor();
  // A module map closed: a Param's entry, with its id, goes in the record.
  bool FinishParam(Frame& closed);

  SharedBytes base_;
  const OpenOptions& options_;
  std::vector<Frame> frames_;
  std::string path_;
  std::optional<PendingTensor> tensor_;
  bool seen_metadata_ = false, seen_item_ = false, done_ = false;
  uint64_t tensors_ = 0;    // tensor maps finished
  const uint64_t budget_;   // ConvertedBudget
  uint64_t converted_ = 0;  // bytes converted so far, all tensors
  std::string error_;
  ParsedRecord record_;
};

// Tokenizes MessagePack `data` (the whole record) into `walker` with
// msgpack-cxx's visitor API. Returns the walker's error, or a MessagePack
// fault, with the byte offset; trailing bytes are refused.
absl::Status WalkMsgpack(absl::string_view data, RecordWalker* walker);
// Tokenizes JSON `data` into `walker` with nlohmann's SAX parser.
absl::Status WalkJson(absl::string_view data, RecordWalker* walker);

// Reads a bincode record from `data` (the whole record) with `layout`.
absl::StatusOr<ParsedRecord> ParseBincode(SharedBytes data, const RecordLayout& layout, const OpenOptions& options);

// The ParamId written for a tensor that has none: XXH3-64 of its name, so
// writing the same tensors twice gives the same bytes.
uint64_t DeriveParamId(absl::string_view tensor_name);

// kBurnRecordFormat's plan (burn_record_writer.cc): a NamedMpk record of
// `tensors`, nested by their '.'-separated names (numeric components indexed
// 0..n-1 make arrays, others maps in first-appearance order), each a Param
// {id, param: TensorData {bytes, shape, dtype}}. Its BurnMetadata is
// `metadata`'s float, int, format, version and settings when it has all five,
// else Full, Half (every float tensor F16) or Double (every one F64).
// Returns InvalidArgument naming the tensor for what Burn cannot load.
absl::StatusOr<WritePlan> PlanNamedMpk(const std::vector<TensorSpec>& tensors, const Metadata& metadata);

}  // namespace weightstore::burn_record_internal

#endif  // WEIGHTSTORE_CORE_FORMATS_BURN_RECORD_INTERNAL_H_
