#include "server/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "server/observability.h"

namespace weightstore::server {
namespace {

using ::testing::HasSubstr;

TEST(ScrapedFamiliesTest, ReadsEveryValueAtEachScrapeInTheTextFormat) {
  metrics::ScrapedFamilies families;
  int scrapes = 0;
  families.AddGauge("x_scrapes", "Scrapes so far.", metrics::One([&] { return ++scrapes; }));
  families.AddCounter("x_bytes_total", "Bytes, by transport.", [] {
    return std::vector<metrics::Sample>{{{{"transport", "grpc"}}, 3}, {{{"transport", "say \"hi\""}}, 1}};
  });
  const std::string first = metrics::Serialize({&families});
  EXPECT_THAT(first, HasSubstr("# HELP x_scrapes Scrapes so far.\n# TYPE x_scrapes gauge\nx_scrapes 1\n"));
  EXPECT_THAT(first, HasSubstr("# TYPE x_bytes_total counter\n"));
  EXPECT_THAT(first, HasSubstr("x_bytes_total{transport=\"grpc\"} 3\n"));
  EXPECT_THAT(first, HasSubstr("x_bytes_total{transport=\"say \\\"hi\\\"\"} 1\n"));
  EXPECT_THAT(metrics::Serialize({&families}), HasSubstr("x_scrapes 2\n"));
}

TEST(ScrapedFamiliesTest, FollowTheRegistrysFamiliesInOneExposition) {
  prometheus::Registry registry;
  prometheus::BuildCounter().Name("x_calls_total").Help("Calls.").Register(registry).Add({{"code", "OK"}}).Increment(2);
  metrics::ScrapedFamilies families;
  families.AddGauge("x_open", "Open things.", metrics::One([] { return 7; }));
  const std::string text = metrics::Serialize({&registry, &families});
  EXPECT_THAT(text, HasSubstr("x_calls_total{code=\"OK\"} 2\n"));
  EXPECT_LT(text.find("x_calls_total"), text.find("x_open"));
}

TEST(ServerMetricsTest, CountsCallsAndTheBytesTheyServed) {
  ServerMetrics m;
  const metrics::Labels labels = {
      {"grpc_type", "server_stream"}, {"grpc_service", "weightstore.v1.WeightStore"}, {"grpc_method", "FetchTensors"}};
  m.OnCallStarted(labels, /*weightstore_call=*/true);
  EXPECT_EQ(m.weightstore_calls_in_flight(), 1);
  m.OnCallDone(labels, "OK", 0.02, 4096);
  EXPECT_EQ(m.weightstore_calls_in_flight(), 1);  // until torn down
  const auto before = std::chrono::steady_clock::now();
  EXPECT_LT(m.last_weightstore_success(), before);
  m.OnCallTornDown(/*weightstore_call=*/true, /*ok=*/true);
  EXPECT_EQ(m.weightstore_calls_in_flight(), 0);
  EXPECT_GE(m.last_weightstore_success(), before);
  // Neither a failed WeightStore call nor another service's call counts as a success.
  const auto last = m.last_weightstore_success();
  m.OnCallStarted(labels, /*weightstore_call=*/true);
  m.OnCallTornDown(/*weightstore_call=*/true, /*ok=*/false);
  m.OnCallStarted(labels, /*weightstore_call=*/false);
  m.OnCallTornDown(/*weightstore_call=*/false, /*ok=*/true);
  EXPECT_EQ(m.last_weightstore_success(), last);
  EXPECT_EQ(m.weightstore_calls_in_flight(), 0);
  EXPECT_EQ(m.grpc_served_bytes(), 4096u);
  m.ObserveLoad(0.5, /*ok=*/false);
  const std::string text = m.Serialize();
  EXPECT_THAT(text, HasSubstr("grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"FetchTensors\","
                              "grpc_service=\"weightstore.v1.WeightStore\",grpc_type=\"server_stream\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("grpc_server_handling_seconds_count{grpc_method=\"FetchTensors\""));
  EXPECT_THAT(text, HasSubstr("weightstore_checkpoint_load_failures_total 1\n"));
  EXPECT_THAT(text, HasSubstr("weightstore_checkpoint_load_seconds_count 1\n"));
  EXPECT_THAT(text, HasSubstr("process_open_fds "));
}

TEST(ServerMetricsTest, EveryMethodsCallSeriesExistFromTheStartAtZero) {
  ServerMetrics m;
  m.InitializeServices({"weightstore.v1.WeightStore", "no.such.Service"});
  const std::string text = m.Serialize();
  EXPECT_THAT(text, HasSubstr("grpc_server_started_total{grpc_method=\"Rescan\","
                              "grpc_service=\"weightstore.v1.WeightStore\",grpc_type=\"unary\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("grpc_server_handled_total{grpc_code=\"Unavailable\",grpc_method=\"FetchTensors\","
                              "grpc_service=\"weightstore.v1.WeightStore\",grpc_type=\"server_stream\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("grpc_server_handling_seconds_count{grpc_method=\"PutCheckpoint\","
                              "grpc_service=\"weightstore.v1.WeightStore\",grpc_type=\"client_stream\"} 0\n"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("no.such.Service")));
  // A call counts on the series made for it.
  const metrics::Labels labels = {
      {"grpc_type", "unary"}, {"grpc_service", "weightstore.v1.WeightStore"}, {"grpc_method", "Rescan"}};
  m.OnCallStarted(labels, true);
  m.OnCallDone(labels, "OK", 0.001, 0);
  EXPECT_THAT(m.Serialize(), HasSubstr("grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Rescan\","
                                       "grpc_service=\"weightstore.v1.WeightStore\",grpc_type=\"unary\"} 1\n"));
}

}  // namespace
}  // namespace weightstore::server
