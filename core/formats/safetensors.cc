#include "core/formats/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <iterator>
#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/formats/byte_reader.h"
#include "core/status_macros.h"

namespace weightstore {
namespace {

// The reference writer's dtype order (safetensors 0.8's `Dtype` enum): BOOL <
// F4 < F6_E2M3 < F6_E3M2 < U8 < I8 < F8_E5M2 < F8_E4M3 < F8_E8M0 <
// F8_E4M3FNUZ < F8_E5M2FNUZ < I16 < U16 < F16 < BF16 < I32 < U32 < F32 < C64 <
// F64 < I64 < U64.
int DTypeOrder(DType dtype) {
  constexpr DType kOrder[] = {DType::kBool,       DType::kF4,     DType::kF6E2M3, DType::kF6E3M2, DType::kU8,
                              DType::kI8,         DType::kF8E5M2, DType::kF8E4M3, DType::kF8E8M0, DType::kF8E4M3FNUZ,
                              DType::kF8E5M2FNUZ, DType::kI16,    DType::kU16,    DType::kF16,    DType::kBF16,
                              DType::kI32,        DType::kU32,    DType::kF32,    DType::kC64,    DType::kF64,
                              DType::kI64,        DType::kU64};
  for (int i = 0; i < static_cast<int>(std::size(kOrder)); ++i) {
    if (kOrder[i] == dtype) return i;
  }
  return static_cast<int>(std::size(kOrder));
}

constexpr absl::string_view kMetadataKey = "__metadata__";
constexpr size_t kMaxJsonDepth = 8;  // the format needs 3
constexpr size_t kMaxNameBytes = 4096;

bool IsJsonSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

struct RawEntry {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> offsets;
  bool has_dtype = false, has_shape = false, has_offsets = false;
};

// A SAX handler for nlohmann::json that reads exactly the SafeTensors header
// shape and rejects anything else with a message naming the key. It builds no
// DOM, so a header with 100,000 tensors parses in linear time.
class HeaderSax {
 public:
  HeaderSax(uint64_t max_tensors) : max_tensors_(max_tensors) {}

  std::vector<RawEntry>& entries() { return entries_; }
  Metadata& metadata() { return metadata_; }
  const std::string& error() const { return error_; }

  bool null() { return Scalar("null"); }
  bool boolean(bool) { return Scalar("a boolean"); }
  bool number_integer(int64_t) { return Scalar("a negative number"); }
  bool number_float(double, const std::string&) { return Scalar("a non-integer number"); }
  bool number_unsigned(uint64_t value) {
    if (stack_.empty()) return Fail("header is not a JSON object");
    Context& top = stack_.back();
    if (top == Context::kShape) return Push(&entries_.back().shape, value);
    if (top == Context::kOffsets) return Push(&entries_.back().offsets, value);
    return Scalar("a number");
  }
  bool string(std::string& value) {
    if (stack_.empty()) return Fail("header is not a JSON object");
    if (stack_.back() == Context::kMetadata) {
      metadata_[key_] = std::move(value);
      return true;
    }
    if (stack_.back() == Context::kTensor && key_ == "dtype") {
      entries_.back().dtype = std::move(value);
      entries_.back().has_dtype = true;
      return true;
    }
    return Scalar("a string");
  }
  bool binary(nlohmann::json::binary_t&) { return Scalar("binary"); }

  bool start_object(size_t) {
    if (stack_.size() >= kMaxJsonDepth) return Fail("JSON nesting is too deep");
    if (stack_.empty()) return Enter(Context::kTop);
    switch (stack_.back()) {
      case Context::kTop:
        if (key_ == kMetadataKey) return Enter(Context::kMetadata);
        entries_.emplace_back();
        entries_.back().name = key_;
        return Enter(Context::kTensor);
      case Context::kTensor:
        if (IsKnownField())
          return Fail(absl::StrCat("field '", key_, "' of tensor '", entries_.back().name, "' has the wrong type"));
        return Enter(Context::kSkip);
      case Context::kSkip:
        return Enter(Context::kSkip);
      case Context::kMetadata:
        return Fail(absl::StrCat("__metadata__ value for '", key_, "' is not a string"));
      default:
        return Fail(absl::StrCat("tensor '", entries_.back().name, "' has a nested value in '", key_, "'"));
    }
  }
  bool start_array(size_t) {
    if (stack_.size() >= kMaxJsonDepth) return Fail("JSON nesting is too deep");
    if (stack_.empty()) return Fail("header is not a JSON object");
    switch (stack_.back()) {
      case Context::kTop:
        return Fail(absl::StrCat("entry '", key_, "' is not an object"));
      case Context::kTensor:
        if (key_ == "shape") {
          entries_.back().has_shape = true;
          return Enter(Context::kShape);
        }
        if (key_ == "data_offsets") {
          entries_.back().has_offsets = true;
          return Enter(Context::kOffsets);
        }
        if (IsKnownField())
          return Fail(absl::StrCat("field '", key_, "' of tensor '", entries_.back().name, "' has the wrong type"));
        return Enter(Context::kSkip);
      case Context::kSkip:
        return Enter(Context::kSkip);
      case Context::kMetadata:
        return Fail(absl::StrCat("__metadata__ value for '", key_, "' is not a string"));
      default:
        return Fail(absl::StrCat("tensor '", entries_.back().name, "' has a nested array in '", key_, "'"));
    }
  }
  bool end_object() { return Leave(); }
  bool end_array() { return Leave(); }

  bool key(std::string& key) {
    Context top = stack_.back();
    if (top == Context::kTop) {
      if (key.empty()) return Fail("a tensor has an empty name");
      if (key.size() > kMaxNameBytes)
        return Fail(absl::StrCat("a tensor name is longer than ", kMaxNameBytes, " bytes"));
      if (key.find('\0') != std::string::npos) return Fail("a tensor name contains NUL");
      if (!top_keys_.insert(key).second) return Fail(absl::StrCat("duplicate key '", key, "'"));
      if (entries_.size() >= max_tensors_) return Fail(absl::StrCat("more than ", max_tensors_, " tensors"));
    } else if (top == Context::kMetadata) {
      if (metadata_.contains(key)) return Fail(absl::StrCat("duplicate __metadata__ key '", key, "'"));
    } else if (top == Context::kTensor) {
      if (!entry_keys_.insert(key).second) {
        return Fail(absl::StrCat("tensor '", entries_.back().name, "' has a duplicate field '", key, "'"));
      }
    }
    key_ = std::move(key);
    return true;
  }

  bool parse_error(size_t position, const std::string&, const nlohmann::json::exception& e) {
    if (error_.empty()) error_ = absl::StrCat("invalid JSON at header byte ", position);
    return false;
  }

 private:
  enum class Context { kTop, kMetadata, kTensor, kShape, kOffsets, kSkip };

  bool IsKnownField() const { return key_ == "dtype" || key_ == "shape" || key_ == "data_offsets"; }
  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }
  bool Enter(Context context) {
    if (context == Context::kTensor) entry_keys_.clear();
    stack_.push_back(context);
    return true;
  }
  bool Leave() {
    stack_.pop_back();
    return true;
  }
  bool Push(std::vector<uint64_t>* out, uint64_t value) {
    if (out->size() >= 64) return Fail(absl::StrCat("tensor '", entries_.back().name, "' has more than 64 dimensions"));
    out->push_back(value);
    return true;
  }
  bool Scalar(absl::string_view what) {
    if (stack_.empty()) return Fail("header is not a JSON object");
    switch (stack_.back()) {
      case Context::kTop:
        return Fail(absl::StrCat("entry '", key_, "' is not an object"));
      case Context::kMetadata:
        return Fail(absl::StrCat("__metadata__ value for '", key_, "' is not a string"));
      case Context::kTensor:
        if (IsKnownField())
          return Fail(absl::StrCat("field '", key_, "' of tensor '", entries_.back().name, "' is ", what));
        return true;  // unknown fields are ignored, as the reference reader does
      case Context::kShape:
      case Context::kOffsets:
        return Fail(absl::StrCat("tensor '", entries_.back().name, "' has ", what, " in '", key_,
                                 "' (expected a non-negative integer)"));
      case Context::kSkip:
        return true;
    }
    return true;
  }

  uint64_t max_tensors_;
  std::vector<Context> stack_;
  std::string key_;
  std::vector<RawEntry> entries_;
  Metadata metadata_;
  absl::flat_hash_set<std::string> top_keys_;
  absl::flat_hash_set<std::string> entry_keys_;
  std::string error_;
};

}  // namespace

bool IsSafeTensors(absl::string_view file) {
  if (file.size() < 9) return false;
  uint64_t n = LoadU64(file.data());
  if (n == 0 || n > file.size() - 8) return false;
  size_t i = 8;
  while (i < 8 + n && IsJsonSpace(file[i])) ++i;
  return i < 8 + n && file[i] == '{';
}

absl::StatusOr<SafeTensorsHeader> ParseSafeTensorsHeader(absl::string_view prefix, uint64_t file_size,
                                                         const std::string& path, const OpenOptions& options) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a valid SafeTensors file: ", what));
  };
  if (file_size < 8 || prefix.size() < 8) return bad("shorter than the 8-byte header length");
  const uint64_t n = LoadU64(prefix.data());
  if (n > options.max_header_bytes) {
    return bad(absl::StrCat("header length ", n, " exceeds the limit of ", options.max_header_bytes));
  }
  if (n > file_size - 8) return bad(absl::StrCat("header length ", n, " runs past the end of the file"));
  if (n > prefix.size() - 8)
    return bad(absl::StrCat("header length ", n, " runs past the ", prefix.size(), " bytes read"));
  absl::string_view header = prefix.substr(8, n);

  HeaderSax sax(options.max_tensors);
  bool ok = nlohmann::json::sax_parse(header.begin(), header.end(), &sax, nlohmann::json::input_format_t::json,
                                      /*strict=*/true);
  if (!ok || !sax.error().empty()) return bad(sax.error().empty() ? "invalid JSON" : sax.error());

  // Validate sizes, then offsets: contiguous from 0 and covering the data exactly.
  SafeTensorsHeader out;
  out.data_start = 8 + n;
  const uint64_t data_size = file_size - out.data_start;
  std::vector<RawEntry>& raw = sax.entries();
  out.tensors.reserve(raw.size());
  for (RawEntry& e : raw) {
    auto fault = [&](absl::string_view what) { return bad(absl::StrCat("tensor '", e.name, "' ", what)); };
    if (!e.has_dtype || !e.has_shape || !e.has_offsets) return fault("lacks dtype, shape or data_offsets");
    std::optional<DType> dtype = ParseDType(e.dtype);
    if (!dtype) return fault(absl::StrCat("has unsupported dtype '", e.dtype, "'"));
    if (e.offsets.size() != 2) return fault("needs exactly two data_offsets");
    auto numel = CheckedNumElements(e.shape);
    if (numel && !DTypeBytes(*dtype, *numel) && CheckedMul(*numel, DTypeBits(*dtype))) {
      return fault(absl::StrCat("has ", *numel, " ", DTypeName(*dtype), " elements: ", *numel * DTypeBits(*dtype),
                                " bits, not a whole number of bytes"));
    }
    auto nbytes = numel ? DTypeBytes(*dtype, *numel) : std::nullopt;
    if (!nbytes) return fault(absl::StrCat("has a shape ", ShapeToString(e.shape), " whose size overflows"));
    if (e.offsets[1] < e.offsets[0]) return fault("has data_offsets that end before they begin");
    if (e.offsets[1] - e.offsets[0] != *nbytes) {
      return fault(absl::StrCat("covers ", e.offsets[1] - e.offsets[0], " bytes, but ", DTypeName(*dtype), " ",
                                ShapeToString(e.shape), " needs ", *nbytes));
    }
    SafeTensorsHeader::Tensor t;
    t.spec.name = std::move(e.name);
    t.spec.dtype = *dtype;
    t.spec.shape = std::move(e.shape);
    t.offset = e.offsets[0];
    out.tensors.push_back(std::move(t));
  }
  std::vector<size_t> by_offset(out.tensors.size());
  for (size_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
  std::sort(by_offset.begin(), by_offset.end(), [&](size_t a, size_t b) {
    const auto &ea = out.tensors[a], &eb = out.tensors[b];
    return std::pair(ea.offset, ea.spec.byte_size()) < std::pair(eb.offset, eb.spec.byte_size());
  });
  uint64_t expected = 0;
  for (size_t i : by_offset) {
    const SafeTensorsHeader::Tensor& t = out.tensors[i];
    if (t.offset != expected) {
      return bad(absl::StrCat("tensor '", t.spec.name, "' starts at data offset ", t.offset, ", expected ", expected,
                              t.offset < expected ? " (overlap)" : " (gap)"));
    }
    expected += t.spec.byte_size();
  }
  if (expected != data_size) {
    return bad(absl::StrCat("tensors cover ", expected, " data bytes, but the file holds ", data_size,
                            expected < data_size ? " (trailing bytes)" : " (truncated)"));
  }
  out.metadata = std::move(sax.metadata());
  return out;
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseSafeTensors(SharedBytes bytes, const std::string& path,
                                                                   const OpenOptions& options) {
  absl::string_view file = bytes.view();
  WEIGHTSTORE_ASSIGN_OR_RETURN(SafeTensorsHeader header, ParseSafeTensorsHeader(file, file.size(), path, options));
  std::shared_ptr<const LazyStorage> storage =
      LazyStorage::Ready(bytes.Subspan(header.data_start, file.size() - header.data_start));
  std::vector<CheckpointEntry> entries;
  entries.reserve(header.tensors.size());
  for (SafeTensorsHeader::Tensor& t : header.tensors) {
    CheckpointEntry entry;
    entry.spec = std::move(t.spec);
    entry.layout.storage = storage;
    entry.layout.offset = t.offset;
    entries.push_back(std::move(entry));
  }
  return Checkpoint::Create(kSafeTensorsFormat, path, std::move(header.metadata), std::move(entries), "", {}, options);
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadSafeTensors(std::shared_ptr<const MappedFile> file,
                                                                  const OpenOptions& options) {
  return ParseSafeTensors(file->bytes(), file->path(), options);
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> OpenShardedSafeTensors(const std::string& index_path,
                                                                         const OpenOptions& options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> index_file, OpenCheckpointFile(index_path, options));
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("'", index_path, "' is not a valid SafeTensors index: ", what));
  };
  // The index is small and trusted less than nothing; nlohmann's DOM is fine here,
  // but duplicate keys would be silently merged, so reject them while parsing.
  std::string duplicate;
  nlohmann::json::parser_callback_t on_event;
  std::vector<absl::flat_hash_set<std::string>> seen;
  on_event = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) seen.emplace_back();
    if (event == E::object_end && !seen.empty()) seen.pop_back();
    if (event == E::key && !seen.empty() && !seen.back().insert(parsed.get<std::string>()).second &&
        duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return depth <= 8;
  };
  nlohmann::json index =
      nlohmann::json::parse(index_file->bytes().view().begin(), index_file->bytes().view().end(), on_event,
                            /*allow_exceptions=*/false);
  if (index.is_discarded()) return bad("invalid JSON");
  if (!duplicate.empty()) return bad(absl::StrCat("duplicate key '", duplicate, "'"));
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return bad("no \"weight_map\" object");
  }
  Metadata metadata;
  if (index.contains("metadata") && index["metadata"].is_object()) {
    for (auto& [key, value] : index["metadata"].items()) {
      metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
    }
  }
  // Shards in first-mention order; tensor order follows the shards.
  std::vector<std::string> shard_names;
  absl::flat_hash_map<std::string, std::string> shard_of;
  for (auto& [tensor, shard] : index["weight_map"].items()) {
    if (!shard.is_string()) return bad(absl::StrCat("weight_map entry '", tensor, "' is not a string"));
    std::string name = shard.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "..") {
      return bad(absl::StrCat("shard name '", name, "' must be a file name in the index's folder"));
    }
    if (std::find(shard_names.begin(), shard_names.end(), name) == shard_names.end()) shard_names.push_back(name);
    shard_of[tensor] = name;
  }
  const std::filesystem::path folder = std::filesystem::path(index_path).parent_path();
  std::vector<CheckpointEntry> entries;
  std::vector<std::shared_ptr<const MappedFile>> files;
  for (const std::string& shard_name : shard_names) {
    std::string shard_path = (folder / shard_name).string();
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> shard_file, OpenCheckpointFile(shard_path, options));
    files.push_back(shard_file);
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> shard,
                                 ParseSafeTensors(shard_file->bytes(), shard_path, options));
    for (const CheckpointEntry& entry : shard->entries()) {
      auto it = shard_of.find(entry.spec.name);
      if (it == shard_of.end()) {
        return bad(absl::StrCat("shard '", shard_name, "' holds tensor '", entry.spec.name,
                                "', which the weight_map does not list"));
      }
      if (it->second != shard_name) {
        return bad(absl::StrCat("tensor '", entry.spec.name, "' is in shard '", shard_name,
                                "' but the weight_map names '", it->second, "'"));
      }
      shard_of.erase(it);
      entries.push_back(entry);
    }
  }
  if (!shard_of.empty()) {
    return bad(absl::StrCat("tensor '", shard_of.begin()->first, "' is in no shard (weight_map names '",
                            shard_of.begin()->second, "')"));
  }
  if (entries.size() > options.max_tensors) return bad(absl::StrCat("more than ", options.max_tensors, " tensors"));
  return Checkpoint::Create(kSafeTensorsFormat, index_path, std::move(metadata), std::move(entries), "",
                            std::move(files), options);
}

namespace {

absl::StatusOr<WritePlan> PlanSafeTensorsLayout(const std::vector<TensorSpec>& tensors, const Metadata& metadata,
                                                bool sorted) {
  WritePlan plan;
  plan.order.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) plan.order[i] = i;
  if (sorted) {
    std::sort(plan.order.begin(), plan.order.end(), [&](size_t a, size_t b) {
      int oa = DTypeOrder(tensors[a].dtype), ob = DTypeOrder(tensors[b].dtype);
      if (oa != ob) return oa > ob;
      return tensors[a].name < tensors[b].name;
    });
  }
  // ordered_json keeps insertion order; keys are unique by construction, so its
  // linear lookup is never exercised.
  std::string json = "{";
  bool first = true;
  auto append_key = [&](const std::string& key) {
    if (!first) json += ',';
    first = false;
    json += nlohmann::json(key).dump();
    json += ':';
  };
  if (!metadata.empty()) {
    append_key(std::string(kMetadataKey));
    json += nlohmann::json(metadata).dump();
  }
  uint64_t offset = 0;
  plan.offsets.reserve(tensors.size());
  for (size_t i : plan.order) {
    const TensorSpec& t = tensors[i];
    if (t.name == kMetadataKey) {
      return absl::InvalidArgumentError("a tensor may not be named '__metadata__' in SafeTensors");
    }
    uint64_t end = offset + t.byte_size();
    append_key(t.name);
    nlohmann::ordered_json entry;
    entry["dtype"] = std::string(DTypeName(t.dtype));
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, end};
    json += entry.dump();
    plan.offsets.push_back(offset);
    offset = end;
  }
  json += '}';
  while (json.size() % 8 != 0) json += ' ';
  plan.header.resize(8);
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) plan.header[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  plan.header += json;
  for (uint64_t& o : plan.offsets) o += plan.header.size();
  plan.file_size = plan.header.size() + offset;
  return plan;
}

}  // namespace

absl::StatusOr<WritePlan> PlanSafeTensors(const std::vector<TensorSpec>& tensors, const Metadata& metadata) {
  return PlanSafeTensorsLayout(tensors, metadata, /*sorted=*/true);
}

absl::StatusOr<WritePlan> PlanSafeTensorsInOrder(const std::vector<TensorSpec>& tensors, const Metadata& metadata) {
  return PlanSafeTensorsLayout(tensors, metadata, /*sorted=*/false);
}

std::vector<std::string> ShardFilesOf(const std::string& index_path) {
  // An index is a file of a hub cache or a models folder, not trusted: its
  // size and its distinct shards are bounded, and each is looked up once.
  constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;
  constexpr size_t kMaxShards = 65536;
  std::vector<std::string> shards;
  auto file = MappedFile::Open(index_path);
  if (!file.ok() || (*file)->size() > kMaxIndexBytes) return shards;
  nlohmann::json doc = nlohmann::json::parse((*file)->bytes().view().begin(), (*file)->bytes().view().end(), nullptr,
                                             /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) return shards;
  const std::filesystem::path folder = std::filesystem::path(index_path).parent_path();
  absl::flat_hash_set<std::string> seen;
  for (const auto& [tensor, shard] : doc["weight_map"].items()) {
    if (!shard.is_string()) continue;
    std::string path = (folder / shard.get<std::string>()).string();
    if (!seen.insert(path).second) continue;
    if (shards.size() == kMaxShards) return {};  // not an index this daemon serves
    shards.push_back(std::move(path));
  }
  return shards;
}

namespace {
constexpr absl::string_view kSafeTensorsExtensions[] = {".safetensors"};
}  // namespace

constinit const FormatSpec kSafeTensorsFormat = {
    .name = "safetensors",
    .extensions = kSafeTensorsExtensions,
    .detect = IsSafeTensors,
    .open = ReadSafeTensors,
    .index_suffix = ".safetensors.index.json",
    .open_index = OpenShardedSafeTensors,
    .index_files = ShardFilesOf,
    .plan = PlanSafeTensors,
    .plan_in_order = PlanSafeTensorsInOrder,
};

}  // namespace weightstore
