#include "core/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace weightstore {

absl::Status ParallelFor(size_t n, unsigned threads, const std::function<absl::Status(size_t)>& work) {
  std::atomic<size_t> next{0};
  absl::Mutex mu;
  absl::Status failure;
  auto loop = [&] {
    for (size_t i = next++; i < n; i = next++) {
      // An exception (bad_alloc) must not leave a helper's thread: it
      // becomes the item's error.
      absl::Status status;
      try {
        status = work(i);
      } catch (const std::bad_alloc&) {
        status = absl::ResourceExhaustedError("out of memory");
      } catch (const std::exception& e) {
        status = absl::InternalError(e.what());
      } catch (...) {
        status = absl::InternalError("an exception that is no std::exception");
      }
      if (status.ok()) continue;
      absl::MutexLock lock(&mu);
      if (failure.ok()) failure = std::move(status);
      next = n;
    }
  };
  std::vector<std::thread> helpers;
  try {
    helpers.reserve(std::min<size_t>(threads, n));
  } catch (const std::exception&) {  // no helpers: the caller's thread does it all
  }
  for (size_t t = 1; t < std::min<size_t>(threads, n) && helpers.size() < helpers.capacity(); ++t) {
    try {
      helpers.emplace_back(loop);
    } catch (const std::exception&) {
      break;  // no thread to spare (system_error, bad_alloc): the caller's does the rest
    }
  }
  loop();
  for (std::thread& t : helpers) t.join();
  return failure;
}

}  // namespace weightstore
