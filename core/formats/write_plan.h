// WritePlan: the byte layout of a checkpoint file, decided before any tensor
// bytes are produced, so a writer streams each tensor once, in order.
#ifndef WEIGHTSTORE_CORE_FORMATS_WRITE_PLAN_H_
#define WEIGHTSTORE_CORE_FORMATS_WRITE_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

namespace weightstore {

struct WritePlan {
  // Everything before the first tensor: header, metadata and padding.
  std::string header;
  // order[i] is the index (into the writer's input) of the i-th tensor on disk.
  std::vector<size_t> order;
  // offsets[i] is the absolute file offset of the i-th tensor on disk. Gaps
  // between tensors are zero bytes, after any `after` bytes.
  std::vector<uint64_t> offsets;
  // after[i] is written right after the i-th tensor on disk, before the zero
  // gap up to the next one: what a format interleaves with its tensors (a
  // MessagePack record's keys, shapes and bin heads). Empty: nothing, every gap
  // is zeros; else one string per tensor. REQUIRES: offsets[i] + the tensor's
  // bytes + after[i].size() <= offsets[i + 1] (or file_size for the last).
  std::vector<std::string> after;
  uint64_t file_size = 0;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_WRITE_PLAN_H_
