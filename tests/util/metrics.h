// Reads a daemon's Prometheus page (weightstored --metrics-listen) in tests.
#ifndef WEIGHTSTORE_TESTS_UTIL_METRICS_H_
#define WEIGHTSTORE_TESTS_UTIL_METRICS_H_

#include <initializer_list>

#include "absl/strings/string_view.h"

namespace weightstore::testing {

// Fetches http://127.0.0.1:<port>/metrics and returns the sum of the samples
// of metric `name` whose labels include every one of `labels`, each written
// as the daemon writes it (`grpc_method="Rescan"`); with no `labels`, the sum
// of all its samples. -1 when no sample matches, or the page cannot be read.
double MetricValue(int port, absl::string_view name, std::initializer_list<absl::string_view> labels = {});

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_METRICS_H_
