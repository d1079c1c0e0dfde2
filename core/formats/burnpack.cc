#include "core/formats/burnpack.h"

#include <cbor.h>

#include <algorithm>
#include <map>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/formats/byte_reader.h"
#include "core/status_macros.h"

namespace weightstore {
namespace {

constexpr uint32_t kMagic = 0x4255524E;
constexpr uint16_t kVersion = 1;
constexpr uint64_t kHeaderSize = 10;
constexpr uint64_t kMaxMetadataSize = uint64_t{100} << 20;
constexpr uint64_t kMaxTensorSize = uint64_t{10} << 30;
constexpr uint64_t kMaxFileSize = uint64_t{100} << 30;
constexpr size_t kMaxCborDepth = 128;
constexpr uint64_t kMaxCborItems = 4000000;

uint64_t AlignUp(uint64_t value, uint64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

// A first pass over the CBOR stream with libcbor's streaming decoder, before
// cbor_load builds anything: bounds nesting depth and item count, and refuses
// indefinite lengths (Burn writes none).
struct ScanState {
  std::vector<uint64_t> remaining;  // items left in each open container
  uint64_t items = 0;
  std::string error;

  // A scalar item: counts against its container; finished containers close.
  void Item() {
    Consume();
    CloseFinished();
  }
  // A container of `count` items. Its parent is not closed before it, so the
  // stack depth is the true nesting depth.
  void Open(uint64_t count) {
    Consume();
    if (count == 0) return CloseFinished();
    if (remaining.size() >= kMaxCborDepth) return Fail("CBOR nesting deeper than 128");
    remaining.push_back(count);
  }
  void Consume() {
    if (++items > kMaxCborItems) Fail("too many CBOR items");
    if (!remaining.empty()) --remaining.back();
  }
  void CloseFinished() {
    while (!remaining.empty() && remaining.back() == 0) remaining.pop_back();
  }
  void Fail(const std::string& message) {
    if (error.empty()) error = message;
  }
};

ScanState* State(void* context) { return static_cast<ScanState*>(context); }

absl::Status ScanCbor(absl::string_view data) {
  cbor_callbacks callbacks = cbor_empty_callbacks;
  callbacks.uint8 = [](void* c, uint8_t) { State(c)->Item(); };
  callbacks.uint16 = [](void* c, uint16_t) { State(c)->Item(); };
  callbacks.uint32 = [](void* c, uint32_t) { State(c)->Item(); };
  callbacks.uint64 = [](void* c, uint64_t) { State(c)->Item(); };
  callbacks.negint8 = [](void* c, uint8_t) { State(c)->Item(); };
  callbacks.negint16 = [](void* c, uint16_t) { State(c)->Item(); };
  callbacks.negint32 = [](void* c, uint32_t) { State(c)->Item(); };
  callbacks.negint64 = [](void* c, uint64_t) { State(c)->Item(); };
  callbacks.byte_string = [](void* c, cbor_data, size_t) { State(c)->Item(); };
  callbacks.string = [](void* c, cbor_data, size_t) { State(c)->Item(); };
  callbacks.float2 = [](void* c, float) { State(c)->Item(); };
  callbacks.float4 = [](void* c, float) { State(c)->Item(); };
  callbacks.float8 = [](void* c, double) { State(c)->Item(); };
  callbacks.null = [](void* c) { State(c)->Item(); };
  callbacks.undefined = [](void* c) { State(c)->Item(); };
  callbacks.boolean = [](void* c, bool) { State(c)->Item(); };
  callbacks.tag = [](void*, uint64_t) {};  // a tag qualifies the next item
  callbacks.array_start = [](void* c, size_t n) { State(c)->Open(n); };
  callbacks.map_start = [](void* c, size_t n) {
    if (n > SIZE_MAX / 2) return State(c)->Fail("CBOR map too large");
    State(c)->Open(2 * static_cast<uint64_t>(n));
  };
  auto indefinite = [](void* c) { State(c)->Fail("indefinite-length CBOR items are not supported"); };
  callbacks.byte_string_start = indefinite;
  callbacks.string_start = indefinite;
  callbacks.indef_array_start = indefinite;
  callbacks.indef_map_start = indefinite;
  callbacks.indef_break = indefinite;

  ScanState state;
  size_t pos = 0;
  do {
    if (pos >= data.size()) return absl::InvalidArgumentError("CBOR metadata is truncated");
    cbor_decoder_result result =
        cbor_stream_decode(reinterpret_cast<cbor_data>(data.data() + pos), data.size() - pos, &callbacks, &state);
    if (result.status != CBOR_DECODER_FINISHED || result.read == 0) {
      return absl::InvalidArgumentError(absl::StrCat("CBOR metadata is malformed at byte ", pos));
    }
    pos += result.read;
    if (!state.error.empty()) return absl::InvalidArgumentError(state.error);
  } while (!state.remaining.empty());
  if (pos != data.size()) {
    return absl::InvalidArgumentError(absl::StrCat("CBOR metadata has ", data.size() - pos, " trailing bytes"));
  }
  return absl::OkStatus();
}

struct CborDeleter {
  void operator()(cbor_item_t* item) const { cbor_decref(&item); }
};
using CborPtr = std::unique_ptr<cbor_item_t, CborDeleter>;

bool GetText(const cbor_item_t* item, std::string* out) {
  if (!cbor_isa_string(item) || !cbor_string_is_definite(item)) return false;
  out->assign(reinterpret_cast<const char*>(cbor_string_handle(item)), cbor_string_length(item));
  return true;
}

bool GetUint(const cbor_item_t* item, uint64_t* out) {
  if (!cbor_isa_uint(item)) return false;
  *out = cbor_get_int(item);
  return true;
}

bool GetUintArray(const cbor_item_t* item, std::vector<uint64_t>* out) {
  if (!cbor_isa_array(item) || !cbor_array_is_definite(item)) return false;
  cbor_item_t** handle = cbor_array_handle(item);
  for (size_t i = 0; i < cbor_array_size(item); ++i) {
    uint64_t v;
    if (!GetUint(handle[i], &v)) return false;
    out->push_back(v);
  }
  return true;
}

// Decodes Burn's DType: a text tag ("F32") or a one-entry map ({"Bool": "Native"}).
absl::StatusOr<DType> DecodeDType(const cbor_item_t* item) {
  std::string tag;
  if (GetText(item, &tag)) {
    static const std::map<std::string, DType> kText = {
        {"F64", DType::kF64},   {"F32", DType::kF32},  {"Flex32", DType::kF32}, {"F16", DType::kF16},
        {"BF16", DType::kBF16}, {"I64", DType::kI64},  {"I32", DType::kI32},    {"I16", DType::kI16},
        {"I8", DType::kI8},     {"U64", DType::kU64},  {"U32", DType::kU32},    {"U16", DType::kU16},
        {"U8", DType::kU8},     {"Bool", DType::kBool}};  // "Bool" text: files before Burn #4649
    auto it = kText.find(tag);
    if (it == kText.end()) return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", tag, "'"));
    return it->second;
  }
  if (cbor_isa_map(item) && cbor_map_size(item) == 1) {
    cbor_pair pair = cbor_map_handle(item)[0];
    std::string variant, store;
    if (GetText(pair.key, &variant)) {
      if (variant == "QFloat") {
        return absl::UnimplementedError("quantized (QFloat) tensors are not supported");
      }
      if (variant == "Bool" && GetText(pair.value, &store)) {
        if (store == "Native") return DType::kBool;
        if (store == "U8") return DType::kU8;
        if (store == "U32") return DType::kU32;
        return absl::InvalidArgumentError(absl::StrCat("unknown Bool storage '", store, "'"));
      }
    }
  }
  return absl::InvalidArgumentError("dtype is neither a text tag nor a {variant: value} map");
}

}  // namespace

bool IsBurnpack(absl::string_view head) { return head.size() >= 4 && LoadU32(head.data()) == kMagic; }

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseBurnpack(SharedBytes bytes, const std::string& path,
                                                                const OpenOptions& options) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a valid Burnpack file: ", what));
  };
  absl::string_view file = bytes.view();
  if (file.size() < kHeaderSize) return bad("shorter than the 10-byte header");
  if (LoadU32(file.data()) != kMagic) return bad("bad magic number");
  const uint16_t version = LoadU16(file.data() + 4);
  if (version > kVersion) return bad(absl::StrCat("format version ", version, " is newer than 1"));
  const uint64_t metadata_size = LoadU32(file.data() + 6);
  if (metadata_size > kMaxMetadataSize) return bad(absl::StrCat("metadata size ", metadata_size, " exceeds 100 MiB"));
  if (file.size() > kMaxFileSize) return bad("file larger than 100 GiB");
  if (kHeaderSize + metadata_size > file.size()) return bad("metadata runs past the end of the file");

  absl::string_view cbor = file.substr(kHeaderSize, metadata_size);
  absl::Status scan = ScanCbor(cbor);
  if (!scan.ok()) return bad(scan.message());
  cbor_load_result load_result;
  CborPtr root(cbor_load(reinterpret_cast<cbor_data>(cbor.data()), cbor.size(), &load_result));
  if (root == nullptr || load_result.error.code != CBOR_ERR_NONE) return bad("CBOR metadata cannot be decoded");
  if (!cbor_isa_map(root.get())) return bad("CBOR metadata is not a map");

  const uint64_t data_start = AlignUp(kHeaderSize + metadata_size, kBurnpackAlignment);
  const uint64_t available = file.size() >= data_start ? file.size() - data_start : 0;
  if (file.size() < data_start && file.size() != kHeaderSize + metadata_size) {
    return bad("truncated inside the padding before the data section");
  }
  std::shared_ptr<const LazyStorage> storage = LazyStorage::Ready(bytes.Subspan(file.size() - available, available));

  Metadata metadata;
  std::vector<CheckpointEntry> entries;
  struct Range {
    uint64_t begin, end;
    size_t entry;
  };
  std::vector<Range> ranges;
  bool seen_tensors = false;
  absl::flat_hash_set<std::string> top_keys;
  cbor_pair* top = cbor_map_handle(root.get());
  for (size_t i = 0; i < cbor_map_size(root.get()); ++i) {
    std::string key;
    if (!GetText(top[i].key, &key)) return bad("a top-level key is not text");
    if (!top_keys.insert(key).second) return bad(absl::StrCat("duplicate top-level key '", key, "'"));
    const cbor_item_t* value = top[i].value;
    if (key == "metadata") {
      if (!cbor_isa_map(value)) return bad("'metadata' is not a map");
      cbor_pair* pairs = cbor_map_handle(value);
      for (size_t j = 0; j < cbor_map_size(value); ++j) {
        std::string k, v;
        if (!GetText(pairs[j].key, &k) || !GetText(pairs[j].value, &v)) return bad("'metadata' holds a non-text entry");
        if (!metadata.emplace(k, v).second) return bad(absl::StrCat("duplicate metadata key '", k, "'"));
      }
    } else if (key == "tensors") {
      seen_tensors = true;
      if (!cbor_isa_map(value)) return bad("'tensors' is not a map");
      const size_t count = cbor_map_size(value);
      if (count > std::min<uint64_t>(options.max_tensors, 100000)) {
        return bad(absl::StrCat(count, " tensors exceed the limit"));
      }
      cbor_pair* pairs = cbor_map_handle(value);
      absl::flat_hash_set<std::string> names;
      for (size_t j = 0; j < count; ++j) {
        CheckpointEntry entry;
        if (!GetText(pairs[j].key, &entry.spec.name)) return bad("a tensor name is not text");
        const std::string& name = entry.spec.name;
        auto fault = [&](absl::string_view what) { return bad(absl::StrCat("tensor '", name, "' ", what)); };
        if (!names.insert(name).second) return fault("appears twice");
        const cbor_item_t* desc = pairs[j].value;
        if (!cbor_isa_map(desc)) return fault("has a descriptor that is not a map");
        bool has_dtype = false, has_shape = false, has_offsets = false;
        std::vector<uint64_t> offsets;
        cbor_pair* fields = cbor_map_handle(desc);
        for (size_t k = 0; k < cbor_map_size(desc); ++k) {
          std::string field;
          if (!GetText(fields[k].key, &field)) return fault("has a non-text field name");
          if (field == "dtype") {
            absl::StatusOr<DType> dtype = DecodeDType(fields[k].value);
            if (!dtype.ok()) return fault(dtype.status().message());
            entry.spec.dtype = *dtype;
            has_dtype = true;
          } else if (field == "shape") {
            if (!GetUintArray(fields[k].value, &entry.spec.shape) || entry.spec.shape.size() > 64) {
              return fault("has a malformed shape");
            }
            has_shape = true;
          } else if (field == "data_offsets") {
            if (!GetUintArray(fields[k].value, &offsets) || offsets.size() != 2)
              return fault("has malformed data_offsets");
            has_offsets = true;
          } else if (field == "param_id") {
            uint64_t id;
            if (!GetUint(fields[k].value, &id)) return fault("has a param_id that is not an unsigned integer");
            entry.spec.param_id = id;
          }  // unknown fields are ignored, as Burn's reader does
        }
        if (!has_dtype || !has_shape || !has_offsets) return fault("lacks dtype, shape or data_offsets");
        if (offsets[1] < offsets[0]) return fault("has data_offsets that end before they begin");
        const uint64_t length = offsets[1] - offsets[0];
        if (length > kMaxTensorSize) return fault("is larger than 10 GiB");
        auto numel = CheckedNumElements(entry.spec.shape);
        auto nbytes = numel ? DTypeBytes(entry.spec.dtype, *numel) : std::nullopt;
        if (!nbytes)
          return fault(absl::StrCat("has a shape ", ShapeToString(entry.spec.shape), " whose size overflows"));
        if (*nbytes != length) {
          return fault(absl::StrCat("covers ", length, " bytes, but ", DTypeName(entry.spec.dtype), " ",
                                    ShapeToString(entry.spec.shape), " needs ", *nbytes));
        }
        if (offsets[1] > available) {
          return fault(absl::StrCat("ends at data offset ", offsets[1], ", past the end of the file (", available,
                                    " data bytes)"));
        }
        entry.layout.storage = storage;
        entry.layout.offset = offsets[0];
        ranges.push_back({offsets[0], offsets[1], entries.size()});
        entries.push_back(std::move(entry));
      }
    }  // "scalars" (optimizer state) and unknown keys are ignored
  }
  if (!seen_tensors) return bad("CBOR metadata has no 'tensors' map");

  // Data order is the writer's input order: present tensors that way.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return std::pair(a.begin, a.end) < std::pair(b.begin, b.end); });
  uint64_t end = 0;
  std::vector<CheckpointEntry> ordered;
  ordered.reserve(entries.size());
  for (const Range& r : ranges) {
    if (r.begin < end && r.end > r.begin) {
      return bad(absl::StrCat("tensor '", entries[r.entry].spec.name, "' overlaps the tensor before it"));
    }
    end = std::max(end, r.end);
    ordered.push_back(std::move(entries[r.entry]));
  }
  if (end != available) {
    return bad(absl::StrCat("tensors end at data offset ", end, " but the file has ", available,
                            " data bytes (trailing bytes)"));
  }
  return Checkpoint::Create(kBurnpackFormat, path, std::move(metadata), std::move(ordered), "", {}, options);
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadBurnpack(std::shared_ptr<const MappedFile> file,
                                                               const OpenOptions& options) {
  return ParseBurnpack(file->bytes(), file->path(), options);
}

namespace {

// Appends CBOR heads with libcbor's encoders, which choose the shortest form.
class CborOut {
 public:
  void Map(size_t n) { Head(cbor_encode_map_start(n, buf_, sizeof buf_)); }
  void Array(size_t n) { Head(cbor_encode_array_start(n, buf_, sizeof buf_)); }
  void Uint(uint64_t v) { Head(cbor_encode_uint(v, buf_, sizeof buf_)); }
  void Text(absl::string_view s) {
    Head(cbor_encode_string_start(s.size(), buf_, sizeof buf_));
    out_.append(s.data(), s.size());
  }
  std::string& out() { return out_; }

 private:
  void Head(size_t n) { out_.append(reinterpret_cast<const char*>(buf_), n); }
  unsigned char buf_[9];
  std::string out_;
};

absl::Status EncodeDType(DType dtype, absl::string_view name, CborOut* out) {
  switch (dtype) {
    case DType::kBool:
      out->Map(1);
      out->Text("Bool");
      out->Text("Native");
      return absl::OkStatus();
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kF4:
    case DType::kF6E2M3:
    case DType::kF6E3M2:
    case DType::kF8E8M0:
    case DType::kF8E4M3FNUZ:
    case DType::kF8E5M2FNUZ:
    case DType::kC64:
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "': Burnpack cannot store ", DTypeName(dtype),
          " (Burn's element types: F64, F32, F16, BF16, I64 to I8, U64 to U8, Bool); cast floats with --dtype, "
          "or leave the tensor out"));
    default:
      out->Text(DTypeName(dtype));
      return absl::OkStatus();
  }
}

}  // namespace

absl::StatusOr<WritePlan> PlanBurnpack(const std::vector<TensorSpec>& tensors, const Metadata& metadata) {
  WritePlan plan;
  std::map<std::string, size_t> by_name;
  uint64_t offset = 0;
  std::vector<uint64_t> relative;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!by_name.emplace(tensors[i].name, i).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", tensors[i].name, "'"));
    }
    offset = AlignUp(offset, kBurnpackAlignment);
    relative.push_back(offset);
    offset += tensors[i].byte_size();
    plan.order.push_back(i);
  }
  CborOut cbor;
  cbor.Map(metadata.empty() ? 1 : 2);
  cbor.Text("tensors");
  cbor.Map(by_name.size());
  for (const auto& [name, i] : by_name) {
    const TensorSpec& t = tensors[i];
    cbor.Text(name);
    cbor.Map(t.param_id ? 4 : 3);
    cbor.Text("dtype");
    WEIGHTSTORE_RETURN_IF_ERROR(EncodeDType(t.dtype, t.name, &cbor));
    cbor.Text("shape");
    cbor.Array(t.shape.size());
    for (uint64_t d : t.shape) cbor.Uint(d);
    cbor.Text("data_offsets");
    cbor.Array(2);
    cbor.Uint(relative[i]);
    cbor.Uint(relative[i] + t.byte_size());
    if (t.param_id) {
      cbor.Text("param_id");
      cbor.Uint(*t.param_id);
    }
  }
  if (!metadata.empty()) {
    cbor.Text("metadata");
    cbor.Map(metadata.size());
    for (const auto& [k, v] : metadata) {
      cbor.Text(k);
      cbor.Text(v);
    }
  }
  const std::string& body = cbor.out();
  if (body.size() > kMaxMetadataSize) return absl::InvalidArgumentError("Burnpack metadata exceeds 100 MiB");
  std::string& header = plan.header;
  auto put = [&](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) header.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  };
  put(kMagic, 4);
  put(kVersion, 2);
  put(body.size(), 4);
  header += body;
  const uint64_t data_start = AlignUp(header.size(), kBurnpackAlignment);
  header.resize(data_start, '\0');
  for (uint64_t r : relative) plan.offsets.push_back(data_start + r);
  plan.file_size = data_start + offset;
  return plan;
}

namespace {
constexpr absl::string_view kBurnpackExtensions[] = {".bpk"};
bool DetectBurnpack(absl::string_view file) { return IsBurnpack(file.substr(0, 16)); }
}  // namespace

constinit const FormatSpec kBurnpackFormat = {
    .name = "burnpack",
    .extensions = kBurnpackExtensions,
    .detect = DetectBurnpack,
    .open = ReadBurnpack,
    .plan = PlanBurnpack,
};

}  // namespace weightstore
