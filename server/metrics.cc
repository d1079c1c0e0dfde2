#include "server/metrics.h"

#include <prometheus/text_serializer.h>

namespace weightstore::server::metrics {

Reader One(std::function<double()> read) {
  return [read = std::move(read)] { return std::vector<Sample>{{{}, read()}}; };
}

void ScrapedFamilies::AddGauge(std::string name, std::string help, Reader read) {
  Add({std::move(name), std::move(help), prometheus::MetricType::Gauge, std::move(read)});
}

void ScrapedFamilies::AddCounter(std::string name, std::string help, Reader read) {
  Add({std::move(name), std::move(help), prometheus::MetricType::Counter, std::move(read)});
}

void ScrapedFamilies::Add(Entry entry) {
  absl::MutexLock lock(&mu_);
  families_.push_back(std::move(entry));
}

std::vector<prometheus::MetricFamily> ScrapedFamilies::Collect() const {
  absl::MutexLock lock(&mu_);
  std::vector<prometheus::MetricFamily> out;
  out.reserve(families_.size());
  for (const Entry& e : families_) {
    prometheus::MetricFamily family{e.name, e.help, e.type, {}};
    for (const Sample& s : e.read()) {
      prometheus::ClientMetric metric;
      for (const auto& [name, value] : s.labels) metric.label.push_back({name, value});
      if (e.type == prometheus::MetricType::Counter) {
        metric.counter.value = s.value;
      } else {
        metric.gauge.value = s.value;
      }
      family.metric.push_back(std::move(metric));
    }
    out.push_back(std::move(family));
  }
  return out;
}

std::vector<double> DurationBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
}

std::string Serialize(const std::vector<const prometheus::Collectable*>& collectables) {
  std::vector<prometheus::MetricFamily> families;
  for (const prometheus::Collectable* c : collectables) {
    std::vector<prometheus::MetricFamily> some = c->Collect();
    families.insert(families.end(), std::make_move_iterator(some.begin()), std::make_move_iterator(some.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace weightstore::server::metrics
