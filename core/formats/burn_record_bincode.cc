// Burn's bincode records (BinFileRecorder, BinGzFileRecorder, BinBytesRecorder):
// bincode 2's standard() configuration, which stores no names and no types.
//
// The record is five metadata strings, then the module's fields in declaration
// order. Parameters are read in the layout's order; between two of them the
// module holds only constants, whose bytes vary by Burn version (a nil
// constant is 00, `[usize; 2]` is 00 00 or, up to 0.11, 02 00 00, an
// Option<constant> 00 or 01 00, an Option<Param> tag 01) and a Vec of modules
// starts with its length. So each parameter is searched for, forward from the
// end of the previous one, within kMaxGap bytes: at each position, a parameter
// is tried (a ParamId string, then a tensor whose shape must equal the
// layout's); where none starts, one of those tokens is skipped: a byte 00 or
// 01, N (2 to 8) followed by N zeros, or the length of a Vec that the layout's
// paths say begins here. Any other byte ends the search with an error naming
// the parameter: an Option or bool tag of 2 is refused so, and a layout that
// does not fit fails at its first parameter the file does not hold.
#include <algorithm>
#include <iterator>
#include <span>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/checked_math.h"
#include "core/formats/burn_record_internal.h"
#include "core/status_macros.h"
#include "core/utf8.h"

namespace weightstore::burn_record_internal {
namespace {

constexpr size_t kMaxGap = 4096;

// A bounds-checked cursor over bincode; each read fails (false) rather than
// run past the end, and may then have moved: callers retry from a copy.
struct Cursor {
  absl::string_view data;
  size_t pos = 0;

  size_t left() const { return data.size() - pos; }
  uint8_t peek(size_t ahead = 0) const { return static_cast<uint8_t>(data[pos + ahead]); }
  // bincode's varint: < 251 is the value; 251, 252, 253 prefix a u16, u32,
  // u64 (LE). 254 (u128) and 255 are refused.
  bool Varint(uint64_t* out) {
    if (left() == 0) return false;
    const uint8_t b = peek();
    const size_t n = b < 251 ? 0 : b == 251 ? 2 : b == 252 ? 4 : b == 253 ? 8 : SIZE_MAX;
    if (n == SIZE_MAX || left() < 1 + n) return false;
    uint64_t v = n == 0 ? b : 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(peek(1 + i)) << (8 * i);
    pos += 1 + n;
    *out = v;
    return true;
  }
  bool Bytes(uint64_t n, absl::string_view* out) {
    if (n > left()) return false;
    *out = data.substr(pos, n);
    pos += n;
    return true;
  }
  bool Str(absl::string_view* out) {
    uint64_t n;
    return Varint(&n) && Bytes(n, out);
  }
  // A Vec<usize>: its length (at most 64 here), then each dimension.
  bool Shape(std::vector<uint64_t>* out) {
    uint64_t rank;
    if (!Varint(&rank) || rank > kMaxRank) return false;
    out->resize(rank);
    for (uint64_t& d : *out) {
      if (!Varint(&d)) return false;
    }
    return true;
  }
};

// A ParamId as Burn wrote it: a hyphenated UUID (<= 0.13), or base32hex of 6
// (0.14) or 8 (>= 0.15) bytes. Nothing else starts a parameter.
bool PlausibleId(absl::string_view id) {
  if (id.size() == 36) {
    for (size_t i = 0; i < id.size(); ++i) {
      const bool hyphen = i == 8 || i == 13 || i == 18 || i == 23;
      if (hyphen ? id[i] != '-' : !absl::ascii_isxdigit(static_cast<unsigned char>(id[i]))) return false;
    }
    return true;
  }
  if (id.size() != 10 && id.size() != 13) return false;
  return std::all_of(id.begin(), id.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'v'); });
}

bool ReadId(Cursor* c, absl::string_view* id) {
  if (c->left() == 0 || (c->peek() != 36 && c->peek() != 10 && c->peek() != 13)) return false;
  return c->Str(id) && PlausibleId(*id);
}

// Burn's DType, whose bincode variant index shifts between versions.
enum class BurnDType { kF64, kF32, kFlex32, kF16, kBF16, kI64, kI32, kI16, kI8, kU64, kU32, kU16, kU8, kBool, kQFloat };
using enum BurnDType;
constexpr BurnDType kDTypes014[] = {kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU64, kU32, kU8, kBool, kQFloat};
constexpr BurnDType kDTypes016[] = {kF64, kF32, kF16, kBF16, kI64, kI32,  kI16,
                                    kI8,  kU64, kU32, kU16,  kU8,  kBool, kQFloat};
constexpr BurnDType kDTypes017[] = {kF64, kF32, kFlex32, kF16, kBF16, kI64,  kI32,   kI16,
                                    kI8,  kU64, kU32,    kU16, kU8,   kBool, kQFloat};
struct DTypeTable {
  std::span<const BurnDType> dtypes;
  bool bool_store;  // Bool(BoolStore): 0.21 (a Bool tensor of 4-byte elements tells it)
};
constexpr DTypeTable kTables[] = {{kDTypes014, false}, {kDTypes016, false}, {kDTypes017, true}};
constexpr uint8_t kAllTables = 0b111;

DType ToDType(BurnDType d) {
  constexpr DType kMap[] = {DType::kF64, DType::kF32, DType::kF32, DType::kF16,  DType::kBF16,
                            DType::kI64, DType::kI32, DType::kI16, DType::kI8,   DType::kU64,
                            DType::kU32, DType::kU16, DType::kU8,  DType::kBool, DType::kBool};
  return kMap[static_cast<int>(d)];
}

class BincodeReader {
 public:
  BincodeReader(SharedBytes data, const RecordLayout& layout, const OpenOptions& options)
      : base_(std::move(data)), layout_(layout), options_(options), c_{base_.view()} {}

  absl::StatusOr<ParsedRecord> Read();

 private:
  enum class Try { kNone, kFound, kMismatch };
  enum class Layout { kUnknown, kTensorData, kValues };
  struct Found {
    absl::string_view id;
    RecordDType dtype;
    std::vector<uint64_t> shape;
    SharedBytes bytes;
    size_t end = 0;
  };

  absl::Status ReadMetadata(ParsedRecord* record);
  void CountArrays();
  std::vector<uint64_t> ArrayLengths(size_t k) const;
  // A parameter at `c` for `p`: kNone where no ParamId starts, kMismatch (and
  // `why`) where one does but the tensor after it does not fit.
  Try TryParam(Cursor c, const RecordLayout::Parameter& p, Found* found, std::string* why);
  bool TryTensorData(Cursor c, const RecordLayout::Parameter& p, Found* found, std::string* why);
  bool TryValues(Cursor c, const RecordLayout::Parameter& p, Found* found, std::string* why);
  bool ResolveDType(uint64_t index, uint64_t numel, uint64_t nbytes, Cursor* c, RecordDType* out, std::string* why);
  bool ReadValues(Cursor* c, DType dtype, uint64_t count, SharedBytes* out);
  // Skips one token that may lie between parameters; false if none starts here.
  bool SkipGapToken(const std::vector<uint64_t>& lengths, size_t* next_length);
  SharedBytes View(absl::string_view part) const {
    return base_.Subspan(static_cast<size_t>(part.data() - base_.view().data()), part.size());
  }

  SharedBytes base_;
  const RecordLayout& layout_;
  const OpenOptions& options_;
  Cursor c_;
  Layout tensor_layout_ = Layout::kUnknown;
  uint8_t tables_ = kAllTables;  // the DType tables every tensor so far fits
  std::optional<DType> float_type_, int_type_;
  absl::flat_hash_map<std::string, uint64_t> array_lengths_;  // "a.b" -> elements, from the layout
};

absl::Status BincodeReader::ReadMetadata(ParsedRecord* record) {
  static constexpr const char* kKeys[] = {"float", "int", "format", "version", "settings"};
  for (const char* key : kKeys) {
    absl::string_view value;
    if (!c_.Str(&value)) return absl::InvalidArgumentError(absl::StrCat("metadata.", key, ": runs past the end"));
    if (!IsValidUtf8(value)) return absl::InvalidArgumentError(absl::StrCat("metadata.", key, ": not valid UTF-8"));
    record->metadata[key] = std::string(value);
  }
  float_type_ = ElementDType(record->metadata["float"]);
  int_type_ = ElementDType(record->metadata["int"]);  // "f32" in <= 0.11 Full records
  if (!float_type_ || !int_type_) {
    return absl::InvalidArgumentError("metadata: float or int is not an element type Burn writes");
  }
  return absl::OkStatus();
}

// Elements of each array the layout's paths index ("layers.0.w", "layers.1.w":
// "layers" has 2): a Vec of modules starts with this count.
void BincodeReader::CountArrays() {
  for (const RecordLayout::Parameter& p : layout_.parameters) {
    const std::vector<absl::string_view> parts = absl::StrSplit(p.path, '.');
    for (size_t j = 0; j + 1 < parts.size(); ++j) {
      uint64_t index;
      if (!absl::SimpleAtoi(parts[j], &index) || !absl::ascii_isdigit(static_cast<unsigned char>(parts[j][0])))
        continue;
      uint64_t& count = array_lengths_[absl::StrJoin(parts.begin(), parts.begin() + j, ".")];
      count = std::max(count, index == UINT64_MAX ? index : index + 1);
    }
  }
}

// The lengths of the arrays whose element 0 begins at parameter k, outermost first.
std::vector<uint64_t> BincodeReader::ArrayLengths(size_t k) const {
  const std::vector<absl::string_view> parts = absl::StrSplit(layout_.parameters[k].path, '.');
  std::vector<absl::string_view> previous;
  if (k > 0) previous = absl::StrSplit(layout_.parameters[k - 1].path, '.');
  std::vector<uint64_t> lengths;
  for (size_t j = 0; j + 1 < parts.size(); ++j) {
    if (parts[j] != "0") continue;
    const bool same_array = previous.size() > j + 1 && std::equal(parts.begin(), parts.begin() + j, previous.begin());
    if (same_array && !previous[j].empty() && absl::ascii_isdigit(static_cast<unsigned char>(previous[j][0]))) continue;
    auto it = array_lengths_.find(absl::StrJoin(parts.begin(), parts.begin() + j, "."));
    if (it != array_lengths_.end()) lengths.push_back(it->second);
  }
  return lengths;
}

bool BincodeReader::ResolveDType(uint64_t index, uint64_t numel, uint64_t nbytes, Cursor* c, RecordDType* out,
                                 std::string* why) {
  struct Candidate {
    size_t table;
    RecordDType dtype;
  };
  std::vector<Candidate> fits;
  bool quantized = false;
  for (size_t t = 0; t < std::size(kTables); ++t) {
    if ((tables_ >> t & 1) == 0 || index >= kTables[t].dtypes.size()) continue;
    const BurnDType d = kTables[t].dtypes[index];
    if (d == kQFloat) {
      quantized = true;
      continue;
    }
    RecordDType dtype{.dtype = ToDType(d)};
    if (d == kBool && kTables[t].bool_store && CheckedMul(numel, 4) == nbytes && c->left() > 0 && c->peek() == 2) {
      dtype.bool_bytes = 4;  // Bool(U32), whose store index 2 follows
    }
    const uint64_t size = d == kBool ? dtype.bool_bytes : DTypeSize(dtype.dtype);
    if (CheckedMul(numel, size) == nbytes) fits.push_back({t, dtype});
  }
  if (fits.empty()) {
    *why = quantized ? "the tensor is quantized (QFloat), which is not supported"
                     : absl::StrCat("dtype index ", index, " with ", nbytes, " bytes for ", numel,
                                    " elements fits no Burn version's DType");
    return false;
  }
  // Tables that disagree (index 3: BF16 up to 0.16, F16 after) are told apart
  // by the record's element types: Half records hold F16.
  RecordDType chosen = fits.back().dtype;
  for (const Candidate& f : fits) {
    if (f.dtype.dtype == float_type_ || f.dtype.dtype == int_type_) chosen = f.dtype;
  }
  uint8_t tables = 0;
  for (const Candidate& f : fits) {
    if (f.dtype.dtype == chosen.dtype && f.dtype.bool_bytes == chosen.bool_bytes) tables |= 1 << f.table;
  }
  tables_ = tables;
  if (chosen.bool_bytes == 4) ++c->pos;  // the BoolStore index
  *out = chosen;
  return true;
}

bool BincodeReader::TryTensorData(Cursor c, const RecordLayout::Parameter& p, Found* found, std::string* why) {
  uint64_t nbytes;
  absl::string_view raw;
  if (!c.Varint(&nbytes) || !c.Bytes(nbytes, &raw)) {
    *why = "its byte count runs past the end of the file";
    return false;
  }
  if (!c.Shape(&found->shape)) {
    *why = "no shape follows its bytes";
    return false;
  }
  if (found->shape != p.shape) {
    *why = absl::StrCat("the file's shape is ", ShapeToString(found->shape), ", the layout's ", ShapeToString(p.shape));
    return false;
  }
  uint64_t index;
  if (!c.Varint(&index)) {
    *why = "no dtype follows its shape";
    return false;
  }
  const uint64_t numel = CheckedNumElements(p.shape).value_or(UINT64_MAX);
  if (!ResolveDType(index, numel, nbytes, &c, &found->dtype, why)) return false;
  found->bytes = View(raw);
  found->end = c.pos;
  return true;
}

bool BincodeReader::ReadValues(Cursor* c, DType dtype, uint64_t count, SharedBytes* out) {
  if (count > c->left()) return false;  // every element takes a byte at least
  if (dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kBool) {
    absl::string_view raw;
    if (!c->Bytes(count * DTypeSize(dtype), &raw)) return false;
    *out = View(raw);
    return true;
  }
  std::vector<std::byte> data;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t u;
    if (!c->Varint(&u)) return false;
    // ints are zigzag-encoded; f16 is its u16 bits.
    const int64_t v = static_cast<int64_t>(u >> 1) ^ -static_cast<int64_t>(u & 1);
    const int bytes = static_cast<int>(DTypeSize(dtype));
    if (dtype == DType::kF16
            ? u > 0xFFFF
            : (bytes < 8 && (v < -(int64_t{1} << (8 * bytes - 1)) || v >= int64_t{1} << (8 * bytes - 1)))) {
      return false;
    }
    const uint64_t bits = dtype == DType::kF16 ? u : static_cast<uint64_t>(v);
    for (int b = 0; b < bytes; ++b) data.push_back(static_cast<std::byte>(bits >> (8 * b)));
  }
  *out = SharedBytes::FromVector(std::move(data));
  return true;
}

// <= 0.13: a Vec of elements of the record's float type (or int type, or
// bool: bincode does not say which), then the shape. The first type whose
// elements parse and are followed by the layout's shape is taken; a Half
// record's i16 tensor cannot be told from f16 and reads as F16.
bool BincodeReader::TryValues(Cursor c, const RecordLayout::Parameter& p, Found* found, std::string* why) {
  uint64_t count;
  const std::optional<uint64_t> numel = CheckedNumElements(p.shape);
  if (!c.Varint(&count) || !numel || count != *numel) {
    *why = absl::StrCat("its value count is not the ", numel.value_or(0), " elements of the layout's shape ",
                        ShapeToString(p.shape));
    return false;
  }
  for (DType dtype : {*float_type_, *int_type_, DType::kBool}) {
    Cursor t = c;
    if (!ReadValues(&t, dtype, count, &found->bytes) || !t.Shape(&found->shape) || found->shape != p.shape) continue;
    found->dtype = RecordDType{.dtype = dtype};
    found->end = t.pos;
    return true;
  }
  *why = absl::StrCat("no shape ", ShapeToString(p.shape), " follows its ", count, " values");
  return false;
}

BincodeReader::Try BincodeReader::TryParam(Cursor c, const RecordLayout::Parameter& p, Found* found, std::string* why) {
  if (!ReadId(&c, &found->id)) return Try::kNone;
  std::string as_data, as_values;
  if (tensor_layout_ != Layout::kValues && TryTensorData(c, p, found, &as_data)) {
    tensor_layout_ = Layout::kTensorData;
    return Try::kFound;
  }
  if (tensor_layout_ != Layout::kTensorData && TryValues(c, p, found, &as_values)) {
    tensor_layout_ = Layout::kValues;
    return Try::kFound;
  }
  *why = tensor_layout_ == Layout::kTensorData ? as_data
         : tensor_layout_ == Layout::kValues
             ? as_values
             : absl::StrCat("as a >= 0.14 TensorData, ", as_data, "; as a <= 0.13 value array, ", as_values);
  return Try::kMismatch;
}

bool BincodeReader::SkipGapToken(const std::vector<uint64_t>& lengths, size_t* next_length) {
  if (c_.left() == 0) return false;
  Cursor t = c_;
  uint64_t v;
  if (*next_length < lengths.size() && t.Varint(&v) && v == lengths[*next_length]) {
    ++*next_length;
    c_ = t;
    return true;
  }
  const uint8_t b = c_.peek();
  if (b <= 1) {  // a constant, None, or an Option's Some tag
    ++c_.pos;
    return true;
  }
  if (b <= 8 && c_.left() > b) {  // <= 0.11: [constant; N], length-prefixed
    for (size_t i = 1; i <= b; ++i) {
      if (c_.peek(i) != 0) return false;
    }
    c_.pos += 1 + b;
    return true;
  }
  return false;
}

absl::StatusOr<ParsedRecord> BincodeReader::Read() {
  ParsedRecord record;
  WEIGHTSTORE_RETURN_IF_ERROR(ReadMetadata(&record));
  if (layout_.parameters.size() > options_.max_tensors) {
    return absl::InvalidArgumentError(absl::StrCat("the layout names ", layout_.parameters.size(),
                                                   " parameters, more than the limit of ", options_.max_tensors));
  }
  CountArrays();
  for (size_t k = 0; k < layout_.parameters.size(); ++k) {
    const RecordLayout::Parameter& p = layout_.parameters[k];
    auto unfit = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("the layout does not fit the file at parameter '", p.path, "' (layout entry ", k, "): ", what));
    };
    const std::vector<uint64_t> lengths = ArrayLengths(k);
    size_t next_length = 0;
    const size_t start = c_.pos;
    std::string mismatch;  // where a ParamId started but the tensor did not fit
    Found found;
    for (;;) {
      std::string why;
      const Try tried = TryParam(c_, p, &found, &why);
      if (tried == Try::kFound) break;
      if (tried == Try::kMismatch && mismatch.empty()) mismatch = absl::StrCat("at offset ", c_.pos, ", ", why);
      const size_t at = c_.pos;
      if (!SkipGapToken(lengths, &next_length)) {
        if (!mismatch.empty()) return unfit(mismatch);
        if (c_.left() == 0) return unfit("the file ends before it");
        return unfit(absl::StrCat("byte ", c_.peek(), " at offset ", at,
                                  " starts no parameter and is no constant or Option tag (tags are 0 or 1)"));
      }
      if (c_.pos - start > kMaxGap) {
        return unfit(mismatch.empty() ? absl::StrCat("no parameter starts within ", kMaxGap, " bytes of offset ", start)
                                      : mismatch);
      }
    }
    absl::StatusOr<CheckpointEntry> entry =
        MakeEntry(p.path, DecodeBurnParamId(found.id), found.dtype, std::move(found.shape), std::move(found.bytes),
                  absl::StrCat("parameter '", p.path, "'"), options_);
    if (!entry.ok()) return entry.status();
    record.entries.push_back(*std::move(entry));
    c_.pos = found.end;
  }
  // After the last parameter, only constants may remain.
  const size_t tail = c_.pos;
  const std::string last = layout_.parameters.empty() ? "the metadata" : layout_.parameters.back().path;
  while (c_.left() > 0) {
    Cursor t = c_;
    absl::string_view id;
    if (ReadId(&t, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the layout does not fit the file: it holds another parameter at offset ", c_.pos, ", after '",
                       last, "', the layout's last"));
    }
    size_t none = 0;
    if (!SkipGapToken({}, &none)) {
      return absl::InvalidArgumentError(absl::StrCat("byte ", c_.peek(), " at offset ", c_.pos, " after '", last,
                                                     "' is no constant or Option tag (tags are 0 or 1)"));
    }
    if (c_.pos - tail > kMaxGap) {
      return absl::InvalidArgumentError(
          absl::StrCat("more than ", kMaxGap, " bytes of constants follow '", last, "', the layout's last"));
    }
  }
  return record;
}

}  // namespace

absl::StatusOr<ParsedRecord> ParseBincode(SharedBytes data, const RecordLayout& layout, const OpenOptions& options) {
  return BincodeReader(std::move(data), layout, options).Read();
}

}  // namespace weightstore::burn_record_internal
