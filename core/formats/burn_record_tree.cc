// Burn's self-describing records, MessagePack and JSON: the RecordWalker, and
// the two tokenizers that drive it (msgpack-cxx's visitor API, nlohmann's SAX).
// Neither builds a tree: a pretty JSON record is about 10 times its tensor
// bytes, and a MessagePack bin is kept as a view of the record.
#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <msgpack/unpack.hpp>  // msgpack::parse and the visitor API (parse.hpp alone is incomplete in 4.1)
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/checked_math.h"
#include "core/formats/burn_record_internal.h"
#include "core/utf8.h"

namespace weightstore::burn_record_internal {
namespace {

bool IsTensorField(absl::string_view key) {
  return key == "bytes" || key == "shape" || key == "dtype" || key == "value";
}

}  // namespace

RecordWalker::RecordWalker(SharedBytes base, const OpenOptions& options)
    : base_(std::move(base)), options_(options), budget_(ConvertedBudget(base_.size(), options)) {
  frames_.reserve(kMaxDepth);
}

std::string RecordWalker::NextComponent() {
  Frame& f = frames_.back();
  return f.is_map ? f.key : absl::StrCat(f.count++);
}

std::string RecordWalker::Where() const {
  if (frames_.empty()) return "the record";
  const Frame& f = frames_.back();
  if (f.count == 0) return path_.empty() ? "the record" : path_;
  const std::string component = f.is_map ? f.key : absl::StrCat(f.count - 1);
  return path_.empty() ? component : absl::StrCat(path_, ".", component);
}

bool RecordWalker::Fail(absl::string_view what) {
  if (error_.empty()) error_ = absl::StrCat(Where(), ": ", what);
  return false;
}

bool RecordWalker::Start(bool is_map) {
  if (failed()) return false;
  if (done_) return Fail("a second value follows the record");
  if (frames_.empty()) {
    if (!is_map) return Fail("the record is not a map");
    frames_.push_back(Frame{.kind = Kind::kRoot, .is_map = true, .path_size = 0});
    return true;
  }
  if (frames_.size() >= kMaxDepth) return Fail(absl::StrCat("nesting is deeper than ", kMaxDepth, " levels"));
  const size_t path_size = path_.size();
  const std::string component = NextComponent();
  Frame& top = frames_.back();
  const absl::string_view what = is_map ? "a map" : "an array";
  Kind kind = Kind::kSkip;
  switch (top.kind) {
    case Kind::kRoot:
      if (top.key == "metadata") {
        if (!is_map) return Fail("is an array, not a map of strings");
        kind = Kind::kMetadata;
      } else if (top.key == "item") {
        kind = Kind::kModule;
      }
      break;
    case Kind::kMetadata:
      return Fail(absl::StrCat("is ", what, ", not a string"));
    case Kind::kModule:
      // A Param's fields come in any order: a map under "param" is a tensor
      // or a module, as its first key (or a string "id" beside it) says.
      kind = Kind::kModule;
      if (!top.is_map) break;
      if (top.key == "id") {
        top.id_not_string = std::string(what);
      } else if (top.key == "param") {
        if (is_map) {
          kind = Kind::kParamValue;
        } else if (top.id) {
          return Fail("is an array, not a tensor map");
        } else {
          top.param_not_tensor = std::string(what);
        }
      }
      break;
    case Kind::kParamValue:  // the tokenizer gives a map's key before its value
      return Fail("a map value comes before its key");
    case Kind::kTensor:
      if (is_map && top.key == "dtype") {
        kind = Kind::kDType;
      } else if (!is_map && top.key == "shape") {
        kind = Kind::kShape;
        tensor_->has_shape = true;
      } else if (!is_map && top.key == "bytes") {
        kind = Kind::kBytes;
        tensor_->has_bytes = true;
      } else if (!is_map && top.key == "value") {
        kind = Kind::kValue;
        tensor_->has_value = true;
      } else {
        return Fail(absl::StrCat("is ", what, ", which a tensor's ", top.key, " never is"));
      }
      break;
    case Kind::kShape:
    case Kind::kBytes:
    case Kind::kValue:
      return Fail(absl::StrCat("is ", what, " inside an array of numbers"));
    case Kind::kDType:
      return Fail(absl::StrCat("is ", what, ", not a Bool store name"));
    case Kind::kSkip:
      break;
  }
  absl::StrAppend(&path_, path_.empty() ? "" : ".", component);
  frames_.push_back(Frame{.kind = kind, .is_map = is_map, .path_size = path_size});
  return true;
}

bool RecordWalker::StartMap() { return Start(/*is_map=*/true); }
bool RecordWalker::StartArray() { return Start(/*is_map=*/false); }

void RecordWalker::BeginTensor() {
  tensor_.emplace();
  tensor_->name = std::string(absl::StripPrefix(absl::string_view(path_).substr(0, frames_.back().path_size), "item."));
  tensor_->where = path_;
}

bool RecordWalker::End() {
  if (failed()) return false;
  Frame closed = std::move(frames_.back());
  if (closed.kind == Kind::kParamValue) {  // an empty map: a tensor map only beside a string id
    Frame& param_map = frames_[frames_.size() - 2];
    if (param_map.id) {
      BeginTensor();
      closed.kind = Kind::kTensor;
    } else {
      param_map.param_not_tensor = "an empty map";
    }
  }
  path_.resize(closed.path_size);
  frames_.pop_back();
  // Where() now names the container that closed.
  switch (closed.kind) {
    case Kind::kRoot:
      done_ = true;
      if (!seen_metadata_) return Fail("has no metadata");
      if (!seen_item_) return Fail("has no item");
      return true;
    case Kind::kTensor:
      return FinishTensor();
    case Kind::kDType:
      return tensor_->has_dtype || Fail("is an empty map, not a dtype");
    case Kind::kModule:
      return !closed.is_map || FinishParam(closed);
    default:
      return true;
  }
}

bool RecordWalker::Key(absl::string_view key) {
  if (failed()) return false;
  Frame& f = frames_.back();
  auto fail = [&](absl::string_view what) {
    if (error_.empty()) error_ = absl::StrCat(path_.empty() ? "the record" : path_, ": ", what);
    return false;
  };
  if (!IsValidUtf8(key)) return fail("a key is not valid UTF-8");
  if (!f.keys.insert(std::string(key)).second) return fail(absl::StrCat("the key '", key, "' appears twice"));
  ++f.count;
  f.key = std::string(key);
  if (f.kind == Kind::kParamValue) {
    // A tensor map's first key is one of its fields; beside a string id,
    // "param" is a tensor map whatever its keys (and unknown ones are refused).
    Frame& param_map = frames_[frames_.size() - 2];
    if (param_map.id || IsTensorField(key)) {
      f.kind = Kind::kTensor;
      BeginTensor();
    } else {
      f.kind = Kind::kModule;
      param_map.param_not_tensor = "a map that is not a tensor map";
    }
  }
  switch (f.kind) {
    case Kind::kRoot:
      seen_metadata_ |= key == "metadata";
      seen_item_ |= key == "item";
      return true;
    case Kind::kModule:  // unknown keys beside a Param's id and param are read, as serde ignores them
      return true;
    case Kind::kTensor:
      if (IsTensorField(key)) return true;
      return fail(
          absl::StrCat("unknown tensor field '", key, "' (Burn writes bytes, shape, dtype; <= 0.13: value, shape)"));
    case Kind::kDType:
      if (key == "QFloat") {
        error_ = absl::StrCat(tensor_->where, ": tensor '", tensor_->name,
                              "' is quantized (QFloat), which is not supported");
        return false;
      }
      if (key != "Bool" || f.count > 1) return fail(absl::StrCat("unknown dtype variant '", key, "'"));
      return true;
    default:
      return true;
  }
}

bool RecordWalker::Scalar(absl::string_view what) {
  Frame& f = frames_.back();
  switch (f.kind) {
    case Kind::kRoot:
      return f.key != "metadata" || Fail(absl::StrCat("is ", what, ", not a map of strings"));
    case Kind::kMetadata:
      return Fail(absl::StrCat("is ", what, ", not a string"));
    case Kind::kModule:  // constants and plain scalars of custom records are skipped
      if (!f.is_map) return true;
      if (f.key == "param") {
        if (f.id) return Fail(absl::StrCat("is ", what, ", not a tensor map"));
        f.param_not_tensor = std::string(what);
      } else if (f.key == "id") {
        f.id_not_string = std::string(what);
      }
      return true;
    case Kind::kParamValue:
      return Fail("a map value comes before its key");
    case Kind::kSkip:
      return true;
    case Kind::kTensor:
      return Fail(absl::StrCat("is ", what, ", which a tensor's ", f.key, " never is"));
    case Kind::kShape:
      return Fail(absl::StrCat("is ", what, ", not a dimension (a non-negative integer)"));
    case Kind::kBytes:
      return Fail(absl::StrCat("is ", what, ", not a byte (an integer from 0 to 255)"));
    case Kind::kValue:
      return Fail(absl::StrCat("is ", what, ", not a tensor element"));
    case Kind::kDType:
      return Fail(absl::StrCat("is ", what, ", not a Bool store name"));
  }
  return false;
}

// Each scalar first takes its path component; outside the root map there is none.
bool RecordWalker::BeginScalar() {
  if (failed()) return false;
  if (frames_.empty()) return Fail(done_ ? "a second value follows the record" : "the record is not a map");
  NextComponent();
  return true;
}

bool RecordWalker::Nil() {
  if (!BeginScalar()) return false;
  if (frames_.back().kind == Kind::kValue) {
    return Fail("is null: serde_json writes NaN and infinities so, and Burn cannot load them either");
  }
  return Scalar("null");
}

bool RecordWalker::Bool(bool value) {
  if (!BeginScalar()) return false;
  if (frames_.back().kind == Kind::kValue) return Value(ValueKind::kBool, value, 0, 0);
  return Scalar("a boolean");
}

bool RecordWalker::Uint(uint64_t value) {
  if (!BeginScalar()) return false;
  switch (frames_.back().kind) {
    case Kind::kShape:
      return Dimension(value);
    case Kind::kBytes:
      return Byte(value);
    case Kind::kValue:
      return Value(ValueKind::kInteger, value, 0, 0);
    default:
      return Scalar("an integer");
  }
}

bool RecordWalker::Int(int64_t value) {
  if (value >= 0) return Uint(static_cast<uint64_t>(value));
  if (!BeginScalar()) return false;
  if (frames_.back().kind == Kind::kValue) return Value(ValueKind::kInteger, 0, value, 0);
  return Scalar("a negative integer");
}

bool RecordWalker::Float(double value, int bits) {
  if (!BeginScalar()) return false;
  if (frames_.back().kind != Kind::kValue) return Scalar("a float");
  return Value(bits == 64 ? ValueKind::kFloat64 : ValueKind::kFloatText, 0, 0, value);
}

bool RecordWalker::Float32(uint32_t bits) {
  if (!BeginScalar()) return false;
  if (frames_.back().kind != Kind::kValue) return Scalar("a float");
  return Value(ValueKind::kFloat32, bits, 0, 0);
}

bool RecordWalker::Str(absl::string_view value) {
  if (!BeginScalar()) return false;
  if (!IsValidUtf8(value)) return Fail("is a string that is not valid UTF-8");
  Frame& f = frames_.back();
  switch (f.kind) {
    case Kind::kMetadata:
      record_.metadata[f.key] = std::string(value);
      return true;
    case Kind::kModule:
      if (f.is_map && f.key == "id") {
        f.id = std::string(value);
        return true;
      }
      break;
    case Kind::kTensor:
      if (f.key == "dtype") return ParseDTypeName(value);
      break;
    case Kind::kDType:
      return BoolStore(value);
    default:
      break;
  }
  return Scalar("a string");
}

bool RecordWalker::Bin(absl::string_view value) {
  if (!BeginScalar()) return false;
  const Frame& f = frames_.back();
  if (f.kind != Kind::kTensor || f.key != "bytes") return Scalar("binary data");
  tensor_->has_bytes = true;
  tensor_->view = base_.Subspan(static_cast<size_t>(value.data() - base_.view().data()), value.size());
  return true;
}

bool RecordWalker::Dimension(uint64_t value) {
  if (tensor_->shape.size() >= kMaxRank) return Fail(absl::StrCat("the shape has more than ", kMaxRank, " dimensions"));
  tensor_->shape.push_back(value);
  return true;
}

bool RecordWalker::Byte(uint64_t value) {
  if (value > 255) return Fail(absl::StrCat("is ", value, ", not a byte (an integer from 0 to 255)"));
  return Append(value, 1, "bytes");
}

bool RecordWalker::Append(uint64_t bits, int bytes, absl::string_view field) {
  std::vector<std::byte>& data = tensor_->data;
  const uint64_t n = static_cast<uint64_t>(bytes);
  if (n > budget_ - converted_) {  // converted_ <= budget_ always
    if (error_.empty()) {
      error_ = absl::StrCat(tensor_->where, ".", field, ": converting it takes more than the ", budget_,
                            " bytes this record's converted tensors may take in all (2 x its ", base_.size(),
                            " bytes + 64 MiB, at most OpenOptions::max_record_inflated_bytes, ",
                            options_.max_record_inflated_bytes, ")");
    }
    return false;
  }
  if (data.size() + n > data.capacity()) {
    // Geometric growth, but never past what the budget leaves this buffer.
    const uint64_t room = budget_ - (converted_ - data.size());
    const uint64_t grown = std::max<uint64_t>({data.capacity() * 2, data.size() + n, 64});
    data.reserve(static_cast<size_t>(std::min(grown, room)));
  }
  for (int i = 0; i < bytes; ++i) data.push_back(static_cast<std::byte>(bits >> (8 * i)));
  converted_ += n;
  return true;
}

bool RecordWalker::ParseDTypeName(absl::string_view name) {
  static constexpr std::pair<absl::string_view, DType> kNames[] = {
      {"F64", DType::kF64},   {"F32", DType::kF32},  {"Flex32", DType::kF32}, {"F16", DType::kF16},
      {"BF16", DType::kBF16}, {"I64", DType::kI64},  {"I32", DType::kI32},    {"I16", DType::kI16},
      {"I8", DType::kI8},     {"U64", DType::kU64},  {"U32", DType::kU32},    {"U16", DType::kU16},
      {"U8", DType::kU8},     {"Bool", DType::kBool}};  // "Bool" before Burn 0.21's Bool(BoolStore)
  for (const auto& [n, dtype] : kNames) {
    if (n == name) {
      tensor_->dtype = RecordDType{.dtype = dtype};
      tensor_->has_dtype = true;
      return true;
    }
  }
  return Fail(absl::StrCat("unknown dtype '", name, "'"));
}

bool RecordWalker::BoolStore(absl::string_view store) {
  if (store != "Native" && store != "U8" && store != "U32") {
    return Fail(absl::StrCat("unknown Bool store '", store, "' (Native, U8 or U32)"));
  }
  tensor_->dtype = RecordDType{.dtype = DType::kBool, .bool_bytes = store == "U32" ? 4u : 1u};
  tensor_->has_dtype = true;
  return true;
}

// A <= 0.13 tensor has no dtype: its first element's kind and the record's
// element types (metadata "float" and "int") give it. Floats are F32 or F64
// (MessagePack says which; JSON leaves it to "float", or to "int" for <= 0.11
// Full records, whose ints were f32). Integers are f16 bits in a Half record,
// else the "int" type: a Half record's i16 tensor cannot be told from f16 bits,
// and reads as F16.
bool RecordWalker::StartValues(ValueKind element) {
  auto text = [&](const char* key) -> std::string {
    auto it = record_.metadata.find(key);
    return it == record_.metadata.end() ? "" : it->second;
  };
  const std::optional<DType> float_type = ElementDType(text("float")), int_type = ElementDType(text("int"));
  std::optional<DType> dtype;
  switch (element) {
    case ValueKind::kFloat32:
      dtype = DType::kF32;
      break;
    case ValueKind::kFloat64:
      dtype = DType::kF64;
      break;
    case ValueKind::kFloatText:
      if (float_type == DType::kF64 || float_type == DType::kF32) {
        dtype = float_type;
      } else if (int_type == DType::kF32) {
        dtype = DType::kF32;
      }
      break;
    case ValueKind::kInteger:
      if (float_type == DType::kF16) {
        dtype = DType::kF16;
      } else if (int_type == DType::kI16 || int_type == DType::kI32 || int_type == DType::kI64) {
        dtype = int_type;
      }
      break;
    case ValueKind::kBool:
      dtype = DType::kBool;
      break;
    case ValueKind::kNone:
      break;
  }
  if (!dtype) {
    return Fail(absl::StrCat("a <= 0.13 value of this kind does not fit the record's element types (metadata float '",
                             text("float"), "', int '", text("int"), "')"));
  }
  tensor_->element = element;
  tensor_->dtype = RecordDType{.dtype = *dtype};
  return true;
}

bool RecordWalker::Value(ValueKind element, uint64_t u, int64_t i, double f) {
  PendingTensor& t = *tensor_;
  if (t.element == ValueKind::kNone) {
    if (!StartValues(element)) return false;
  } else if (element != t.element) {
    return Fail("mixes element types (every value of a tensor has one type)");
  }
  const bool negative = element == ValueKind::kInteger && i < 0;
  auto range = [&](int64_t lo, int64_t hi) { return negative ? i >= lo : u <= static_cast<uint64_t>(hi); };
  const uint64_t integer = negative ? static_cast<uint64_t>(i) : u;
  bool appended = false;
  switch (t.dtype.dtype) {
    case DType::kF32:
      if (element == ValueKind::kFloat32) {  // MessagePack f32: its bits, as they are
        appended = Append(u, 4, "value");
        break;
      }
      if (element == ValueKind::kFloatText && std::fabs(f) > FLT_MAX) return Fail("is out of the f32 range");
      appended = Append(std::bit_cast<uint32_t>(static_cast<float>(f)), 4, "value");
      break;
    case DType::kF64:
      appended = Append(std::bit_cast<uint64_t>(f), 8, "value");
      break;
    case DType::kF16:
      if (negative || u > 0xFFFF) return Fail("is not f16 bits (an integer from 0 to 65535)");
      appended = Append(u, 2, "value");
      break;
    case DType::kI16:
      if (!range(INT16_MIN, INT16_MAX)) return Fail("is out of the i16 range");
      appended = Append(integer, 2, "value");
      break;
    case DType::kI32:
      if (!range(INT32_MIN, INT32_MAX)) return Fail("is out of the i32 range");
      appended = Append(integer, 4, "value");
      break;
    case DType::kI64:
      if (!range(INT64_MIN, INT64_MAX)) return Fail("is out of the i64 range");
      appended = Append(integer, 8, "value");
      break;
    case DType::kBool:
      appended = Append(u, 1, "value");
      break;
    default:
      return Fail("has an element type no <= 0.13 record has");
  }
  if (!appended) return false;
  ++t.values;
  return true;
}

bool RecordWalker::FinishTensor() {
  PendingTensor t = std::move(*tensor_);
  tensor_.reset();
  auto fail = [&](absl::string_view what) {
    if (error_.empty()) error_ = absl::StrCat(t.where, ": ", what);
    return false;
  };
  SharedBytes bytes;
  if (t.has_value) {
    if (t.has_bytes || t.has_dtype) {
      return fail("mixes the <= 0.13 {value, shape} and >= 0.14 {bytes, shape, dtype} layouts");
    }
    if (!t.has_shape) return fail("has a value but no shape");
    if (t.element == ValueKind::kNone) {  // no values: the record's float type
      auto it = record_.metadata.find("float");
      t.dtype.dtype = ElementDType(it == record_.metadata.end() ? "" : it->second).value_or(DType::kF32);
    }
    const std::optional<uint64_t> numel = CheckedNumElements(t.shape);
    if (!numel || *numel != t.values) {
      return fail(absl::StrCat("holds ", t.values, " values, but its shape ", ShapeToString(t.shape), " has ",
                               numel ? absl::StrCat(*numel) : "too many", " elements"));
    }
    bytes = SharedBytes::FromVector(std::move(t.data));
  } else {
    if (!t.has_bytes || !t.has_shape || !t.has_dtype) {
      return fail("has neither {bytes, shape, dtype} (Burn >= 0.14) nor {value, shape} (Burn <= 0.13)");
    }
    bytes = t.data.empty() ? t.view : SharedBytes::FromVector(std::move(t.data));
  }
  if (tensors_ >= options_.max_tensors) {
    return fail(absl::StrCat("the record holds more than ", options_.max_tensors, " tensors"));
  }
  ++tensors_;
  absl::StatusOr<CheckpointEntry> entry =
      MakeEntry(std::move(t.name), std::nullopt, t.dtype, std::move(t.shape), std::move(bytes), t.where, options_);
  if (!entry.ok()) {
    if (error_.empty()) error_ = std::string(entry.status().message());
    return false;
  }
  frames_.back().param = *std::move(entry);  // the Param map, whose id may come after
  return true;
}

// serde-derive reads ParamSerde {id: String, param} from a map in any order,
// ignoring unknown keys, and fails on a missing or non-string id: so does
// this. A tensor map is never dropped silently.
bool RecordWalker::FinishParam(Frame& closed) {
  if (!closed.param) {
    if (closed.id && !closed.param_not_tensor.empty()) {
      error_ = absl::StrCat(Where(), ".param: is ", closed.param_not_tensor, " beside a string id, not a tensor map");
      return false;
    }
    return true;
  }
  if (!closed.id_not_string.empty()) {
    error_ = absl::StrCat(Where(), ".id: is ", closed.id_not_string,
                          ", not a string (a Param's id, beside its tensor map 'param')");
    return false;
  }
  if (!closed.id) return Fail("a Param's tensor map 'param' has no 'id' beside it");
  closed.param->spec.param_id = DecodeBurnParamId(*closed.id);
  record_.entries.push_back(*std::move(closed.param));
  return true;
}

namespace {

// msgpack-cxx's parse visitor: every event goes to the walker, which checks
// what the parser does not (depth, keys, UTF-8). The parser itself checks that
// each str and bin lies inside the input before visiting it, refuses 0xc1 as
// a parse error, and allocates nothing by a length the input claims (array
// and map counts only bound its loops).
class MsgpackTokens {
 public:
  explicit MsgpackTokens(RecordWalker* walker) : w_(walker) {}

  bool visit_nil() { return Value() && w_->Nil(); }
  bool visit_boolean(bool v) { return Value() && w_->Bool(v); }
  bool visit_positive_integer(uint64_t v) { return Value() && w_->Uint(v); }
  bool visit_negative_integer(int64_t v) { return Value() && w_->Int(v); }
  // The parser loads an f32's bits into a float without converting it.
  bool visit_float32(float v) { return Value() && w_->Float32(std::bit_cast<uint32_t>(v)); }
  bool visit_float64(double v) { return Value() && w_->Float(v, 64); }
  bool visit_str(const char* v, uint32_t size) {
    const absl::string_view s(size == 0 ? "" : v, size);
    return in_key_ ? w_->Key(s) : w_->Str(s);
  }
  // `v` points into the input even for an empty bin (at its length).
  bool visit_bin(const char* v, uint32_t size) { return Value() && w_->Bin(absl::string_view(v, size)); }
  bool visit_ext(const char*, uint32_t) { return w_->Fail("is a MessagePack ext value, which Burn never writes"); }
  bool start_array(uint32_t) { return Value() && w_->StartArray(); }
  bool start_array_item() { return true; }
  bool end_array_item() { return true; }
  bool end_array() { return w_->EndArray(); }
  bool start_map(uint32_t) { return Value() && w_->StartMap(); }
  bool start_map_key() {
    in_key_ = true;
    return true;
  }
  bool end_map_key() {
    in_key_ = false;
    return true;
  }
  bool start_map_value() { return true; }
  bool end_map_value() { return true; }
  bool end_map() { return w_->EndMap(); }
  void parse_error(size_t, size_t offset) {
    w_->Fail(absl::StrCat("invalid MessagePack marker at byte ", offset, " (0xc1 is reserved)"));
  }
  void insufficient_bytes(size_t, size_t) {
    w_->Fail("the record ends inside this value (truncated, or a length runs past the end)");
  }
  bool referenced() const { return false; }
  void set_referenced(bool) {}

 private:
  // A value where a map key belongs: Burn's maps are keyed by strings.
  bool Value() { return !in_key_ || w_->Fail("a map key is not a string"); }

  RecordWalker* w_;
  bool in_key_ = false;
};

// nlohmann's SAX interface over the walker. nlohmann checks JSON syntax and
// UTF-8; its messages quote the file, so only the position is reported.
class JsonTokens {
 public:
  explicit JsonTokens(RecordWalker* walker) : w_(walker) {}

  bool null() { return w_->Nil(); }
  bool boolean(bool v) { return w_->Bool(v); }
  bool number_integer(int64_t v) { return w_->Int(v); }
  bool number_unsigned(uint64_t v) { return w_->Uint(v); }
  bool number_float(double v, const std::string&) { return w_->Float(v, 0); }
  bool string(std::string& v) { return w_->Str(v); }
  bool binary(nlohmann::json::binary_t&) { return w_->Fail("is binary, which JSON text never holds"); }
  bool start_object(size_t) { return w_->StartMap(); }
  bool key(std::string& k) { return w_->Key(k); }
  bool end_object() { return w_->EndMap(); }
  bool start_array(size_t) { return w_->StartArray(); }
  bool end_array() { return w_->EndArray(); }
  bool parse_error(size_t position, const std::string&, const nlohmann::json::exception&) {
    w_->Fail(absl::StrCat("invalid JSON at byte ", position));
    return false;
  }

 private:
  RecordWalker* w_;
};

}  // namespace

absl::Status WalkMsgpack(absl::string_view data, RecordWalker* walker) {
  MsgpackTokens tokens(walker);
  size_t offset = 0;
  const bool parsed = msgpack::parse(data.data(), data.size(), offset, tokens);
  if (walker->failed()) {
    return absl::InvalidArgumentError(absl::StrCat(walker->error(), " (MessagePack byte ", offset, ")"));
  }
  if (!parsed || !walker->done()) {
    return absl::InvalidArgumentError(absl::StrCat("invalid MessagePack at byte ", offset));
  }
  if (offset != data.size()) {
    return absl::InvalidArgumentError(absl::StrCat(data.size() - offset, " bytes follow the record"));
  }
  return absl::OkStatus();
}

absl::Status WalkJson(absl::string_view data, RecordWalker* walker) {
  JsonTokens tokens(walker);
  const bool parsed = nlohmann::json::sax_parse(data.begin(), data.end(), &tokens, nlohmann::json::input_format_t::json,
                                                /*strict=*/true);
  if (walker->failed()) return absl::InvalidArgumentError(walker->error());
  if (!parsed || !walker->done()) return absl::InvalidArgumentError("invalid JSON");
  return absl::OkStatus();
}

}  // namespace weightstore::burn_record_internal
