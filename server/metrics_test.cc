#include "server/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

namespace weightstore::server::metrics {
namespace {

using ::testing::HasSubstr;

TEST(MetricsTest, SerializesFamiliesInTheTextFormat) {
  Registry registry;
  auto& requests = registry.AddCounter("x_requests_total", "Requests,\nby code.", {"code"});
  requests.Add({"OK"}).Increment(3);
  requests.Add({"say \"hi\"\\"}).Increment();
  registry.AddGauge("x_temperature", "A gauge.").Add({}).Set(-1.5);
  auto& latency = registry.AddHistogram("x_seconds", "Latency.", {0.1, 1});
  for (double v : {0.05, 0.1, 0.5, 7.0}) latency.Add({}).Observe(v);
  EXPECT_EQ(registry.Serialize(),
            "# HELP x_requests_total Requests,\\nby code.\n"
            "# TYPE x_requests_total counter\n"
            "x_requests_total{code=\"OK\"} 3\n"
            "x_requests_total{code=\"say \\\"hi\\\"\\\\\"} 1\n"
            "# HELP x_temperature A gauge.\n"
            "# TYPE x_temperature gauge\n"
            "x_temperature -1.5\n"
            "# HELP x_seconds Latency.\n"
            "# TYPE x_seconds histogram\n"
            "x_seconds_bucket{le=\"0.1\"} 2\n"
            "x_seconds_bucket{le=\"1\"} 3\n"
            "x_seconds_bucket{le=\"+Inf\"} 4\n"
            "x_seconds_sum 7.65\n"
            "x_seconds_count 4\n");
}

TEST(MetricsTest, CollectHooksRunBeforeEachScrape) {
  Registry registry;
  auto& gauge = registry.AddGauge("x_calls", "Scrapes so far.");
  int calls = 0;
  registry.AddCollectHook([&] { gauge.Add({}).Set(++calls); });
  EXPECT_THAT(registry.Serialize(), HasSubstr("x_calls 1\n"));
  EXPECT_THAT(registry.Serialize(), HasSubstr("x_calls 2\n"));
}

TEST(MetricsTest, ConcurrentIncrementsAreNotLost) {
  Registry registry;
  Counter& c = registry.AddCounter("x_total", "n").Add({});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) c.Increment();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.Value(), 40000);
}

TEST(MetricsTest, FormatsSpecialValuesAsPrometheusDoes) {
  EXPECT_EQ(FormatValue(1.0 / 0.0), "+Inf");
  EXPECT_EQ(FormatValue(-1.0 / 0.0), "-Inf");
  EXPECT_EQ(FormatValue(0.0 / 0.0), "NaN");
  EXPECT_EQ(FormatValue(0.0025), "0.0025");
  EXPECT_EQ(FormatValue(4294967296), "4294967296");
}

}  // namespace
}  // namespace weightstore::server::metrics
