// Small checkpoints built in memory for tests.
#ifndef WEIGHTSTORE_TESTS_UTIL_CHECKPOINTS_H_
#define WEIGHTSTORE_TESTS_UTIL_CHECKPOINTS_H_

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

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_CHECKPOINTS_H_
