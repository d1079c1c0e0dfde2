// Metrics on prometheus-cpp. Values that change as calls happen live in a
// prometheus::Registry (ServerMetrics, server/observability.h); values owned by
// other parts of the daemon (checkpoints served, shared memory, the socket, the
// process) are read from their owners at scrape time through callbacks,
// registered here by whoever wires the daemon together (server/server.cc), so
// neither side includes the other.
#ifndef WEIGHTSTORE_SERVER_METRICS_H_
#define WEIGHTSTORE_SERVER_METRICS_H_

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace weightstore::server::metrics {

using Labels = std::map<std::string, std::string>;

struct Sample {
  Labels labels;
  double value = 0;
};

// Reads a family's samples; runs on the scraping thread, at every scrape.
using Reader = std::function<std::vector<Sample>()>;

// A Reader of one unlabelled value.
Reader One(std::function<double()> read);

// Families whose samples come from Readers. Thread-safe.
class ScrapedFamilies final : public prometheus::Collectable {
 public:
  // A gauge (any value) or a counter (a running total kept by its owner).
  void AddGauge(std::string name, std::string help, Reader read);
  void AddCounter(std::string name, std::string help, Reader read);

  // Every family, in the order added, with the samples read now.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  struct Entry {
    std::string name, help;
    prometheus::MetricType type;
    Reader read;
  };
  void Add(Entry entry);
  mutable absl::Mutex mu_;
  std::vector<Entry> families_ ABSL_GUARDED_BY(mu_);
};

// Buckets for request durations: 1 ms to 5 min (fetches of large checkpoints
// take minutes).
std::vector<double> DurationBuckets();

// The text exposition format 0.0.4 of `collectables`' families, as the
// endpoint serves it (for tests and tools).
std::string Serialize(const std::vector<const prometheus::Collectable*>& collectables);

}  // namespace weightstore::server::metrics

#endif  // WEIGHTSTORE_SERVER_METRICS_H_
