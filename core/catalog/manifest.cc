#include "core/catalog/manifest.h"

#include <xxhash.h>

#include <algorithm>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/parallel_for.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace weightstore {

std::string TensorDigest::Hex() const { return absl::StrFormat("%016x%016x", high, low); }

std::optional<TensorDigest> TensorDigest::FromHex(absl::string_view hex) {
  if (hex.size() != 32) return std::nullopt;
  uint64_t half[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    int v;
    if (c >= '0' && c <= '9') {
      v = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      v = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    half[i / 16] = (half[i / 16] << 4) | static_cast<uint64_t>(v);
  }
  return TensorDigest{half[0], half[1]};
}

TensorDigest DigestBytes(std::span<const std::byte> bytes) {
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return TensorDigest{h.high64, h.low64};
}

struct DigestBuilder::State {
  XXH3_state_t* xxh = XXH3_createState();
  ~State() { XXH3_freeState(xxh); }
};

DigestBuilder::DigestBuilder() : state_(std::make_unique<State>()) {
  if (state_->xxh == nullptr) throw std::bad_alloc();
  XXH3_128bits_reset(state_->xxh);
}
DigestBuilder::~DigestBuilder() = default;
DigestBuilder::DigestBuilder(DigestBuilder&&) noexcept = default;
DigestBuilder& DigestBuilder::operator=(DigestBuilder&&) noexcept = default;

void DigestBuilder::Update(absl::string_view bytes) { XXH3_128bits_update(state_->xxh, bytes.data(), bytes.size()); }

TensorDigest DigestBuilder::Finish() const {
  const XXH128_hash_t h = XXH3_128bits_digest(state_->xxh);
  return TensorDigest{h.high64, h.low64};
}

CheckpointManifest::CheckpointManifest(std::string version, std::vector<ManifestTensor> tensors)
    : version_(std::move(version)), tensors_(std::move(tensors)) {
  by_name_.reserve(tensors_.size());
  memory_bytes_ = sizeof(*this) + version_.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    by_name_.emplace(tensors_[i].name, i);
    // The tensor, its name twice (here and as a key) and its shape.
    memory_bytes_ += sizeof(ManifestTensor) + 2 * tensors_[i].name.size() + 8 * tensors_[i].shape.size() + 16;
  }
}

const ManifestTensor* CheckpointManifest::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

namespace {

// Little-endian, 8 bytes.
void AppendNumber(DigestBuilder& digest, uint64_t n) {
  char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<char>(n >> (8 * i));
  digest.Update(absl::string_view(le, 8));
}

void AppendSized(DigestBuilder& digest, absl::string_view bytes) {
  AppendNumber(digest, bytes.size());
  digest.Update(bytes);
}

}  // namespace

std::string ContentVersion(const std::vector<ManifestTensor>& tensors, const Metadata& metadata,
                           absl::string_view quantization) {
  DigestBuilder digest;
  digest.Update("weightstore content version 1");
  AppendNumber(digest, tensors.size());
  for (const ManifestTensor& t : tensors) {
    AppendSized(digest, t.name);
    AppendSized(digest, DTypeName(t.dtype));
    AppendNumber(digest, t.shape.size());
    for (uint64_t d : t.shape) AppendNumber(digest, d);
    AppendNumber(digest, t.digest.high);
    AppendNumber(digest, t.digest.low);
  }
  AppendNumber(digest, metadata.size());
  for (const auto& [key, value] : metadata) {
    AppendSized(digest, key);
    AppendSized(digest, value);
  }
  if (!quantization.empty()) AppendSized(digest, quantization);
  return digest.Finish().Hex();
}

namespace {

// Digests the entries of `checkpoint` that `known` (may be null) does not
// give, into `tensors` (one per entry).
absl::StatusOr<std::shared_ptr<const CheckpointManifest>> Digest(const Checkpoint& checkpoint, std::string version,
                                                                 const CheckpointManifest* known) {
  const std::vector<CheckpointEntry>& entries = checkpoint.entries();
  std::vector<ManifestTensor> tensors(entries.size());
  std::vector<size_t> todo;
  uint64_t total = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const TensorSpec& spec = entries[i].spec;
    const ManifestTensor* k = known != nullptr ? known->Find(spec.name) : nullptr;
    if (k != nullptr && k->dtype == spec.dtype && k->shape == spec.shape) {
      tensors[i] = *k;
    } else {
      todo.push_back(i);
      total += spec.byte_size();
    }
  }
  // Tensors are digested by a few threads taking the next one in turn: the cost
  // is reading the bytes (first-touch faults of the mapping), which spreads.
  // One thread per 64 MiB, at most 4 and at most the cores: small checkpoints
  // are not worth a thread.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const auto threads =
      static_cast<unsigned>(std::min<uint64_t>({uint64_t{4}, cores, 1 + total / (uint64_t{64} << 20)}));
  WEIGHTSTORE_RETURN_IF_ERROR(ParallelFor(todo.size(), threads, [&](size_t t) -> absl::Status {
    const CheckpointEntry& entry = entries[todo[t]];
    absl::StatusOr<SharedTensor> tensor = checkpoint.Read(entry);
    if (!tensor.ok()) {
      return absl::DataLossError(absl::StrCat("cannot digest tensor '", entry.spec.name, "' of '", checkpoint.path(),
                                              "': ", tensor.status().message()));
    }
    tensors[todo[t]] =
        ManifestTensor{entry.spec.name, entry.spec.dtype, entry.spec.shape, DigestBytes(tensor->bytes.span())};
    return absl::OkStatus();
  }));
  if (version.empty()) {
    std::string quantization;  // each quantized tensor's scheme, as the config gives it
    for (const CheckpointEntry& entry : entries) {
      if (const QuantScheme* scheme = checkpoint.QuantSchemeOf(entry)) {
        absl::StrAppend(&quantization, entry.spec.name, "=", DescribeQuantScheme(*scheme), "\n");
      }
    }
    version = ContentVersion(tensors, checkpoint.metadata(), quantization);
  }
  return std::make_shared<const CheckpointManifest>(std::move(version), std::move(tensors));
}

}  // namespace

absl::StatusOr<std::shared_ptr<const CheckpointManifest>> ComputeManifest(const Checkpoint& checkpoint,
                                                                          std::string version) {
  return Digest(checkpoint, std::move(version), nullptr);
}

absl::StatusOr<std::shared_ptr<const CheckpointManifest>> ComputeManifest(const Checkpoint& checkpoint,
                                                                          std::string version,
                                                                          const CheckpointManifest& known) {
  return Digest(checkpoint, std::move(version), &known);
}

ManifestDiff DiffManifests(const CheckpointManifest& base, const CheckpointManifest& current) {
  ManifestDiff diff;
  for (const ManifestTensor& t : current.tensors()) {
    const ManifestTensor* before = base.Find(t.name);
    if (before == nullptr) {
      diff.added.push_back(t.name);
    } else if (!before->SameContentAs(t)) {
      diff.changed.push_back(t.name);
    } else {
      ++diff.unchanged;
    }
  }
  for (const ManifestTensor& t : base.tensors()) {
    if (current.Find(t.name) == nullptr) diff.removed.push_back(t.name);
  }
  return diff;
}

std::string DigestsMetadataJson(const std::vector<std::pair<std::string, TensorDigest>>& tensors) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [name, digest] : tensors) j[name] = digest.Hex();
  return j.dump();
}

namespace {

// Reads exactly one flat object of strings, without building a DOM: bounded
// in memory and time by the text, however it nests.
class DigestsSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit DigestsSax(size_t max_entries) : max_entries_(max_entries) {}
  bool start_object(std::size_t) override { return ++depth_ == 1 || Fail("it nests objects"); }
  bool end_object() override { return --depth_, true; }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool string(string_t& v) override {
    if (depth_ != 1) return Fail("it is not an object");
    std::optional<TensorDigest> digest = TensorDigest::FromHex(v);
    if (!digest)
      return Fail(absl::StrCat("the digest of '", absl::CHexEscape(key_.substr(0, 256)), "' is not 32 hex digits"));
    if (out_.size() >= max_entries_) return Fail(absl::StrCat("it names more than ", max_entries_, " tensors"));
    if (!out_.emplace(std::move(key_), *digest).second) return Fail("it names a tensor twice");
    return true;
  }
  bool null() override { return Fail("a value is not a string"); }
  bool boolean(bool) override { return Fail("a value is not a string"); }
  bool number_integer(number_integer_t) override { return Fail("a value is not a string"); }
  bool number_unsigned(number_unsigned_t) override { return Fail("a value is not a string"); }
  bool number_float(number_float_t, const string_t&) override { return Fail("a value is not a string"); }
  bool binary(binary_t&) override { return Fail("a value is not a string"); }
  bool start_array(std::size_t) override { return Fail("it holds an array"); }
  bool end_array() override { return false; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return Fail("it is not JSON");
  }
  const std::string& error() const { return error_; }
  absl::flat_hash_map<std::string, TensorDigest>& result() { return out_; }

 private:
  bool Fail(std::string why) {
    if (error_.empty()) error_ = std::move(why);
    return false;
  }
  size_t max_entries_;
  int depth_ = 0;
  std::string key_, error_;
  absl::flat_hash_map<std::string, TensorDigest> out_;
};

}  // namespace

absl::StatusOr<absl::flat_hash_map<std::string, TensorDigest>> ParseDigestsMetadata(absl::string_view json,
                                                                                    size_t max_entries) {
  DigestsSax sax(max_entries);
  const bool ok = nlohmann::json::sax_parse(json.begin(), json.end(), &sax, nlohmann::json::input_format_t::json,
                                            /*strict=*/true);
  if (!ok || !sax.error().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("__metadata__ '", kDigestsMetadataKey, "' is not an object of ",
                     "tensor names to digests: ", sax.error().empty() ? "it is not JSON" : sax.error()));
  }
  return std::move(sax.result());
}

}  // namespace weightstore
