// The benchmarks' checkpoint: `count` F32 tensors "w.0", "w.1", ... of
// `tensor_bytes` each (every byte `fill`), written as SafeTensors to `path`,
// each of shape [tensor_bytes / 4], or [rows, tensor_bytes / 4 / rows] when
// `rows` > 1. Each tensor's bytes are one shared block, so writing costs no
// memory.
#ifndef WEIGHTSTORE_TESTS_BENCH_BENCH_CHECKPOINT_H_
#define WEIGHTSTORE_TESTS_BENCH_BENCH_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/status_macros.h"

namespace weightstore {

inline absl::Status WriteBenchCheckpoint(const std::string& path, uint64_t count, uint64_t tensor_bytes,
                                         std::byte fill = std::byte{7}, uint64_t rows = 1) {
  SharedBytes block = SharedBytes::FromVector(std::vector<std::byte>(tensor_bytes, fill));
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(path, kSafeTensorsFormat));
  for (uint64_t i = 0; i < count; ++i) {
    std::vector<uint64_t> shape = {tensor_bytes / 4};
    if (rows > 1) shape = {rows, tensor_bytes / 4 / rows};
    WEIGHTSTORE_RETURN_IF_ERROR(writer->Add({absl::StrCat("w.", i), DType::kF32, shape},
                                            [block] { return absl::StatusOr<SharedBytes>(block); }));
  }
  return writer->Finish();
}

}  // namespace weightstore

#endif  // WEIGHTSTORE_TESTS_BENCH_BENCH_CHECKPOINT_H_
