// A small, typed Prometheus registry, shaped like prometheus-cpp's API
// (prometheus-cpp is not packaged for Debian 12): families of counters, gauges
// and histograms with labels, serialized in the text exposition format 0.0.4.
//
//   Registry registry;
//   auto& requests = registry.AddCounter("weightstore_x_total", "What it counts.", {"transport"});
//   requests.Add({"grpc"}).Increment();
//
// Children are created on first use and never removed; references to them stay
// valid for the registry's lifetime. Updates are lock-free; Serialize() takes a
// snapshot under the family locks. Thread-safe.
#ifndef WEIGHTSTORE_SERVER_METRICS_H_
#define WEIGHTSTORE_SERVER_METRICS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace weightstore::server::metrics {

// A double updated atomically (compare-and-swap on its bits).
class AtomicDouble {
 public:
  void Add(double v);
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  double Get() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Counter {
 public:
  // REQUIRES: v >= 0.
  void Increment(double v = 1) { value_.Add(v); }
  double Value() const { return value_.Get(); }
  // For totals counted elsewhere (read at scrape time): sets the running total.
  void SyncTotal(double total) { value_.Set(total); }

 private:
  AtomicDouble value_;
};

class Gauge {
 public:
  void Set(double v) { value_.Set(v); }
  void Increment(double v = 1) { value_.Add(v); }
  void Decrement(double v = 1) { value_.Add(-v); }
  double Value() const { return value_.Get(); }

 private:
  AtomicDouble value_;
};

class Histogram {
 public:
  // `bounds`: upper bounds, strictly increasing; +Inf is implicit.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // Per-bucket counts (not cumulative), the +Inf bucket last; sum; count.
  std::vector<uint64_t> BucketCounts() const;
  double Sum() const { return sum_.Get(); }
  uint64_t Count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1
  AtomicDouble sum_;
  std::atomic<uint64_t> count_{0};
};

using LabelValues = std::vector<std::string>;

template <typename T>
class Family {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::function<std::unique_ptr<T>()> make)
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)), make_(std::move(make)) {}

  // The child with these label values (one per label name), created on first use.
  T& Add(const LabelValues& values) {
    absl::MutexLock lock(&mu_);
    auto& child = children_[values];
    if (child == nullptr) child = make_();
    return *child;
  }

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // Calls `fn(labels, child)` for every child, in label order.
  template <typename Fn>
  void ForEach(Fn fn) const {
    absl::MutexLock lock(&mu_);
    for (const auto& [values, child] : children_) fn(values, *child);
  }

 private:
  const std::string name_, help_;
  const std::vector<std::string> label_names_;
  const std::function<std::unique_ptr<T>()> make_;
  mutable absl::Mutex mu_;
  std::map<LabelValues, std::unique_ptr<T>> children_ ABSL_GUARDED_BY(mu_);
};

// Buckets for request durations: 1 ms to 5 min (fetches of large checkpoints
// take minutes).
std::vector<double> DurationBuckets();

class Registry {
 public:
  Family<Counter>& AddCounter(const std::string& name, const std::string& help, std::vector<std::string> labels = {});
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help, std::vector<std::string> labels = {});
  Family<Histogram>& AddHistogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                  std::vector<std::string> labels = {});
  // Runs before every Serialize(): for values read at scrape time (memory in
  // use, open descriptors).
  void AddCollectHook(std::function<void()> hook);

  // The text exposition format 0.0.4, families in registration order.
  std::string Serialize() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Family<Counter>>> counters_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Family<Gauge>>> gauges_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Family<Histogram>>> histograms_ ABSL_GUARDED_BY(mu_);
  struct Entry {
    char kind;  // 'c', 'g', 'h'
    size_t index;
  };
  std::vector<Entry> order_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> hooks_ ABSL_GUARDED_BY(mu_);
};

// Formats a sample value as Prometheus does: integers without a fraction,
// "+Inf", "-Inf", "NaN".
std::string FormatValue(double v);

}  // namespace weightstore::server::metrics

#endif  // WEIGHTSTORE_SERVER_METRICS_H_
