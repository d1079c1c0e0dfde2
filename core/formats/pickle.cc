#include "core/formats/pickle.h"

#include <cmath>
#include <cstring>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/formats/byte_reader.h"
#include "core/utf8.h"

namespace weightstore {
namespace {

using Kind = PickleValue::Kind;

struct GlobalInfo {
  PickleGlobal kind;
  DType dtype = DType::kU8;
  bool untyped = false;
  bool unsupported = false;     // a dtype read as a name only: a tensor of it is refused, naming it
  const char* holds = nullptr;  // an unsupported storage class: the dtype it holds
};

const std::map<std::string, GlobalInfo, std::less<>>& AllowedGlobals() {
  static const auto* globals = [] {
    auto* m = new std::map<std::string, GlobalInfo, std::less<>>{
        {"collections.OrderedDict", {PickleGlobal::kOrderedDict}},
        {"torch._utils._rebuild_tensor", {PickleGlobal::kRebuildTensor}},
        {"torch._utils._rebuild_tensor_v2", {PickleGlobal::kRebuildTensorV2}},
        {"torch._utils._rebuild_tensor_v3", {PickleGlobal::kRebuildTensorV3}},
        {"torch._utils._rebuild_qtensor", {PickleGlobal::kRebuildQTensor}},
        {"torch.per_tensor_affine", {PickleGlobal::kInert}},
        {"torch.per_channel_affine", {PickleGlobal::kInert}},
        {"torch.per_tensor_symmetric", {PickleGlobal::kInert}},
        {"torch.per_channel_symmetric", {PickleGlobal::kInert}},
        {"torch.per_channel_affine_float_qparams", {PickleGlobal::kInert}},
        {"torch._utils._rebuild_parameter", {PickleGlobal::kRebuildParameter}},
        {"torch._utils._rebuild_parameter_with_state", {PickleGlobal::kRebuildParameterWithState}},
        {"torch._tensor._rebuild_from_type_v2", {PickleGlobal::kRebuildFromTypeV2}},
        {"torch.Tensor", {PickleGlobal::kTensorClass}},
        {"torch.nn.parameter.Parameter", {PickleGlobal::kTensorClass}},
        {"torch.Size", {PickleGlobal::kTorchSize}},
        {"_codecs.encode", {PickleGlobal::kCodecsEncode}},
        {"builtins.set", {PickleGlobal::kSet}},
        {"builtins.frozenset", {PickleGlobal::kSet}},
        {"__builtin__.set", {PickleGlobal::kSet}},
        {"builtins.bytearray", {PickleGlobal::kBytearray}},
        {"torch.UntypedStorage", {PickleGlobal::kStorageClass, DType::kU8, true}},
        // torch 2.x pickles the storages of its newer dtypes (uint16-64, float8)
        // under the class's module path.
        {"torch.storage.UntypedStorage", {PickleGlobal::kStorageClass, DType::kU8, true}},
    };
    const std::pair<const char*, DType> storages[] = {
        {"FloatStorage", DType::kF32},     {"DoubleStorage", DType::kF64},       {"HalfStorage", DType::kF16},
        {"BFloat16Storage", DType::kBF16}, {"LongStorage", DType::kI64},         {"IntStorage", DType::kI32},
        {"ShortStorage", DType::kI16},     {"CharStorage", DType::kI8},          {"ByteStorage", DType::kU8},
        {"BoolStorage", DType::kBool},     {"ComplexFloatStorage", DType::kC64},
    };
    for (auto [name, dtype] : storages) (*m)[absl::StrCat("torch.", name)] = {PickleGlobal::kStorageClass, dtype};
    // Storage classes of dtypes weightstore does not read, and the dtype each
    // holds (what a refusal names).
    const std::pair<const char*, const char*> other_storages[] = {{"ComplexDoubleStorage", "complex128"},
                                                                  {"ComplexHalfStorage", "complex32"},
                                                                  {"QInt8Storage", "qint8"},
                                                                  {"QUInt8Storage", "quint8"},
                                                                  {"QInt32Storage", "qint32"},
                                                                  {"QUInt4x2Storage", "quint4x2"},
                                                                  {"QUInt2x4Storage", "quint2x4"}};
    for (auto [name, dtype] : other_storages) {
      (*m)[absl::StrCat("torch.", name)] = {PickleGlobal::kStorageClass, DType::kU8, false, true, dtype};
    }
    const std::pair<const char*, DType> dtypes[] = {
        {"float32", DType::kF32},
        {"float", DType::kF32},
        {"float64", DType::kF64},
        {"double", DType::kF64},
        {"float16", DType::kF16},
        {"half", DType::kF16},
        {"bfloat16", DType::kBF16},
        {"int64", DType::kI64},
        {"long", DType::kI64},
        {"int32", DType::kI32},
        {"int", DType::kI32},
        {"int16", DType::kI16},
        {"short", DType::kI16},
        {"int8", DType::kI8},
        {"uint8", DType::kU8},
        {"bool", DType::kBool},
        {"uint16", DType::kU16},
        {"uint32", DType::kU32},
        {"uint64", DType::kU64},
        {"float8_e4m3fn", DType::kF8E4M3},
        {"float8_e5m2", DType::kF8E5M2},
        {"float8_e4m3fnuz", DType::kF8E4M3FNUZ},
        {"float8_e5m2fnuz", DType::kF8E5M2FNUZ},
        {"float8_e8m0fnu", DType::kF8E8M0},
        {"float4_e2m1fn_x2", DType::kF4},  // a byte of two: PyTorchReader doubles the last dimension
        {"complex64", DType::kC64},
        {"cfloat", DType::kC64},
    };
    for (auto [name, dtype] : dtypes) (*m)[absl::StrCat("torch.", name)] = {PickleGlobal::kDTypeObject, dtype};
    // torch's other dtypes, known by name so that a tensor of one is refused
    // naming it, rather than the file for an unknown global.
    for (const char* name :
         {"complex128", "cdouble", "complex32", "chalf", "bits1x8", "bits2x4", "bits4x2",  "bits8",   "bits16", "uint1",
          "uint2",      "uint3",   "uint4",     "uint5", "uint6",   "uint7",   "int1",     "int2",    "int3",   "int4",
          "int5",       "int6",    "int7",      "qint8", "quint8",  "qint32",  "quint4x2", "quint2x4"}) {
      (*m)[absl::StrCat("torch.", name)] = {PickleGlobal::kDTypeObject, DType::kU8, false, true};
    }
    // Legacy tensor type names (TAR checkpoints record them per tensor).
    for (const char* name : {"FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor", "IntTensor",
                             "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor"}) {
      (*m)[absl::StrCat("torch.", name)] = {PickleGlobal::kTensorClass};
    }
    return m;
  }();
  return *globals;
}

}  // namespace

class PickleMachine {
 public:
  PickleMachine(absl::string_view data, absl::string_view what, const PickleLimits& limits)
      : in_(data), what_(what), limits_(limits), result_(new PickleResult()) {}

  absl::StatusOr<std::unique_ptr<PickleResult>> Run(size_t* consumed);

 private:
  absl::Status Error(absl::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat("pickle in ", what_, " at byte ", op_pos_, ": ", message));
  }
  absl::StatusOr<PickleValue*> New(Kind kind) {
    if (result_->values_.size() >= limits_.max_values) return Error("too many values");
    PickleValue& v = result_->values_.emplace_back();
    v.kind = kind;
    return &v;
  }
  absl::Status Push(Kind kind, PickleValue** out = nullptr) {
    auto v = New(kind);
    if (!v.ok()) return v.status();
    stack_.push_back(*v);
    if (out) *out = *v;
    return absl::OkStatus();
  }
  absl::StatusOr<const PickleValue*> Pop() {
    if (stack_.size() <= mark_floor()) return Error("stack underflow");
    const PickleValue* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  size_t mark_floor() const { return marks_.empty() ? 0 : marks_.back(); }
  absl::StatusOr<std::vector<const PickleValue*>> PopMark() {
    if (marks_.empty()) return Error("no MARK on the stack");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<const PickleValue*> items(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return items;
  }
  absl::Status ReadLine(std::string* out) {
    ByteReader probe = in_;
    absl::string_view window;
    probe.ReadBytes(probe.remaining(), &window);
    size_t nl = window.find('\n');
    if (nl == absl::string_view::npos) return Error("unterminated text argument");
    if (nl > limits_.max_string) return Error("text argument too long");
    absl::string_view line;
    in_.ReadBytes(nl + 1, &line);
    *out = std::string(line.substr(0, nl));
    if (!out->empty() && out->back() == '\r') out->pop_back();
    return absl::OkStatus();
  }
  absl::Status ReadString(uint64_t n, std::string* out) {
    if (n > limits_.max_string) return Error(absl::StrCat("string of ", n, " bytes exceeds the limit"));
    absl::string_view bytes;
    if (!in_.ReadBytes(n, &bytes)) return Error("truncated string");
    *out = std::string(bytes);
    return absl::OkStatus();
  }
  absl::Status PushString(Kind kind, std::string s) {
    if (kind == Kind::kString && !IsValidUtf8(s)) return Error("string is not valid UTF-8");
    PickleValue* v;
    if (auto st = Push(kind, &v); !st.ok()) return st;
    v->s = std::move(s);
    return absl::OkStatus();
  }
  absl::Status PushInt(int64_t i) {
    PickleValue* v;
    if (auto st = Push(Kind::kInt, &v); !st.ok()) return st;
    v->i = i;
    return absl::OkStatus();
  }
  absl::Status PushGlobal(absl::string_view module, absl::string_view name);
  absl::Status Memoize(uint64_t index) {
    if (stack_.size() <= mark_floor()) return Error("memoize with an empty stack");
    if (!memo_.contains(index) && memo_.size() >= limits_.max_memo) return Error("memo too large");
    memo_[index] = stack_.back();
    return absl::OkStatus();
  }
  absl::Status Recall(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Error(absl::StrCat("memo index ", index, " was never stored"));
    stack_.push_back(it->second);
    return absl::OkStatus();
  }
  absl::Status SetItems(std::vector<const PickleValue*> kv);
  absl::Status Append(std::vector<const PickleValue*> items);
  absl::Status Reduce(const PickleValue* callable, const PickleValue* args);
  absl::Status Call(const PickleValue* callable, const std::vector<const PickleValue*>& args, const PickleValue** out);
  absl::StatusOr<const PickleValue*> MakeTensor(PickleGlobal kind, const std::vector<const PickleValue*>& args);
  absl::Status PersistentId(const PickleValue* pid);

  ByteReader in_;
  std::string what_;
  PickleLimits limits_;
  std::unique_ptr<PickleResult> result_;
  std::vector<const PickleValue*> stack_;
  std::vector<size_t> marks_;
  absl::flat_hash_map<uint64_t, const PickleValue*> memo_;
  size_t op_pos_ = 0;
};

absl::Status PickleMachine::PushGlobal(absl::string_view module, absl::string_view name) {
  std::string full = absl::StrCat(module, ".", name);
  auto it = AllowedGlobals().find(full);
  if (it == AllowedGlobals().end()) {
    return Error(absl::StrCat("global '", full,
                              "' is not on the allow-list; weightstore reads weights only and "
                              "never runs code from a checkpoint"));
  }
  PickleValue* v;
  if (auto st = Push(Kind::kGlobal, &v); !st.ok()) return st;
  v->global = it->second.kind;
  v->global_name = std::move(full);
  v->global_dtype = it->second.dtype;
  v->global_untyped = it->second.untyped;
  v->global_unsupported = it->second.unsupported;
  if (it->second.holds != nullptr) v->global_name = absl::StrCat("torch.", it->second.holds);  // what refusals name
  return absl::OkStatus();
}

absl::Status PickleMachine::SetItems(std::vector<const PickleValue*> kv) {
  auto dict_or = Pop();
  if (!dict_or.ok()) return dict_or.status();
  // Values are immutable once created except through these opcodes, which only
  // ever target a dict created by this machine.
  PickleValue* dict = const_cast<PickleValue*>(*dict_or);
  if (dict->kind != Kind::kDict) return Error("SETITEM on a value that is not a dict");
  if (kv.size() % 2 != 0) return Error("SETITEMS with an odd number of values");
  for (size_t i = 0; i < kv.size(); i += 2) {
    const PickleValue* key = kv[i];
    if (key->kind != Kind::kString && key->kind != Kind::kInt && key->kind != Kind::kBytes) {
      return Error("dict key is not a string or an integer");
    }
    // Appended in order; a repeated key is resolved when the dict is read (the
    // last value wins, as in Python), which keeps SETITEMS linear.
    dict->dict.emplace_back(key, kv[i + 1]);
  }
  stack_.push_back(dict);
  return absl::OkStatus();
}

absl::Status PickleMachine::Append(std::vector<const PickleValue*> items) {
  auto list_or = Pop();
  if (!list_or.ok()) return list_or.status();
  PickleValue* list = const_cast<PickleValue*>(*list_or);
  if (list->kind != Kind::kList) return Error("APPEND on a value that is not a list");
  list->items.insert(list->items.end(), items.begin(), items.end());
  stack_.push_back(list);
  return absl::OkStatus();
}

namespace {

bool ToUint(const PickleValue* v, uint64_t* out) {
  if (v->kind != Kind::kInt || v->i < 0) return false;
  *out = static_cast<uint64_t>(v->i);
  return true;
}

bool ToUintVector(const PickleValue* v, std::vector<uint64_t>* out) {
  if (v->kind != Kind::kTuple && v->kind != Kind::kList) return false;
  if (v->items.size() > 64) return false;
  for (const PickleValue* item : v->items) {
    uint64_t u;
    if (!ToUint(item, &u)) return false;
    out->push_back(u);
  }
  return true;
}

}  // namespace

absl::StatusOr<const PickleValue*> PickleMachine::MakeTensor(PickleGlobal kind,
                                                             const std::vector<const PickleValue*>& args) {
  const size_t min_args = kind == PickleGlobal::kRebuildTensor ? 4 : kind == PickleGlobal::kRebuildTensorV3 ? 7 : 6;
  if (args.size() < min_args) return Error(absl::StrCat("tensor rebuild with ", args.size(), " arguments"));
  if (args[0]->kind != Kind::kStorage) return Error("tensor rebuild without a storage");
  auto v = New(Kind::kTensor);
  if (!v.ok()) return v.status();
  PickleTensor& t = (*v)->tensor;
  t.storage = args[0];
  if (!ToUint(args[1], &t.storage_offset)) return Error("tensor storage offset is not a non-negative integer");
  if (!ToUintVector(args[2], &t.shape)) return Error("tensor size is not a tuple of non-negative integers");
  if (!ToUintVector(args[3], &t.strides)) return Error("tensor stride is not a tuple of non-negative integers");
  if (t.shape.size() != t.strides.size()) return Error("tensor size and stride have different ranks");
  if (kind == PickleGlobal::kRebuildTensorV3) {
    if (args[6]->kind != Kind::kGlobal || args[6]->global != PickleGlobal::kDTypeObject) {
      return Error("_rebuild_tensor_v3 without a dtype");
    }
    t.dtype = args[6]->global_dtype;
    if (args[6]->global_unsupported) t.unsupported_dtype = args[6]->global_name;
  }
  return *v;
}

absl::Status PickleMachine::Call(const PickleValue* callable, const std::vector<const PickleValue*>& args,
                                 const PickleValue** out) {
  if (callable->kind != Kind::kGlobal) return Error("REDUCE on a value that is not a global");
  switch (callable->global) {
    case PickleGlobal::kOrderedDict: {
      auto dict = New(Kind::kDict);
      if (!dict.ok()) return dict.status();
      *out = *dict;
      if (args.empty()) return absl::OkStatus();
      if (args.size() != 1 || (args[0]->kind != Kind::kList && args[0]->kind != Kind::kTuple)) {
        return Error("OrderedDict() takes a list of pairs");
      }
      std::vector<const PickleValue*> kv;
      for (const PickleValue* pair : args[0]->items) {
        if ((pair->kind != Kind::kTuple && pair->kind != Kind::kList) || pair->items.size() != 2) {
          return Error("OrderedDict() item is not a pair");
        }
        kv.push_back(pair->items[0]);
        kv.push_back(pair->items[1]);
      }
      stack_.push_back(*dict);
      if (auto st = SetItems(std::move(kv)); !st.ok()) return st;
      stack_.pop_back();
      return absl::OkStatus();
    }
    case PickleGlobal::kRebuildTensor:
    case PickleGlobal::kRebuildTensorV2:
    case PickleGlobal::kRebuildTensorV3: {
      auto t = MakeTensor(callable->global, args);
      if (!t.ok()) return t.status();
      *out = *t;
      return absl::OkStatus();
    }
    case PickleGlobal::kRebuildQTensor: {  // (storage, offset, size, stride, quantizer, ...)
      auto t = MakeTensor(PickleGlobal::kRebuildTensor, args);
      if (!t.ok()) return t.status();
      *out = *t;
      return absl::OkStatus();
    }
    case PickleGlobal::kRebuildParameter:
    case PickleGlobal::kRebuildParameterWithState:
      if (args.empty() || args[0]->kind != Kind::kTensor) return Error("parameter rebuild without a tensor");
      *out = args[0];
      return absl::OkStatus();
    case PickleGlobal::kRebuildFromTypeV2: {
      // (func, new_type, args, state): only plain tensor types are accepted.
      if (args.size() < 3 || args[1]->kind != Kind::kGlobal || args[1]->global != PickleGlobal::kTensorClass ||
          args[2]->kind != Kind::kTuple) {
        return Error("_rebuild_from_type_v2 of an unsupported tensor type");
      }
      if (args[0]->kind != Kind::kGlobal || args[0]->global == PickleGlobal::kRebuildFromTypeV2) {
        return Error("_rebuild_from_type_v2 with an unsupported function");
      }
      return Call(args[0], args[2]->items, out);
    }
    case PickleGlobal::kTorchSize: {
      if (args.size() != 1 || args[0]->kind != Kind::kTuple) return Error("torch.Size() takes a tuple");
      *out = args[0];
      return absl::OkStatus();
    }
    case PickleGlobal::kCodecsEncode: {
      if (args.empty() || args[0]->kind != Kind::kString) return Error("_codecs.encode() takes a string");
      // Python 2 bytes pickled as latin-1 text: map each code point back to a byte.
      std::string bytes;
      absl::string_view s = args[0]->s;
      for (size_t i = 0; i < s.size();) {
        unsigned char c = s[i];
        if (c < 0x80) {
          bytes.push_back(static_cast<char>(c));
          i += 1;
        } else if ((c & 0xE0) == 0xC0 && i + 1 < s.size() && c <= 0xC3) {
          bytes.push_back(static_cast<char>(((c & 0x1F) << 6) | (s[i + 1] & 0x3F)));
          i += 2;
        } else {
          return Error("_codecs.encode() of a non-latin-1 string");
        }
      }
      auto v = New(Kind::kBytes);
      if (!v.ok()) return v.status();
      (*v)->s = std::move(bytes);
      *out = *v;
      return absl::OkStatus();
    }
    case PickleGlobal::kSet: {
      auto v = New(Kind::kList);
      if (!v.ok()) return v.status();
      if (!args.empty()) {
        if (args[0]->kind != Kind::kList && args[0]->kind != Kind::kTuple) return Error("set() takes a list");
        (*v)->items = args[0]->items;
      }
      *out = *v;
      return absl::OkStatus();
    }
    case PickleGlobal::kBytearray: {
      auto v = New(Kind::kBytes);
      if (!v.ok()) return v.status();
      if (!args.empty() && args[0]->kind == Kind::kBytes) (*v)->s = args[0]->s;
      *out = *v;
      return absl::OkStatus();
    }
    default:
      return Error(absl::StrCat("'", callable->global_name, "' cannot be called"));
  }
}

absl::Status PickleMachine::Reduce(const PickleValue* callable, const PickleValue* args) {
  if (args->kind != Kind::kTuple) return Error("REDUCE arguments are not a tuple");
  const PickleValue* out = nullptr;
  if (auto st = Call(callable, args->items, &out); !st.ok()) return st;
  stack_.push_back(out);
  return absl::OkStatus();
}

absl::Status PickleMachine::PersistentId(const PickleValue* pid) {
  if (pid->kind == Kind::kString || pid->kind == Kind::kInt) {
    PickleValue* v;
    if (auto st = Push(Kind::kPersistentId, &v); !st.ok()) return st;
    v->s = pid->kind == Kind::kString ? pid->s : absl::StrCat(pid->i);
    return absl::OkStatus();
  }
  if (pid->kind != Kind::kTuple || pid->items.size() < 5 || pid->items[0]->kind != Kind::kString ||
      pid->items[0]->s != "storage") {
    return Error("persistent id is not a ('storage', ...) tuple");
  }
  const PickleValue* cls = pid->items[1];
  if (cls->kind != Kind::kGlobal || cls->global != PickleGlobal::kStorageClass) {
    return Error("persistent id does not name a storage class");
  }
  PickleValue* v;
  if (auto st = Push(Kind::kStorage, &v); !st.ok()) return st;
  PickleStorage& s = v->storage;
  s.dtype = cls->global_dtype;
  s.untyped = cls->global_untyped;
  if (cls->global_unsupported) s.unsupported = cls->global_name;
  const PickleValue* key = pid->items[2];
  if (key->kind == Kind::kString) {
    s.key = key->s;
  } else if (key->kind == Kind::kInt) {
    s.key = absl::StrCat(key->i);
  } else {
    return Error("storage key is not a string");
  }
  if (!ToUint(pid->items[4], &s.numel)) return Error("storage size is not a non-negative integer");
  if (pid->items.size() >= 6 && pid->items[5]->kind != Kind::kNone) {
    const PickleValue* view = pid->items[5];
    if (view->kind != Kind::kTuple || view->items.size() != 3 || view->items[0]->kind != Kind::kString ||
        !ToUint(view->items[1], &s.view_offset) || !ToUint(view->items[2], &s.view_size)) {
      return Error("storage view metadata is malformed");
    }
    s.has_view = true;
    s.view_key = view->items[0]->s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PickleResult>> PickleMachine::Run(size_t* consumed) {
  while (true) {
    op_pos_ = in_.position();
    uint8_t op;
    if (!in_.ReadU8(&op)) return Error("ends without STOP");
    absl::Status st;
    switch (op) {
      case 0x80: {  // PROTO
        uint8_t proto;
        if (!in_.ReadU8(&proto)) return Error("truncated");
        if (proto > 5) return Error(absl::StrCat("unsupported protocol ", proto));
        break;
      }
      case 0x95: {  // FRAME: a length hint only
        uint64_t n;
        if (!in_.ReadU64(&n)) return Error("truncated");
        break;
      }
      case '.': {  // STOP
        if (stack_.size() != 1 || !marks_.empty()) return Error("STOP with an unbalanced stack");
        result_->root_ = stack_.back();
        if (consumed) *consumed = in_.position();
        return std::move(result_);
      }
      case '(':  // MARK
        if (marks_.size() > 10000) return Error("MARKs nested too deep");
        marks_.push_back(stack_.size());
        break;
      case '0': {  // POP
        if (stack_.size() > mark_floor()) {
          stack_.pop_back();
        } else if (!marks_.empty()) {
          marks_.pop_back();  // pickle's POP discards a mark when the stack top is one
        } else {
          return Error("stack underflow");
        }
        break;
      }
      case '1': {  // POP_MARK
        auto items = PopMark();
        if (!items.ok()) return items.status();
        break;
      }
      case '2': {  // DUP
        if (stack_.size() <= mark_floor()) return Error("stack underflow");
        stack_.push_back(stack_.back());
        break;
      }
      case 'N':
        st = Push(Kind::kNone);
        break;
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        PickleValue* v;
        st = Push(Kind::kBool, &v);
        if (st.ok()) v->b = op == 0x88;
        break;
      }
      case 'J': {
        int32_t i;
        if (!in_.ReadI32(&i)) return Error("truncated");
        st = PushInt(i);
        break;
      }
      case 'K': {
        uint8_t i;
        if (!in_.ReadU8(&i)) return Error("truncated");
        st = PushInt(i);
        break;
      }
      case 'M': {
        uint16_t i;
        if (!in_.ReadU16(&i)) return Error("truncated");
        st = PushInt(i);
        break;
      }
      case 0x8a:
      case 0x8b: {  // LONG1, LONG4: little-endian two's complement
        uint32_t n;
        if (op == 0x8a) {
          uint8_t n8;
          if (!in_.ReadU8(&n8)) return Error("truncated");
          n = n8;
        } else if (!in_.ReadU32(&n)) {
          return Error("truncated");
        }
        absl::string_view bytes;
        if (n > 8 && n <= in_.remaining()) {
          // Allowed only if it still fits in 64 bits (sign extension bytes).
          if (!in_.ReadBytes(n, &bytes)) return Error("truncated");
          char fill = (bytes[7] & 0x80) ? '\xff' : '\0';
          for (size_t k = 8; k < n; ++k) {
            if (bytes[k] != fill) return Error("integer does not fit in 64 bits");
          }
        } else if (!in_.ReadBytes(n, &bytes)) {
          return Error("truncated");
        }
        uint64_t u = 0;
        size_t len = std::min<size_t>(n, 8);
        for (size_t k = 0; k < len; ++k) u |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[k])) << (8 * k);
        if (len > 0 && len < 8 && (bytes[len - 1] & 0x80)) u |= ~uint64_t{0} << (8 * len);
        st = PushInt(static_cast<int64_t>(u));
        break;
      }
      case 'I':
      case 'L': {  // INT, LONG (text)
        std::string line;
        if (auto s = ReadLine(&line); !s.ok()) return s;
        if (op == 'L' && !line.empty() && line.back() == 'L') line.pop_back();
        if (op == 'I' && (line == "00" || line == "01")) {
          PickleValue* v;
          st = Push(Kind::kBool, &v);
          if (st.ok()) v->b = line == "01";
          break;
        }
        int64_t i;
        if (!absl::SimpleAtoi(line, &i)) return Error("bad integer text");
        st = PushInt(i);
        break;
      }
      case 'G': {  // BINFLOAT, big-endian
        uint64_t bits = 0;
        absl::string_view b;
        if (!in_.ReadBytes(8, &b)) return Error("truncated");
        for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<uint8_t>(b[k]);
        PickleValue* v;
        st = Push(Kind::kFloat, &v);
        if (st.ok()) std::memcpy(&v->f, &bits, 8);
        break;
      }
      case 'F': {
        std::string line;
        if (auto s = ReadLine(&line); !s.ok()) return s;
        double d;
        if (!absl::SimpleAtod(line, &d)) return Error("bad float text");
        PickleValue* v;
        st = Push(Kind::kFloat, &v);
        if (st.ok()) v->f = d;
        break;
      }
      case 'X':
      case 0x8c:
      case 0x8d:
      case 'B':
      case 'C':
      case 0x8e:
      case 0x96:
      case 'T':
      case 'U': {  // unicode / bytes / py2 strings with binary lengths
        uint64_t n = 0;
        if (op == 0x8c || op == 'C' || op == 'U') {
          uint8_t n8;
          if (!in_.ReadU8(&n8)) return Error("truncated");
          n = n8;
        } else if (op == 'X' || op == 'B' || op == 'T') {
          uint32_t n32;
          if (!in_.ReadU32(&n32)) return Error("truncated");
          n = n32;
        } else if (!in_.ReadU64(&n)) {
          return Error("truncated");
        }
        std::string s;
        if (auto r = ReadString(n, &s); !r.ok()) return r;
        bool text = op == 'X' || op == 0x8c || op == 0x8d;
        // Python 2 str (T, U) is text when it is valid UTF-8, bytes otherwise.
        if (op == 'T' || op == 'U') text = IsValidUtf8(s);
        st = PushString(text ? Kind::kString : Kind::kBytes, std::move(s));
        break;
      }
      case 'V':
      case 'S': {  // UNICODE, STRING (text protocol)
        std::string line;
        if (auto s = ReadLine(&line); !s.ok()) return s;
        if (op == 'S') {
          if (line.size() < 2 || (line.front() != '\'' && line.front() != '"') || line.back() != line.front()) {
            return Error("STRING argument is not quoted");
          }
          std::string unescaped;
          if (!absl::CUnescape(absl::string_view(line).substr(1, line.size() - 2), &unescaped)) {
            return Error("bad STRING escape");
          }
          line = std::move(unescaped);
        }
        st = PushString(IsValidUtf8(line) ? Kind::kString : Kind::kBytes, std::move(line));
        break;
      }
      case ')':
        st = Push(Kind::kTuple);
        break;
      case ']':
        st = Push(Kind::kList);
        break;
      case '}':
        st = Push(Kind::kDict);
        break;
      case 0x8f:  // EMPTY_SET
        st = Push(Kind::kList);
        break;
      case 't':
      case 'l':
      case 0x91: {  // TUPLE, LIST, FROZENSET
        auto items = PopMark();
        if (!items.ok()) return items.status();
        PickleValue* v;
        st = Push(op == 't' ? Kind::kTuple : Kind::kList, &v);
        if (st.ok()) v->items = std::move(*items);
        break;
      }
      case 'd': {  // DICT
        auto items = PopMark();
        if (!items.ok()) return items.status();
        st = Push(Kind::kDict);
        if (st.ok()) st = SetItems(std::move(*items));
        break;
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        size_t n = op - 0x84;
        if (stack_.size() < mark_floor() + n) return Error("stack underflow");
        std::vector<const PickleValue*> items(stack_.end() - n, stack_.end());
        stack_.resize(stack_.size() - n);
        PickleValue* v;
        st = Push(Kind::kTuple, &v);
        if (st.ok()) v->items = std::move(items);
        break;
      }
      case 'a': {
        auto v = Pop();
        if (!v.ok()) return v.status();
        st = Append({*v});
        break;
      }
      case 'e':
      case 0x90: {  // APPENDS, ADDITEMS
        auto items = PopMark();
        if (!items.ok()) return items.status();
        st = Append(std::move(*items));
        break;
      }
      case 's': {
        auto value = Pop();
        if (!value.ok()) return value.status();
        auto key = Pop();
        if (!key.ok()) return key.status();
        st = SetItems({*key, *value});
        break;
      }
      case 'u': {
        auto items = PopMark();
        if (!items.ok()) return items.status();
        st = SetItems(std::move(*items));
        break;
      }
      case 'p': {
        std::string line;
        if (auto s = ReadLine(&line); !s.ok()) return s;
        uint64_t index;
        if (!absl::SimpleAtoi(line, &index)) return Error("bad PUT index");
        st = Memoize(index);
        break;
      }
      case 'q': {
        uint8_t i;
        if (!in_.ReadU8(&i)) return Error("truncated");
        st = Memoize(i);
        break;
      }
      case 'r': {
        uint32_t i;
        if (!in_.ReadU32(&i)) return Error("truncated");
        st = Memoize(i);
        break;
      }
      case 0x94:  // MEMOIZE
        st = Memoize(memo_.size());
        break;
      case 'g': {
        std::string line;
        if (auto s = ReadLine(&line); !s.ok()) return s;
        uint64_t index;
        if (!absl::SimpleAtoi(line, &index)) return Error("bad GET index");
        st = Recall(index);
        break;
      }
      case 'h': {
        uint8_t i;
        if (!in_.ReadU8(&i)) return Error("truncated");
        st = Recall(i);
        break;
      }
      case 'j': {
        uint32_t i;
        if (!in_.ReadU32(&i)) return Error("truncated");
        st = Recall(i);
        break;
      }
      case 'c':
      case 'i': {  // GLOBAL, INST: "module\nname\n"
        std::string module, name;
        if (auto s = ReadLine(&module); !s.ok()) return s;
        if (auto s = ReadLine(&name); !s.ok()) return s;
        st = PushGlobal(module, name);
        if (st.ok() && op == 'i') {  // INST calls the class with the marked items
          const PickleValue* cls = stack_.back();
          stack_.pop_back();
          auto items = PopMark();
          if (!items.ok()) return items.status();
          const PickleValue* out = nullptr;
          st = Call(cls, *items, &out);
          if (st.ok()) stack_.push_back(out);
        }
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        auto name = Pop();
        if (!name.ok()) return name.status();
        auto module = Pop();
        if (!module.ok()) return module.status();
        if ((*module)->kind != Kind::kString || (*name)->kind != Kind::kString) {
          return Error("STACK_GLOBAL operands are not strings");
        }
        st = PushGlobal((*module)->s, (*name)->s);
        break;
      }
      case 'o': {  // OBJ: class and args after the mark
        auto items = PopMark();
        if (!items.ok()) return items.status();
        if (items->empty()) return Error("OBJ without a class");
        const PickleValue* cls = (*items)[0];
        std::vector<const PickleValue*> args(items->begin() + 1, items->end());
        const PickleValue* out = nullptr;
        st = Call(cls, args, &out);
        if (st.ok()) stack_.push_back(out);
        break;
      }
      case 'R': {
        auto args = Pop();
        if (!args.ok()) return args.status();
        auto callable = Pop();
        if (!callable.ok()) return callable.status();
        st = Reduce(*callable, *args);
        break;
      }
      case 0x81:
      case 0x92: {  // NEWOBJ, NEWOBJ_EX: cls.__new__(cls, *args)
        if (op == 0x92) {
          auto kwargs = Pop();
          if (!kwargs.ok()) return kwargs.status();
        }
        auto args = Pop();
        if (!args.ok()) return args.status();
        auto cls = Pop();
        if (!cls.ok()) return cls.status();
        if ((*cls)->kind != Kind::kGlobal || (*cls)->global != PickleGlobal::kOrderedDict) {
          return Error(absl::StrCat("NEWOBJ of '", (*cls)->kind == Kind::kGlobal ? (*cls)->global_name : "?",
                                    "' is not supported"));
        }
        st = Push(Kind::kDict);
        break;
      }
      case 'b': {  // BUILD: set state on the object below
        auto state = Pop();
        if (!state.ok()) return state.status();
        if (stack_.size() <= mark_floor()) return Error("stack underflow");
        Kind target = stack_.back()->kind;
        // A state dict's attributes (OrderedDict._metadata) and tensor state
        // (requires_grad, hooks) carry no tensor data: they are not kept.
        if (target != Kind::kDict && target != Kind::kTensor) return Error("BUILD on an unsupported object");
        break;
      }
      case 'Q': {  // BINPERSID
        auto pid = Pop();
        if (!pid.ok()) return pid.status();
        st = PersistentId(*pid);
        break;
      }
      case 'P': {  // PERSID (text)
        std::string line;
        if (auto s = ReadLine(&line); !s.ok()) return s;
        PickleValue* v;
        st = Push(Kind::kString, &v);
        if (st.ok()) {
          v->s = line;
          stack_.pop_back();
          st = PersistentId(v);
        }
        break;
      }
      case 0x82:
      case 0x83:
      case 0x84:
        return Error("extension-registry opcodes (EXT1/2/4) are not supported");
      case 0x97:
      case 0x98:
        return Error("out-of-band buffers (protocol 5) are not supported");
      default:
        return Error(absl::StrCat("unknown opcode 0x", absl::Hex(op)));
    }
    if (!st.ok()) return st;
  }
}

absl::StatusOr<std::unique_ptr<PickleResult>> Unpickle(absl::string_view data, absl::string_view what,
                                                       const PickleLimits& limits, size_t* consumed) {
  PickleMachine machine(data, what, limits);
  return machine.Run(consumed);
}

}  // namespace weightstore
