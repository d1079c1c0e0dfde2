// Small checkpoints built in memory for tests.
#ifndef WEIGHTSTORE_TESTS_UTIL_CHECKPOINTS_H_
#define WEIGHTSTORE_TESTS_UTIL_CHECKPOINTS_H_

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/checkpoint.h"
#include "core/formats/pytorch.h"

namespace weightstore::testing {

// A checkpoint of one-element F32 tensors with these names (all sharing one
// zeroed storage): for tests of names, selections and load results.
std::shared_ptr<const Checkpoint> NamesOnlyCheckpoint(const std::vector<std::string>& names,
                                                      const FormatSpec& format = kPyTorchFormat);

// A SafeTensors file of `count` F32 tensors "t.0", "t.1", ... of `floats`
// elements each, every element derived from `seed` (another seed, other bytes
// of the same size).
std::string SafeTensorsFile(int count, size_t floats, float seed);

// A SafeTensors file of one F32 tensor "w" holding `values`.
std::string OneTensorFile(const std::vector<float>& values);

// The tensors of the SafeTensors file `bytes`, name to bytes (empty if it
// does not parse).
std::map<std::string, std::string> TensorsOf(const std::string& bytes);

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_CHECKPOINTS_H_
