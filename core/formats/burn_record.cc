// Burn records: detection, gzip, dispatch to the encodings' readers, and what
// they share (entries, ParamIds, the layout). The self-describing encodings are
// walked in burn_record_tree.cc, bincode is read in burn_record_bincode.cc.
#include "core/formats/burn_record.h"

#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/formats/burn_record_internal.h"
#include "core/formats/byte_reader.h"
#include "core/status_macros.h"
#include "core/status_util.h"
#include "core/target_schema.h"

namespace weightstore {
namespace {

using burn_record_internal::ParsedRecord;
using burn_record_internal::RecordWalker;

// Deflate expands at most about 1032:1; a stream claiming more is a bomb.
constexpr uint64_t kMaxInflateRatio = 1100;
constexpr size_t kSniffBytes = 512;

enum class Encoding { kNone, kMsgpack, kJson, kBincode };

bool IsGzip(absl::string_view data) { return data.size() >= 2 && data[0] == '\x1f' && data[1] == '\x8b'; }
bool IsJsonSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Which record `head` (the first bytes of a record, not gzip) starts: a
// MessagePack BurnRecord map (2 keys up to Burn 0.11, 3 after) whose first key
// is "metadata", a JSON object whose first key is "metadata", or bincode's
// metadata strings: the float type, then the int type (Burn <= 0.11 Full
// wrote "f32"). None of these starts a zip, a pickle or a TAR file.
Encoding Sniff(absl::string_view head) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(head[i]); };
  if (head.size() >= 10 && (byte(0) == 0x82 || byte(0) == 0x83) && head.substr(1, 9) == "\xa8metadata") {
    return Encoding::kMsgpack;
  }
  size_t i = 0;
  while (i < head.size() && IsJsonSpace(head[i])) ++i;
  if (i < head.size() && head[i] == '{') {
    ++i;
    while (i < head.size() && IsJsonSpace(head[i])) ++i;
    return head.substr(i, 10) == "\"metadata\"" ? Encoding::kJson : Encoding::kNone;
  }
  ByteReader reader(head);
  auto text = [&](absl::string_view* out) {
    uint8_t n;
    return reader.ReadU8(&n) && n < 251 && reader.ReadBytes(n, out);
  };
  absl::string_view float_type, int_type;
  if (!text(&float_type) || !text(&int_type)) return Encoding::kNone;
  const bool floats = float_type == "f32" || float_type == "f64" || float_type == "half::binary16::f16";
  const bool ints = int_type == "i32" || int_type == "i64" || int_type == "i16" || int_type == "f32";
  return floats && ints ? Encoding::kBincode : Encoding::kNone;
}

// The first `max_out` bytes a gzip stream inflates to (fewer if it is shorter
// or corrupt), from at most 64 KiB of it: enough to sniff, cheap to detect.
std::string InflateHead(absl::string_view gz, size_t max_out) {
  std::string out(max_out, '\0');
  z_stream zs{};
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) return "";
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(gz.data()));
  zs.avail_in = static_cast<uInt>(std::min<size_t>(gz.size(), 64 << 10));
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(max_out);
  inflate(&zs, Z_SYNC_FLUSH);
  out.resize(zs.total_out);
  inflateEnd(&zs);
  return out;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Inflates the first gzip member of `gz` into one owned buffer, as flate2's
// GzDecoder (which Burn loads with) does: later members and trailing bytes are
// ignored; the member's CRC-32 and size are checked by zlib. The output is
// bounded by `max_bytes` and by kMaxInflateRatio times gz.size(), checked as it
// grows: the buffer never grows past the bound. The trailer's size is only a
// hint for the first allocation.
absl::StatusOr<SharedBytes> Gunzip(absl::string_view gz, uint64_t max_bytes) {
  const uint64_t ratio_bound = CheckedMul(gz.size(), kMaxInflateRatio).value_or(UINT64_MAX);
  const uint64_t limit = std::min(max_bytes, ratio_bound);
  auto too_large = [&] {
    return absl::InvalidArgumentError(
        ratio_bound <= max_bytes
            ? absl::StrCat("the gzip stream inflates past ", limit, " bytes, ", kMaxInflateRatio, " times its ",
                           gz.size(), " compressed bytes (more than deflate can expand: a gzip bomb)")
            : absl::StrCat("the gzip stream inflates past ", limit,
                           " bytes (the bound: OpenOptions::max_record_inflated_bytes)"));
  };
  z_stream zs{};
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) return absl::InternalError("inflateInit2 failed");
  absl::Cleanup end = [&zs] { inflateEnd(&zs); };

  const uint64_t hint = gz.size() >= 18 ? LoadU32(gz.data() + gz.size() - 4) : 0;
  size_t capacity = std::max<uint64_t>(1, std::min(limit, std::max<uint64_t>(hint, 64 << 10)));
  std::unique_ptr<char, FreeDeleter> buffer(static_cast<char*>(std::malloc(capacity)));
  if (buffer == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", capacity, " bytes"));
  constexpr uint64_t kStep = std::numeric_limits<uInt>::max();
  uint64_t in_done = 0, out_done = 0;
  char probe;
  for (;;) {
    // At the bound, one more byte is asked for: none may come.
    const bool at_bound = out_done == capacity && capacity >= limit;
    if (out_done == capacity && !at_bound) {
      const size_t grown = std::min<uint64_t>(limit, CheckedMul(capacity, 2).value_or(limit));
      char* p = static_cast<char*>(std::realloc(buffer.get(), grown));
      if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", grown, " bytes"));
      buffer.release();
      buffer.reset(p);
      capacity = grown;
    }
    zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(gz.data() + in_done));
    zs.avail_in = static_cast<uInt>(std::min(gz.size() - in_done, kStep));
    zs.next_out = reinterpret_cast<Bytef*>(at_bound ? &probe : buffer.get() + out_done);
    zs.avail_out = at_bound ? 1 : static_cast<uInt>(std::min(capacity - out_done, kStep));
    const uInt in_before = zs.avail_in, out_before = zs.avail_out;
    const int rc = inflate(&zs, Z_NO_FLUSH);
    in_done += in_before - zs.avail_in;
    if (at_bound && zs.avail_out != out_before) return too_large();
    out_done += out_before - zs.avail_out;
    if (rc == Z_STREAM_END) break;
    if (rc == Z_MEM_ERROR) return absl::ResourceExhaustedError("zlib is out of memory");
    if (rc == Z_BUF_ERROR && in_done == gz.size()) {
      return absl::InvalidArgumentError(absl::StrCat("the gzip stream is truncated (", gz.size(), " bytes)"));
    }
    if (rc != Z_OK && rc != Z_BUF_ERROR) {
      return absl::InvalidArgumentError(
          absl::StrCat("the gzip stream is corrupt: ", zs.msg != nullptr ? zs.msg : "zlib error"));
    }
  }
  if (char* p = static_cast<char*>(std::realloc(buffer.get(), std::max<uint64_t>(out_done, 1)))) {
    buffer.release();
    buffer.reset(p);
  }
  char* data = buffer.get();
  std::shared_ptr<void> owner(buffer.release(), FreeDeleter());
  return SharedBytes(std::move(owner), std::span(reinterpret_cast<const std::byte*>(data), out_done));
}

}  // namespace

bool IsBurnRecord(absl::string_view file) {
  if (IsGzip(file)) return Sniff(InflateHead(file, kSniffBytes)) != Encoding::kNone;
  return Sniff(file.substr(0, kSniffBytes)) != Encoding::kNone;
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseBurnRecord(SharedBytes bytes, const std::string& path,
                                                                  const OpenOptions& options,
                                                                  const RecordLayout* layout) {
  const bool gzip = IsGzip(bytes.view());
  std::string container = gzip ? "gzip" : "record";
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is not a valid Burn record (", container, "): ", what));
  };
  SharedBytes record = bytes;
  if (gzip) {
    absl::StatusOr<SharedBytes> inflated = Gunzip(bytes.view(), options.max_record_inflated_bytes);
    if (!inflated.ok()) {
      if (absl::IsInvalidArgument(inflated.status())) return bad(inflated.status().message());
      return absl::Status(inflated.status().code(),
                          absl::StrCat("'", path, "': cannot inflate: ", inflated.status().message()));
    }
    record = *std::move(inflated);
  }
  const Encoding encoding = Sniff(record.view().substr(0, kSniffBytes));
  if (encoding == Encoding::kNone) {
    return bad(gzip ? "the inflated stream is not a MessagePack, JSON or bincode record"
                    : "no MessagePack, JSON or bincode record starts the file");
  }
  container = absl::StrCat(encoding == Encoding::kMsgpack ? "mpk"
                           : encoding == Encoding::kJson  ? "json"
                                                          : "bin",
                           gzip ? ".gz" : "");

  ParsedRecord parsed;
  if (encoding == Encoding::kBincode) {
    std::optional<RecordLayout> loaded;
    if (layout == nullptr) {
      if (options.record_layout.empty()) {
        return bad(
            "this is a Burn bincode record, which stores no tensor names: read it with a layout of the module's "
            "parameters in declaration order (--record-layout SCHEMA.json: {\"parameters\": [{\"path\": ..., "
            "\"shape\": [...]}, ...]})");
      }
      absl::StatusOr<RecordLayout> read = RecordLayout::Load(options.record_layout);
      if (!read.ok()) return bad(absl::StrCat("cannot read its layout: ", read.status().message()));
      loaded = *std::move(read);
      layout = &*loaded;
    }
    absl::StatusOr<ParsedRecord> read = burn_record_internal::ParseBincode(record, *layout, options);
    if (!read.ok()) return bad(read.status().message());
    parsed = *std::move(read);
  } else {
    RecordWalker walker(record, options);
    absl::Status walked = encoding == Encoding::kMsgpack ? burn_record_internal::WalkMsgpack(record.view(), &walker)
                                                         : burn_record_internal::WalkJson(record.view(), &walker);
    if (!walked.ok()) return bad(walked.message());
    parsed = walker.Take();
  }
  return Checkpoint::Create(kBurnRecordFormat, path, std::move(parsed.metadata), std::move(parsed.entries), container,
                            {}, options);
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadBurnRecord(std::shared_ptr<const MappedFile> file,
                                                                 const OpenOptions& options) {
  return ParseBurnRecord(file->bytes(), file->path(), options);
}

std::optional<uint64_t> DecodeBurnParamId(absl::string_view id) {
  // Unpadded base32 of n bytes has ceil(8n / 5) characters; the bits left over
  // after the last whole byte (fewer than 5) must be zero.
  const size_t bits = id.size() * 5, bytes = bits / 8, extra = bits % 8;
  if (bytes == 0 || bytes > 8 || extra >= 5) return std::nullopt;
  unsigned __int128 acc = 0;
  for (char c : id) {
    int v;
    if (c >= '0' && c <= '9') {
      v = c - '0';
    } else if (c >= 'a' && c <= 'v') {
      v = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    acc = acc << 5 | static_cast<unsigned>(v);
  }
  if ((acc & ((1u << extra) - 1)) != 0) return std::nullopt;
  acc >>= extra;
  uint64_t out = 0;  // the first byte is the least significant
  for (size_t k = 0; k < bytes; ++k) out |= static_cast<uint64_t>((acc >> (8 * (bytes - 1 - k))) & 0xFF) << (8 * k);
  return out;
}

namespace {

// A layout from a parsed schema: its paths and shapes, bounded for the bincode
// reader's search.
absl::StatusOr<RecordLayout> LayoutOf(TargetSchema schema, absl::string_view source) {
  auto bad = [&](size_t i, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("record layout '", source, "': parameters[", i, "]", what));
  };
  RecordLayout layout;
  layout.parameters.reserve(schema.parameters.size());
  for (size_t i = 0; i < schema.parameters.size(); ++i) {
    TargetParameter& p = schema.parameters[i];
    // Bounded, so that the bincode reader's work per path (its prefixes) is.
    if (p.path.size() > burn_record_internal::kMaxLayoutPathBytes) {
      return bad(i, absl::StrCat(".path '", ShortForError(p.path), "' is ", p.path.size(), " bytes; at most ",
                                 burn_record_internal::kMaxLayoutPathBytes));
    }
    const size_t parts = static_cast<size_t>(std::count(p.path.begin(), p.path.end(), '.')) + 1;
    if (parts > burn_record_internal::kMaxLayoutPathParts) {
      return bad(i, absl::StrCat(".path '", ShortForError(p.path), "' has ", parts, " '.'-separated parts; at most ",
                                 burn_record_internal::kMaxLayoutPathParts));
    }
    if (p.shape.size() > burn_record_internal::kMaxRank) {
      return bad(i,
                 absl::StrCat(".shape has ", p.shape.size(), " dimensions; at most ", burn_record_internal::kMaxRank));
    }
    layout.parameters.push_back({std::move(p.path), std::move(p.shape)});
  }
  return layout;
}

}  // namespace

absl::StatusOr<RecordLayout> RecordLayout::FromJson(absl::string_view json, absl::string_view source) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(TargetSchema schema, TargetSchema::FromJson(json, source));
  return LayoutOf(std::move(schema), source);
}

absl::StatusOr<RecordLayout> RecordLayout::Load(const std::string& path) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(TargetSchema schema, TargetSchema::Load(path));
  return LayoutOf(std::move(schema), path);
}

namespace burn_record_internal {

uint64_t ConvertedBudget(uint64_t record_bytes, const OpenOptions& options) {
  const uint64_t natural =
      CheckedAdd(CheckedMul(record_bytes, 2).value_or(UINT64_MAX), uint64_t{64} << 20).value_or(UINT64_MAX);
  return std::min(natural, options.max_record_inflated_bytes);
}

std::optional<DType> ElementDType(absl::string_view type_name) {
  if (type_name == "f32") return DType::kF32;
  if (type_name == "f64") return DType::kF64;
  if (type_name == "half::binary16::f16") return DType::kF16;
  if (type_name == "i32") return DType::kI32;
  if (type_name == "i64") return DType::kI64;
  if (type_name == "i16") return DType::kI16;
  return std::nullopt;
}

absl::StatusOr<CheckpointEntry> MakeEntry(std::string name, std::optional<uint64_t> param_id, RecordDType dtype,
                                          std::vector<uint64_t> shape, SharedBytes bytes, absl::string_view where,
                                          const OpenOptions& options) {
  auto bad = [&](absl::string_view what) { return absl::InvalidArgumentError(absl::StrCat(where, ": ", what)); };
  if (name.empty()) return bad("the tensor's name is empty");
  if (name.size() > options.max_name_bytes) {
    return bad(
        absl::StrCat("the tensor's name is ", name.size(), " bytes; at most ", options.max_name_bytes, " are allowed"));
  }
  if (shape.size() > kMaxRank) return bad(absl::StrCat("the shape has ", shape.size(), " dimensions; at most 64"));
  const bool is_bool = dtype.dtype == DType::kBool;
  const uint64_t element = is_bool ? dtype.bool_bytes : DTypeSize(dtype.dtype);
  const std::optional<uint64_t> numel = CheckedNumElements(shape);
  const std::optional<uint64_t> need = numel ? CheckedMul(*numel, element) : std::nullopt;
  const std::string type = is_bool && dtype.bool_bytes == 4 ? "Bool(U32)" : std::string(DTypeName(dtype.dtype));
  if (!need) return bad(absl::StrCat("the size of ", type, " ", ShapeToString(shape), " overflows 64 bits"));
  if (bytes.size() != *need) {
    return bad(absl::StrCat("holds ", bytes.size(), " bytes, but ", type, " ", ShapeToString(shape), " needs ", *need));
  }
  if (is_bool) {
    std::vector<std::byte> narrowed;
    if (element != 1) narrowed.resize(*numel);
    for (uint64_t i = 0; i < *numel; ++i) {
      const char* p = bytes.view().data() + i * element;
      const uint32_t v = element == 1 ? static_cast<uint8_t>(*p) : LoadU32(p);
      if (v > 1) return bad(absl::StrCat("BOOL element ", i, " is ", v, ", not 0 or 1"));
      if (element != 1) narrowed[i] = std::byte(v);
    }
    if (element != 1) bytes = SharedBytes::FromVector(std::move(narrowed));
  }
  CheckpointEntry entry;
  entry.spec.name = std::move(name);
  entry.spec.dtype = dtype.dtype;
  entry.spec.shape = std::move(shape);
  entry.spec.param_id = param_id;
  entry.layout.storage = LazyStorage::Ready(std::move(bytes));
  return entry;
}

}  // namespace burn_record_internal

namespace {
constexpr absl::string_view kBurnRecordExtensions[] = {".mpk", ".mpk.gz", ".json.gz", ".bin.gz"};
// ".json" is named only: a models folder holds config.json and tokenizer.json.
// ".bin" stays PyTorch's; a bincode record is told apart by its content.
constexpr absl::string_view kBurnRecordNamedExtensions[] = {".json"};
// Written as NamedMpk only: Burn's NamedMpkGz record is that file gzipped.
constexpr absl::string_view kBurnRecordWriteExtensions[] = {".mpk"};
}  // namespace

constinit const FormatSpec kBurnRecordFormat = {
    .name = "burn-record",
    .extensions = kBurnRecordExtensions,
    .named_extensions = kBurnRecordNamedExtensions,
    .detect = IsBurnRecord,
    .open = ReadBurnRecord,
    .plan = burn_record_internal::PlanNamedMpk,
    .write_extensions = kBurnRecordWriteExtensions,
};

}  // namespace weightstore
