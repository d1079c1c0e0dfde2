#include "server/metrics.h"

#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace weightstore::server::metrics {
namespace {

// Label values escape backslash, double quote and newline; HELP text escapes
// backslash and newline.
std::string Escape(const std::string& s, bool quotes) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '"' && quotes) out += "\\\"";
    else out += c;
  }
  return out;
}

std::string Labels(const std::vector<std::string>& names, const LabelValues& values, const std::string& extra = "") {
  std::string out;
  for (size_t i = 0; i < names.size() && i < values.size(); ++i) {
    absl::StrAppend(&out, out.empty() ? "" : ",", names[i], "=\"", Escape(values[i], true), "\"");
  }
  if (!extra.empty()) absl::StrAppend(&out, out.empty() ? "" : ",", extra);
  return out.empty() ? "" : absl::StrCat("{", out, "}");
}

template <typename T>
void Header(std::string* out, const Family<T>& f, const char* type) {
  absl::StrAppend(out, "# HELP ", f.name(), " ", Escape(f.help(), false), "\n# TYPE ", f.name(), " ", type, "\n");
}

}  // namespace

void AtomicDouble::Add(double v) {
  double current = value_.load(std::memory_order_relaxed);
  while (!value_.compare_exchange_weak(current, current + v, std::memory_order_relaxed)) {
  }
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.Add(v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::BucketCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  for (size_t i = 0; i < out.size(); ++i) out[i] = buckets_[i].load(std::memory_order_relaxed);
  return out;
}

std::vector<double> DurationBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  char buffer[32];  // shortest text that reads back as the same double
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), v);
  return std::string(buffer, end);
}

Family<Counter>& Registry::AddCounter(const std::string& name, const std::string& help,
                                      std::vector<std::string> labels) {
  absl::MutexLock lock(&mu_);
  counters_.push_back(std::make_unique<Family<Counter>>(name, help, std::move(labels), [] { return std::make_unique<Counter>(); }));
  order_.push_back({'c', counters_.size() - 1});
  return *counters_.back();
}

Family<Gauge>& Registry::AddGauge(const std::string& name, const std::string& help, std::vector<std::string> labels) {
  absl::MutexLock lock(&mu_);
  gauges_.push_back(std::make_unique<Family<Gauge>>(name, help, std::move(labels), [] { return std::make_unique<Gauge>(); }));
  order_.push_back({'g', gauges_.size() - 1});
  return *gauges_.back();
}

Family<Histogram>& Registry::AddHistogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                          std::vector<std::string> labels) {
  absl::MutexLock lock(&mu_);
  histograms_.push_back(std::make_unique<Family<Histogram>>(name, help, std::move(labels),
                                                            [bounds] { return std::make_unique<Histogram>(bounds); }));
  order_.push_back({'h', histograms_.size() - 1});
  return *histograms_.back();
}

void Registry::AddCollectHook(std::function<void()> hook) {
  absl::MutexLock lock(&mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::Serialize() const {
  std::vector<std::function<void()>> hooks;
  {
    absl::MutexLock lock(&mu_);
    hooks = hooks_;
  }
  for (const auto& hook : hooks) hook();
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const Entry& e : order_) {
    if (e.kind == 'c') {
      const auto& f = *counters_[e.index];
      Header(&out, f, "counter");
      f.ForEach([&](const LabelValues& v, const Counter& c) {
        absl::StrAppend(&out, f.name(), Labels(f.label_names(), v), " ", FormatValue(c.Value()), "\n");
      });
    } else if (e.kind == 'g') {
      const auto& f = *gauges_[e.index];
      Header(&out, f, "gauge");
      f.ForEach([&](const LabelValues& v, const Gauge& g) {
        absl::StrAppend(&out, f.name(), Labels(f.label_names(), v), " ", FormatValue(g.Value()), "\n");
      });
    } else {
      const auto& f = *histograms_[e.index];
      Header(&out, f, "histogram");
      f.ForEach([&](const LabelValues& v, const Histogram& h) {
        std::vector<uint64_t> counts = h.BucketCounts();
        uint64_t cumulative = 0;
        for (size_t i = 0; i < counts.size(); ++i) {
          cumulative += counts[i];
          std::string le = i < h.bounds().size() ? FormatValue(h.bounds()[i]) : "+Inf";
          absl::StrAppend(&out, f.name(), "_bucket", Labels(f.label_names(), v, absl::StrCat("le=\"", le, "\"")), " ",
                          cumulative, "\n");
        }
        absl::StrAppend(&out, f.name(), "_sum", Labels(f.label_names(), v), " ", FormatValue(h.Sum()), "\n");
        absl::StrAppend(&out, f.name(), "_count", Labels(f.label_names(), v), " ", cumulative, "\n");
      });
    }
  }
  return out;
}

}  // namespace weightstore::server::metrics
