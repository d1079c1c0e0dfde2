// Fuzzes the whole Burn record reader: gzip, MessagePack, JSON and bincode
// (read with the layouts of the two bincode fixtures), then every tensor read;
// and each record parsed as a template for its own tensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/formats/burn_record.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using weightstore::RecordLayout;

// The layout of Burn's mnist-inference-web model: ConvBlocks (conv, batch
// norm) of `convs` {out, in} channels, then Linears of {in, out} features.
RecordLayout Mnist(std::initializer_list<std::pair<uint64_t, uint64_t>> convs,
                   std::initializer_list<std::pair<uint64_t, uint64_t>> linears, bool linear_bias) {
  RecordLayout layout;
  auto add = [&](std::string path, std::vector<uint64_t> shape) {
    layout.parameters.push_back({std::move(path), std::move(shape)});
  };
  int i = 0;
  for (auto [out, in] : convs) {
    const std::string block = "conv" + std::to_string(++i);
    add(block + ".conv.weight", {out, in, 3, 3});
    add(block + ".conv.bias", {out});
    for (const char* p : {".norm.gamma", ".norm.beta", ".norm.running_mean", ".norm.running_var"})
      add(block + p, {out});
  }
  i = 0;
  for (auto [in, out] : linears) {
    const std::string fc = "fc" + std::to_string(++i);
    add(fc + ".weight", {in, out});
    if (linear_bias) add(fc + ".bias", {out});
  }
  return layout;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightstore;
  static const RecordLayout kMnist021 = Mnist({{64, 1}, {64, 64}}, {{1600, 256}, {256, 128}, {128, 10}}, true);
  static const RecordLayout kMnist014 = Mnist({{8, 1}, {16, 8}, {24, 16}}, {{11616, 32}, {32, 10}}, false);
  OpenOptions options;
  options.max_tensors = 10000;
  options.max_record_inflated_bytes = 64 << 20;
  const SharedBytes bytes = SharedBytes::Copy(absl::string_view(reinterpret_cast<const char*>(data), size));
  // The layout is read only for bincode, which starts with a float type's
  // length (3 or 19) unless gzipped.
  absl::StatusOr<std::shared_ptr<const Checkpoint>> parsed = ParseBurnRecord(bytes, "fuzz", options, &kMnist021);
  if (parsed.ok()) {
    // The record as a template for its own tensors: a plan within the input.
    std::vector<TensorSpec> specs;
    for (const CheckpointEntry& e : (*parsed)->entries()) specs.push_back(e.spec);
    absl::StatusOr<WritePlan> plan = PlanFromRecordTemplate(bytes, "fuzz", specs);
    if (plan.ok() && plan->file_size != size) std::abort();
  }
  ReadEverything(std::move(parsed));
  if (size > 0 && (data[0] == 0x03 || data[0] == 0x13 || data[0] == 0x1f)) {
    ReadEverything(ParseBurnRecord(bytes, "fuzz", options, &kMnist014));
  }
  return 0;
}
