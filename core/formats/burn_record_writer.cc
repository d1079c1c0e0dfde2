// Burn's NamedMpk record writer (`.mpk`, NamedMpkFileRecorder): the WritePlan
// of a BurnRecord {metadata, item, _b} as rmp-serde's `write_named` encodes it
// for Burn >= 0.14, so a Burn 0.14-0.21 application loads it. The MessagePack
// around each tensor (keys, ids, the bin head, shape and dtype) goes in the
// plan's header and `after` strings; tensor bytes stream between them.
#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/formats/burn_record.h"
#include "core/formats/burn_record_internal.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/write_plan.h"
#include "core/mapped_file.h"
#include "core/status_macros.h"
#include "core/utf8.h"

namespace weightstore {
namespace {

// The reader's depth bound (kMaxDepth) less the root, item, Param, TensorData
// and shape levels around a tensor's path: deeper would not read back.
constexpr size_t kMaxSegments = burn_record_internal::kMaxDepth - 4;

constexpr absl::string_view kMetadataKeys[] = {"float", "int", "format", "version", "settings"};

// MessagePack as rmp-serde (1.1-1.3) writes it: every length and unsigned
// integer in its most compact form (fixmap/map16/map32, fixarray/array16/
// array32, fixstr/str8/str16/str32, bin8/bin16/bin32, fixint/uint8-64).
class MsgpackOut {
 public:
  void Map(uint64_t n) { Head(n, 0x80, 0xde); }
  void Array(uint64_t n) { Head(n, 0x90, 0xdc); }
  void Str(absl::string_view s) {
    if (s.size() < 32) {
      Byte(0xa0 | s.size());
    } else {
      Sized(s.size(), 0xd9);
    }
    out_.append(s.data(), s.size());
  }
  // REQUIRES: n <= UINT32_MAX.
  void BinHead(uint64_t n) { Sized(n, 0xc4); }
  void Uint(uint64_t v) {
    if (v < 128) return Byte(v);
    const int width = v <= 0xFF ? 1 : v <= 0xFFFF ? 2 : v <= 0xFFFFFFFF ? 4 : 8;
    Byte(width == 1 ? 0xcc : width == 2 ? 0xcd : width == 4 ? 0xce : 0xcf);
    BigEndian(v, width);
  }
  // Ends the current piece (at a tensor's bytes) and starts the next.
  std::string Cut() { return std::exchange(out_, std::string()); }

 private:
  void Byte(uint64_t b) { out_.push_back(static_cast<char>(b)); }
  void BigEndian(uint64_t v, int width) {
    for (int i = width - 1; i >= 0; --i) Byte((v >> (8 * i)) & 0xFF);
  }
  // A map or array head: the fix form below 16, else a 16- or 32-bit count
  // (`marker`, marker + 1).
  void Head(uint64_t n, uint8_t fix, uint8_t marker) {
    if (n < 16) return Byte(fix | n);
    const bool wide = n > 0xFFFF;
    Byte(marker + (wide ? 1 : 0));
    BigEndian(n, wide ? 4 : 2);
  }
  // A str or bin head: an 8-, 16- or 32-bit length (`marker`, + 1, + 2).
  void Sized(uint64_t n, uint8_t marker) {
    const int step = n <= 0xFF ? 0 : n <= 0xFFFF ? 1 : 2;
    Byte(marker + step);
    BigEndian(n, 1 << step);
  }

  std::string out_;
};

// DType's variant name as rmp-serde writes a unit variant; nullopt for the
// types Burn has none for. Bool is the pre-0.21 unit variant "Bool".
std::optional<absl::string_view> BurnDTypeName(DType dtype) {
  static constexpr std::pair<DType, absl::string_view> kNames[] = {
      {DType::kF64, "F64"}, {DType::kF32, "F32"}, {DType::kF16, "F16"},  {DType::kBF16, "BF16"}, {DType::kI64, "I64"},
      {DType::kI32, "I32"}, {DType::kI16, "I16"}, {DType::kI8, "I8"},    {DType::kU64, "U64"},   {DType::kU32, "U32"},
      {DType::kU16, "U16"}, {DType::kU8, "U8"},   {DType::kBool, "Bool"}};
  for (const auto& [d, name] : kNames) {
    if (d == dtype) return name;
  }
  return std::nullopt;
}

// The BurnMetadata strings, in BurnMetadata's field order: the checkpoint's
// own when it has all five (a record read back keeps them byte for byte), else
// the precision settings the tensors fit.
std::vector<std::string> RecordMetadata(const std::vector<TensorSpec>& tensors, const Metadata& metadata) {
  std::vector<std::string> given;
  for (absl::string_view key : kMetadataKeys) {
    auto it = metadata.find(std::string(key));
    if (it == metadata.end() || !IsValidUtf8(it->second)) break;
    given.push_back(it->second);
  }
  if (given.size() == std::size(kMetadataKeys)) return given;

  bool all_f16 = false, all_f64 = false, first = true;
  for (const TensorSpec& t : tensors) {
    if (!IsFloatingPoint(t.dtype)) continue;
    all_f16 = (first || all_f16) && t.dtype == DType::kF16;
    all_f64 = (first || all_f64) && t.dtype == DType::kF64;
    first = false;
  }
  const char* float_type = all_f16 ? "half::binary16::f16" : all_f64 ? "f64" : "f32";
  const char* int_type = all_f16 ? "i16" : all_f64 ? "i64" : "i32";
  const char* settings = all_f16   ? "HalfPrecisionSettings"
                         : all_f64 ? "DoublePrecisionSettings"
                                   : "FullPrecisionSettings";
  // The newest Burn with records (0.22 removed them). Burn never checks it on
  // load, and our reader tells layouts apart by structure, not by version.
  constexpr const char* kVersion = "0.21.0";
  return {float_type, int_type,
          absl::StrCat("burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::", settings, ">"),
          kVersion, settings};
}

// True for an array index as Burn's reader names it: "0", "1", ... "10" (no
// leading zero); `value` is saturated past 18 digits.
bool ParseIndex(absl::string_view s, uint64_t* value) {
  if (s.empty() || (s.size() > 1 && s[0] == '0')) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v > 100000000000000000u ? UINT64_MAX : v * 10 + (c - '0');
  }
  *value = v;
  return true;
}

// The module tree the tensor names spell: a Param at each leaf, a struct (map,
// keys in first-appearance order) or Vec (array, indices 0..n-1) above.
struct Node {
  std::string key;
  std::optional<size_t> tensor;  // a leaf: its index in the input
  size_t first_tensor = 0;       // the input's first tensor under it, for errors
  std::vector<size_t> children;  // node indices, first appearance first
  absl::flat_hash_map<std::string, size_t> by_key;
  bool is_array = false;
};

class RecordPlanner {
 public:
  explicit RecordPlanner(const std::vector<TensorSpec>& tensors) : tensors_(tensors) { nodes_.emplace_back(); }

  absl::Status Add(size_t i);
  // Orders each node's children, and makes arrays of those indexed 0..n-1.
  absl::Status Shape(size_t node);
  absl::StatusOr<WritePlan> Emit(const std::vector<std::string>& metadata);

 private:
  absl::Status Refuse(size_t i, absl::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensors_[i].name, "' ", why));
  }
  void EmitNode(size_t node);
  // Ends the piece of MessagePack before a tensor's bytes (the header, then
  // each tensor's `after`), or the last one.
  void CutPiece() { (plan_.order.empty() ? plan_.header : plan_.after.emplace_back()) = out_.Cut(); }

  const std::vector<TensorSpec>& tensors_;
  std::vector<Node> nodes_;  // nodes_[0] is the item
  MsgpackOut out_;
  WritePlan plan_;
};

absl::Status RecordPlanner::Add(size_t i) {
  const TensorSpec& t = tensors_[i];
  if (!IsValidUtf8(t.name)) return Refuse(i, "has a name that is not valid UTF-8");
  const std::optional<absl::string_view> dtype = BurnDTypeName(t.dtype);
  if (!dtype) {
    return Refuse(i, absl::StrCat("is ", DTypeName(t.dtype),
                                  ", which a Burn record cannot store (Burn's element types: F64, F32, F16, BF16, "
                                  "I64 to I8, U64 to U8, Bool); cast floats with --dtype, or leave the tensor out"));
  }
  if (t.shape.size() > kMaxRank) return Refuse(i, absl::StrCat("has ", t.shape.size(), " dimensions; at most 64"));
  if (t.byte_size() > std::numeric_limits<uint32_t>::max()) {
    return Refuse(i, absl::StrCat("is ", t.byte_size(),
                                  " bytes; a MessagePack bin holds less than 4 GiB (Burn's own writer would corrupt "
                                  "it): split it, or write Burnpack (.bpk)"));
  }
  const std::vector<absl::string_view> segments = absl::StrSplit(t.name, '.');
  if (segments.size() > kMaxSegments) {
    return Refuse(i, absl::StrCat("nests ", segments.size(), " levels deep; a record holds at most ", kMaxSegments));
  }
  size_t node = 0;
  for (size_t s = 0; s < segments.size(); ++s) {
    if (segments[s].empty()) return Refuse(i, "has an empty path component (a Burn module field has a name)");
    if (nodes_[node].tensor) {
      return Refuse(i, absl::StrCat("lies under tensor '", tensors_[*nodes_[node].tensor].name,
                                    "': a record holds a tensor or a module at one path, not both"));
    }
    auto [it, added] = nodes_[node].by_key.try_emplace(std::string(segments[s]), nodes_.size());
    const size_t child = it->second;
    if (added) {
      nodes_[node].children.push_back(child);
      nodes_.push_back(Node{.key = std::string(segments[s]), .first_tensor = i});
    }
    node = child;
  }
  if (nodes_[node].tensor) return Refuse(i, "appears twice");
  if (!nodes_[node].children.empty()) {
    return Refuse(
        i, absl::StrCat("is also the path of a module holding tensor '", tensors_[nodes_[node].first_tensor].name,
                        "': a record holds a tensor or a module at one path, not both"));
  }
  nodes_[node].tensor = i;
  return absl::OkStatus();
}

absl::Status RecordPlanner::Shape(size_t node) {
  Node& n = nodes_[node];
  if (n.children.empty()) return absl::OkStatus();
  std::vector<uint64_t> index(n.children.size());
  bool numeric = true;
  for (size_t c = 0; c < n.children.size() && numeric; ++c) {
    numeric = ParseIndex(nodes_[n.children[c]].key, &index[c]);
  }
  if (numeric) {
    // A Vec or array of modules: its record is an array, which Burn needs whole.
    std::vector<size_t> by_index(n.children.size(), SIZE_MAX);
    for (size_t c = 0; c < n.children.size(); ++c) {
      if (index[c] >= by_index.size() || by_index[index[c]] != SIZE_MAX) {
        // The keys differ, so the indices do (none has a leading zero): one
        // of 0..n-1 is missing. One pass finds the first.
        std::vector<bool> present(n.children.size());
        for (uint64_t i : index) {
          if (i < present.size()) present[i] = true;
        }
        const size_t missing = static_cast<size_t>(std::find(present.begin(), present.end(), false) - present.begin());
        return Refuse(nodes_[n.children[c]].first_tensor,
                      absl::StrCat("is indexed ", nodes_[n.children[c]].key, " among ", n.children.size(),
                                   " entries, and index ", missing,
                                   " is missing: a Burn Vec of modules needs indices 0..n-1 (renumber them with "
                                   "--contiguous-indices, or leave the tensor out)"));
      }
      by_index[index[c]] = n.children[c];
    }
    n.children = std::move(by_index);
    n.is_array = true;
  }
  for (size_t c = 0; c < nodes_[node].children.size(); ++c) {
    if (absl::Status s = Shape(nodes_[node].children[c]); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void RecordPlanner::EmitNode(size_t node) {
  const Node& n = nodes_[node];
  if (n.tensor) {
    // ParamSerde {id, param: TensorData {bytes, shape, dtype}}. The bytes
    // stream from the source between this piece and the next.
    const TensorSpec& t = tensors_[*n.tensor];
    out_.Map(2);
    out_.Str("id");
    out_.Str(EncodeBurnParamId(t.param_id.value_or(burn_record_internal::DeriveParamId(t.name))));
    out_.Str("param");
    out_.Map(3);
    out_.Str("bytes");
    out_.BinHead(t.byte_size());
    CutPiece();
    plan_.order.push_back(*n.tensor);
    out_.Str("shape");
    out_.Array(t.shape.size());
    for (uint64_t d : t.shape) out_.Uint(d);
    out_.Str("dtype");
    out_.Str(*BurnDTypeName(t.dtype));
    return;
  }
  if (n.is_array) {
    out_.Array(n.children.size());
  } else {
    out_.Map(n.children.size());
  }
  for (size_t child : n.children) {
    if (!n.is_array) out_.Str(nodes_[child].key);
    EmitNode(child);
  }
}

absl::StatusOr<WritePlan> RecordPlanner::Emit(const std::vector<std::string>& metadata) {
  out_.Map(3);
  out_.Str("metadata");
  out_.Map(std::size(kMetadataKeys));
  for (size_t k = 0; k < std::size(kMetadataKeys); ++k) {
    out_.Str(kMetadataKeys[k]);
    out_.Str(metadata[k]);
  }
  out_.Str("item");
  EmitNode(0);
  out_.Str("_b");
  out_.Array(0);  // PhantomData, a unit struct: an empty array
  CutPiece();     // after the last tensor; with none, the whole file
  uint64_t pos = plan_.header.size();
  for (size_t k = 0; k < plan_.order.size(); ++k) {
    plan_.offsets.push_back(pos);
    pos += tensors_[plan_.order[k]].byte_size() + plan_.after[k].size();
  }
  plan_.file_size = pos;
  return std::move(plan_);
}

}  // namespace

std::string EncodeBurnParamId(uint64_t id) {
  // base32hex of the 8 little-endian bytes: 64 bits and one zero bit of
  // padding make 13 characters of 5 bits, the first byte's high bits first.
  static constexpr char kAlphabet[] = "0123456789abcdefghijklmnopqrstuv";
  unsigned __int128 bits = 0;
  for (int k = 0; k < 8; ++k) bits = bits << 8 | ((id >> (8 * k)) & 0xFF);
  bits <<= 1;
  std::string out(13, '0');
  for (int c = 0; c < 13; ++c) out[c] = kAlphabet[static_cast<unsigned>(bits >> (60 - 5 * c)) & 31];
  return out;
}

absl::StatusOr<WritePlan> PlanFromRecordTemplate(const SharedBytes& record_template, const std::string& path,
                                                 const std::vector<TensorSpec>& tensors) {
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("record template '", path, "': ", why));
  };
  const absl::string_view file = record_template.view();
  const uint8_t first = file.empty() ? 0 : static_cast<uint8_t>(file[0]);
  if ((first & 0xF0) != 0x80 && first != 0xde && first != 0xdf) {
    return refuse("is not a MessagePack record (an uncompressed .mpk that NamedMpkFileRecorder saved)");
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> parsed,
                               ParseBurnRecord(record_template, path, OpenOptions{}));
  absl::flat_hash_map<std::string, size_t> given;
  for (size_t i = 0; i < tensors.size(); ++i) given.emplace(tensors[i].name, i);

  // Each template tensor's bytes, where they lie in the file.
  struct Slot {
    uint64_t offset, size;
    size_t input;
  };
  std::vector<Slot> slots;
  absl::flat_hash_set<size_t> used;
  for (const CheckpointEntry& e : parsed->entries()) {
    auto it = given.find(e.spec.name);
    if (it == given.end()) {
      return refuse(absl::StrCat("tensor '", e.spec.name, "' (", DTypeName(e.spec.dtype), " ",
                                 ShapeToString(e.spec.shape), ") is not among the tensors written"));
    }
    const TensorSpec& t = tensors[it->second];
    if (t.dtype != e.spec.dtype || t.shape != e.spec.shape) {
      return refuse(absl::StrCat("tensor '", e.spec.name, "' is ", DTypeName(e.spec.dtype), " ",
                                 ShapeToString(e.spec.shape), " there, and ", DTypeName(t.dtype), " ",
                                 ShapeToString(t.shape), " here (cast with --dtype, or fix the source)"));
    }
    used.insert(it->second);
    if (e.spec.byte_size() == 0) continue;  // nothing to replace
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor bytes, parsed->Read(e));
    const auto at = reinterpret_cast<uintptr_t>(bytes.bytes.data());
    const auto begin = reinterpret_cast<uintptr_t>(record_template.data());
    if (at < begin || at - begin > record_template.size() ||
        bytes.bytes.size() > record_template.size() - (at - begin)) {
      return refuse(absl::StrCat("tensor '", e.spec.name,
                                 "' is not stored as its raw bytes (a Burn <= 0.13 record's {value, shape} layout, "
                                 "bytes written as numbers, or bools of 4 bytes): save the template with Burn 0.14 "
                                 "or later"));
    }
    slots.push_back({static_cast<uint64_t>(at - begin), bytes.bytes.size(), it->second});
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!used.contains(i)) return refuse(absl::StrCat("has no tensor '", tensors[i].name, "'"));
  }
  std::sort(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) { return a.offset < b.offset; });
  WritePlan plan;
  uint64_t pos = slots.empty() ? file.size() : slots.front().offset;
  plan.header = std::string(file.substr(0, pos));
  for (size_t k = 0; k < slots.size(); ++k) {
    const uint64_t end = slots[k].offset + slots[k].size;
    const uint64_t next = k + 1 < slots.size() ? slots[k + 1].offset : file.size();
    if (slots[k].offset < pos || next < end) return refuse("has tensors whose bytes overlap");
    plan.order.push_back(slots[k].input);
    plan.offsets.push_back(slots[k].offset);
    plan.after.emplace_back(file.substr(end, next - end));
    pos = next;
  }
  plan.file_size = file.size();
  return plan;
}

absl::StatusOr<decltype(WriteOptions::plan)> RecordTemplatePlan(const FormatSpec& format,
                                                                const std::string& template_path) {
  if (&format != &kBurnRecordFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("a record template lays out a Burn record (.mpk), not ", format.name, " (--record-template)"));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(template_path));
  return [file, template_path](const std::vector<TensorSpec>& tensors, const Metadata&) {
    return PlanFromRecordTemplate(file->bytes(), template_path, tensors);
  };
}

namespace burn_record_internal {

uint64_t DeriveParamId(absl::string_view tensor_name) { return XXH3_64bits(tensor_name.data(), tensor_name.size()); }

absl::StatusOr<WritePlan> PlanNamedMpk(const std::vector<TensorSpec>& tensors, const Metadata& metadata) {
  RecordPlanner planner(tensors);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (absl::Status s = planner.Add(i); !s.ok()) return s;
  }
  if (absl::Status s = planner.Shape(0); !s.ok()) return s;
  return planner.Emit(RecordMetadata(tensors, metadata));
}

}  // namespace burn_record_internal
}  // namespace weightstore
