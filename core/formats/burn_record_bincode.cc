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
//
// A >= 0.14 tensor's DType is a variant index whose table shifts between
// versions (kTables). Which table the file uses is resolved once for the
// whole file: first by byte counts (a table stays possible only while every
// tensor's index names a dtype whose size times the tensor's elements is its
// byte count), then, where several tables remain and a tensor's index names
// different dtypes in them (a tie), by the record's metadata (index 3, BF16 up
// to 0.16 and F16 after, is F16 in a Half record), then Bool over U8 (index
// 11: Bool in 0.14-0.15, U8 in 0.16; index 12: Bool in 0.16, U8 in 0.17+)
// when every byte of the tensor is 0 or 1, then the newest table. Each
// tie-break keeps only the tables that agree with it, so the file's tensors
// are read with one table; tensors of no elements (which every table fits)
// are resolved last.
#include <algorithm>
#include <iterator>
#include <optional>
#include <span>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/formats/burn_record_internal.h"
#include "core/status_macros.h"
#include "core/status_util.h"
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

// True when bincode stores `dtype`'s <= 0.13 values as raw LE bytes (read as
// views of the file); the others are varints, converted.
bool IsRawValue(DType dtype) { return dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kBool; }

// The bits of a <= 0.13 varint value `u` of `dtype` (ints zigzag-encoded, f16
// its u16 bits); nullopt when out of the type's range.
std::optional<uint64_t> ValueBits(DType dtype, uint64_t u) {
  if (dtype == DType::kF16) return u > 0xFFFF ? std::nullopt : std::optional<uint64_t>(u);
  const int64_t v = static_cast<int64_t>(u >> 1) ^ -static_cast<int64_t>(u & 1);
  const int bytes = static_cast<int>(DTypeSize(dtype));
  if (bytes < 8 && (v < -(int64_t{1} << (8 * bytes - 1)) || v >= int64_t{1} << (8 * bytes - 1))) return std::nullopt;
  return static_cast<uint64_t>(v);
}

class BincodeReader {
 public:
  BincodeReader(SharedBytes data, const RecordLayout& layout, const OpenOptions& options)
      : base_(std::move(data)),
        layout_(layout),
        options_(options),
        c_{base_.view()},
        budget_(ConvertedBudget(base_.size(), options)) {}

  absl::StatusOr<ParsedRecord> Read();

 private:
  enum class Try { kNone, kFound, kMismatch };
  enum class Layout { kUnknown, kTensorData, kValues };
  // A dtype that a DType index names in one table.
  struct Candidate {
    size_t table;
    RecordDType dtype;
  };
  struct Found {
    absl::string_view id;
    RecordDType dtype;
    // >= 0.14: the dtype each table gives the index (of those whose size
    // fits); resolved after the last parameter (ResolveDTypes).
    std::vector<Candidate> fits;
    std::vector<uint64_t> shape;
    SharedBytes bytes;
    // <= 0.13 values that are varints: where they start, converted once found.
    std::optional<size_t> values_at;
    uint64_t values = 0;
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
  // The dtypes index `index` may be in the tables still possible, for `numel`
  // elements in `nbytes` bytes; narrows the possible tables to theirs.
  bool FitDType(uint64_t index, uint64_t numel, uint64_t nbytes, Cursor* c, std::vector<Candidate>* fits,
                std::string* why);
  // Picks every >= 0.14 tensor's dtype with one table (the file comment).
  void ResolveDTypes(std::vector<Found>* found);
  // Steps over `count` values of `dtype`; false where they do not parse.
  static bool SkipValues(Cursor* c, DType dtype, uint64_t count);
  // Converts found->values varint values at found->values_at, within budget_.
  absl::Status ConvertValues(const RecordLayout::Parameter& p, Found* found);
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
  // "a.b" -> elements, from the layout; keys view layout_'s paths.
  absl::flat_hash_map<absl::string_view, uint64_t> array_lengths_;
  const uint64_t budget_;   // ConvertedBudget
  uint64_t converted_ = 0;  // bytes of <= 0.13 values converted so far
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

// The path before the part that starts at `start` ("a.b" for "a.b.c", 4).
absl::string_view PathBefore(absl::string_view path, size_t start) {
  return path.substr(0, start == 0 ? 0 : start - 1);
}

// Elements of each array the layout's paths index ("layers.0.w", "layers.1.w":
// "layers" has 2): a Vec of modules starts with this count. Prefixes are
// views of the paths (RecordLayout bounds their length and parts).
void BincodeReader::CountArrays() {
  for (const RecordLayout::Parameter& p : layout_.parameters) {
    const absl::string_view path = p.path;
    for (size_t start = 0, dot; (dot = path.find('.', start)) != absl::string_view::npos; start = dot + 1) {
      const absl::string_view part = path.substr(start, dot - start);
      uint64_t index;
      if (part.empty() || !absl::ascii_isdigit(static_cast<unsigned char>(part[0])) ||
          !absl::SimpleAtoi(part, &index)) {
        continue;
      }
      uint64_t& count = array_lengths_[PathBefore(path, start)];
      count = std::max(count, index == UINT64_MAX ? index : index + 1);
    }
  }
}

// The lengths of the arrays whose element 0 begins at parameter k, outermost first.
std::vector<uint64_t> BincodeReader::ArrayLengths(size_t k) const {
  const absl::string_view path = layout_.parameters[k].path;
  const absl::string_view previous = k > 0 ? absl::string_view(layout_.parameters[k - 1].path) : "";
  std::vector<uint64_t> lengths;
  for (size_t start = 0, dot; (dot = path.find('.', start)) != absl::string_view::npos; start = dot + 1) {
    if (path.substr(start, dot - start) != "0") continue;
    // The previous parameter lies in the same array when it has the same
    // parts before this one, then an index that is not its last part.
    const bool same_array = previous.size() > start && previous.substr(0, start) == path.substr(0, start) &&
                            previous.find('.', start) != absl::string_view::npos;
    if (same_array && absl::ascii_isdigit(static_cast<unsigned char>(previous[start]))) continue;
    auto it = array_lengths_.find(PathBefore(path, start));
    if (it != array_lengths_.end()) lengths.push_back(it->second);
  }
  return lengths;
}

bool BincodeReader::FitDType(uint64_t index, uint64_t numel, uint64_t nbytes, Cursor* c, std::vector<Candidate>* fits,
                             std::string* why) {
  fits->clear();
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
    if (CheckedMul(numel, size) == nbytes) fits->push_back({t, dtype});
  }
  if (fits->empty()) {
    *why = quantized ? "the tensor is quantized (QFloat), which is not supported"
                     : absl::StrCat("dtype index ", index, " with ", nbytes, " bytes for ", numel,
                                    " elements fits no Burn version's DType");
    return false;
  }
  // Byte counts rule out the tables that do not fit; ties wait for the file's end.
  uint8_t tables = 0;
  for (const Candidate& f : *fits) tables |= 1 << f.table;
  tables_ = tables;
  // Only 0.21's table has Bool(U32), so a 4-byte Bool is the one candidate.
  if (fits->size() == 1 && fits->front().dtype.bool_bytes == 4) ++c->pos;  // the BoolStore index
  return true;
}

void BincodeReader::ResolveDTypes(std::vector<Found>* found) {
  auto open = [&](const Found& f) {
    std::vector<Candidate> open;
    for (const Candidate& c : f.fits) {
      if (tables_ >> c.table & 1) open.push_back(c);
    }
    return open;
  };
  auto same = [](const RecordDType& a, const RecordDType& b) {
    return a.dtype == b.dtype && a.bool_bytes == b.bool_bytes;
  };
  // Keeps the tables in which `f` is `chosen`.
  auto keep = [&](const std::vector<Candidate>& open, const RecordDType& chosen) {
    uint8_t tables = 0;
    for (const Candidate& c : open) {
      if (same(c.dtype, chosen)) tables |= 1 << c.table;
    }
    tables_ = tables;
  };
  enum class Rule { kMetadata, kBoolOverU8, kNewest };
  // Every table still possible fits every tensor (byte counts), so `open` is
  // never empty, and a tie-break keeps at least one table.
  for (const bool empty : {false, true}) {
    for (const Rule rule : {Rule::kMetadata, Rule::kBoolOverU8, Rule::kNewest}) {
      for (Found& f : *found) {
        if (f.fits.empty() || (CheckedNumElements(f.shape).value_or(1) == 0) != empty) continue;
        const std::vector<Candidate> candidates = open(f);
        const bool tie = std::any_of(candidates.begin(), candidates.end(),
                                     [&](const Candidate& c) { return !same(c.dtype, candidates.front().dtype); });
        if (!tie) continue;
        std::optional<RecordDType> chosen;
        switch (rule) {
          case Rule::kMetadata:  // index 3: BF16 up to 0.16, F16 after; a Half record holds F16
            for (const Candidate& c : candidates) {
              if (c.dtype.dtype == float_type_ || c.dtype.dtype == int_type_) chosen = c.dtype;
            }
            break;
          case Rule::kBoolOverU8: {
            const bool bool_or_u8 = std::all_of(candidates.begin(), candidates.end(), [](const Candidate& c) {
              return c.dtype.dtype == DType::kBool || c.dtype.dtype == DType::kU8;
            });
            if (!bool_or_u8) break;
            const absl::string_view bytes = f.bytes.view();
            const bool flags = std::all_of(bytes.begin(), bytes.end(), [](char b) { return b == 0 || b == 1; });
            chosen = RecordDType{.dtype = flags ? DType::kBool : DType::kU8};
            break;
          }
          case Rule::kNewest:
            chosen = candidates.back().dtype;
            break;
        }
        if (chosen) keep(candidates, *chosen);
      }
    }
  }
  for (Found& f : *found) {
    if (!f.fits.empty()) f.dtype = open(f).front().dtype;
  }
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
  if (!FitDType(index, numel, nbytes, &c, &found->fits, why)) return false;
  found->bytes = View(raw);
  found->values_at.reset();
  found->end = c.pos;
  return true;
}

bool BincodeReader::SkipValues(Cursor* c, DType dtype, uint64_t count) {
  if (count > c->left()) return false;  // every element takes a byte at least
  if (IsRawValue(dtype)) {
    absl::string_view raw;
    return c->Bytes(count * DTypeSize(dtype), &raw);
  }
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t u;
    if (!c->Varint(&u) || !ValueBits(dtype, u)) return false;
  }
  return true;
}

absl::Status BincodeReader::ConvertValues(const RecordLayout::Parameter& p, Found* found) {
  const DType dtype = found->dtype.dtype;
  const uint64_t size = DTypeSize(dtype);
  // found->values <= the bytes they were read from, so this does not overflow.
  const uint64_t need = found->values * size;
  if (need > budget_ - converted_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", ShortForError(p.path), "': its ", found->values, " <= 0.13 values convert to ", need,
        " bytes, past the ", budget_, " bytes this record's converted tensors may take in all (2 x its ", base_.size(),
        " bytes + 64 MiB, at most OpenOptions::max_record_inflated_bytes, ", options_.max_record_inflated_bytes, ")"));
  }
  converted_ += need;
  std::vector<std::byte> data;
  data.reserve(need);
  Cursor c{base_.view(), *found->values_at};
  for (uint64_t i = 0; i < found->values; ++i) {
    uint64_t u = 0;
    c.Varint(&u);  // SkipValues checked every value
    const uint64_t bits = ValueBits(dtype, u).value_or(0);
    for (uint64_t b = 0; b < size; ++b) data.push_back(static_cast<std::byte>(bits >> (8 * b)));
  }
  found->bytes = SharedBytes::FromVector(std::move(data));
  return absl::OkStatus();
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
    if (!SkipValues(&t, dtype, count) || !t.Shape(&found->shape) || found->shape != p.shape) continue;
    found->dtype = RecordDType{.dtype = dtype};
    found->fits.clear();
    found->values = count;
    if (IsRawValue(dtype)) {
      found->bytes = View(c.data.substr(c.pos, count * DTypeSize(dtype)));
      found->values_at.reset();
    } else {
      found->values_at = c.pos;
    }
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
  std::vector<Found> all(layout_.parameters.size());
  for (size_t k = 0; k < layout_.parameters.size(); ++k) {
    const RecordLayout::Parameter& p = layout_.parameters[k];
    auto unfit = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat("the layout does not fit the file at parameter '",
                                                     ShortForError(p.path), "' (layout entry ", k, "): ", what));
    };
    const std::vector<uint64_t> lengths = ArrayLengths(k);
    size_t next_length = 0;
    const size_t start = c_.pos;
    std::string mismatch;  // where a ParamId started but the tensor did not fit
    Found& found = all[k];
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
    if (found.values_at) WEIGHTSTORE_RETURN_IF_ERROR(ConvertValues(p, &found));
    c_.pos = found.end;
  }
  // After the last parameter, only constants may remain.
  const size_t tail = c_.pos;
  const std::string last = layout_.parameters.empty() ? "the metadata" : ShortForError(layout_.parameters.back().path);
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
  ResolveDTypes(&all);
  record.entries.reserve(all.size());
  for (size_t k = 0; k < all.size(); ++k) {
    const RecordLayout::Parameter& p = layout_.parameters[k];
    Found& found = all[k];
    absl::StatusOr<CheckpointEntry> entry =
        MakeEntry(p.path, DecodeBurnParamId(found.id), found.dtype, std::move(found.shape), std::move(found.bytes),
                  absl::StrCat("parameter '", ShortForError(p.path), "'"), options_);
    if (!entry.ok()) return entry.status();
    record.entries.push_back(*std::move(entry));
  }
  return record;
}

}  // namespace

absl::StatusOr<ParsedRecord> ParseBincode(SharedBytes data, const RecordLayout& layout, const OpenOptions& options) {
  return BincodeReader(std::move(data), layout, options).Read();
}

}  // namespace weightstore::burn_record_internal
