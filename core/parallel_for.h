// ParallelFor: a few threads taking the next item in turn, for work whose
// items differ in size (tensors) and whose cost is touching memory.
#ifndef WEIGHTSTORE_CORE_PARALLEL_FOR_H_
#define WEIGHTSTORE_CORE_PARALLEL_FOR_H_

#include <cstddef>
#include <functional>

#include "absl/status/status.h"

namespace weightstore {

// Runs work(i) for every i in [0, n) on up to `threads` threads, the caller's
// among them (fewer when the system has none to spare). After the first error
// no new item starts; that error is returned once the others end. An
// exception work(i) throws is its error (bad_alloc: ResourceExhausted).
absl::Status ParallelFor(size_t n, unsigned threads, const std::function<absl::Status(size_t)>& work);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_PARALLEL_FOR_H_
