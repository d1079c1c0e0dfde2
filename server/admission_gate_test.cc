#include "server/admission_gate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tests/util/status_matchers.h"

namespace weightstore::server {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

TEST(AdmissionGateTest, BoundsCallsInAllAndPerClientAddress) {
  AdmissionGate gate({.total = 3, .per_peer = 2});
  ASSERT_OK_AND_ASSIGN(GateTicket a, gate.Admit("ipv4:10.0.0.1:5000"));
  ASSERT_OK_AND_ASSIGN(GateTicket b, gate.Admit("ipv4:10.0.0.1:5001"));
  EXPECT_THAT(gate.Admit("ipv4:10.0.0.1:5002"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("ipv4:10.0.0.1 has 2")));
  ASSERT_OK_AND_ASSIGN(GateTicket c, gate.Admit("ipv4:10.0.0.2:5000"));
  EXPECT_THAT(gate.Admit("ipv4:10.0.0.3:5000"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-concurrent-fetches")));
  a.Release();
  ASSERT_OK_AND_ASSIGN(GateTicket d, gate.Admit("ipv4:10.0.0.1:5003"));
  EXPECT_EQ(gate.active(), 3);
}

// However a call ends (Done, then OnDone; a ticket moved into a worker's job;
// a job dropped unrun), its slot is freed exactly once.
TEST(AdmissionGateTest, ATicketFreesItsSlotExactlyOnceHoweverTheCallEnds) {
  AdmissionGate gate({.total = 2, .per_peer = 2});
  {
    ASSERT_OK_AND_ASSIGN(GateTicket done_then_destroyed, gate.Admit("ipv4:10.0.0.1:1"));
    done_then_destroyed.Release();
    done_then_destroyed.Release();
    EXPECT_FALSE(done_then_destroyed);
    EXPECT_EQ(gate.active(), 0);
  }
  EXPECT_EQ(gate.active(), 0) << "not released a second time by the destructor";
  ASSERT_OK_AND_ASSIGN(GateTicket first, gate.Admit("ipv4:10.0.0.1:1"));
  GateTicket moved = std::move(first);
  EXPECT_FALSE(first);
  EXPECT_TRUE(moved);
  first.Release();  // the moved-from ticket holds nothing
  EXPECT_EQ(gate.active(), 1);
  {
    std::optional<GateTicket> job(std::move(moved));  // a job that is dropped
  }
  EXPECT_EQ(gate.active(), 0);
  // Both slots free again, and the per-address count with them.
  ASSERT_OK_AND_ASSIGN(GateTicket x, gate.Admit("ipv4:10.0.0.1:2"));
  ASSERT_OK_AND_ASSIGN(GateTicket y, gate.Admit("ipv4:10.0.0.1:3"));
  x = std::move(y);  // x's own slot is freed by the assignment
  EXPECT_EQ(gate.active(), 1);
}

TEST(AdmissionGateTest, AGateWithoutSlotsPerAddressKeepsNoRecordOfTheRefused) {
  AdmissionGate gate({.total = 4, .per_peer = 0});
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(gate.Admit(absl::StrCat("ipv4:10.0.0.", i, ":1")),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("has 0")));
  }
  EXPECT_EQ(gate.active(), 0);
}

TEST(AdmissionGateTest, PeerAddressDropsThePort) {
  EXPECT_EQ(PeerAddress("ipv4:127.0.0.1:54321"), "ipv4:127.0.0.1");
  EXPECT_EQ(PeerAddress("ipv6:[::1]:443"), "ipv6:[::]/64");
  EXPECT_EQ(PeerAddress("ipv6:[2001:db8:1:2:3:4:5:6]:443"), "ipv6:[2001:db8:1:2::]/64");
  EXPECT_EQ(PeerAddress("ipv6:[2001:db8:1:2:ffff::9]:80"), "ipv6:[2001:db8:1:2::]/64") << "one /64, one share";
  EXPECT_EQ(PeerAddress("ipv6:[::ffff:10.0.0.7]:80"), "ipv4:10.0.0.7");
  EXPECT_EQ(PeerAddress("unix:/run/ws.sock"), "unix:/run/ws.sock");
  EXPECT_EQ(PeerAddress("ipv4:"), "ipv4:");
}

}  // namespace
}  // namespace weightstore::server
