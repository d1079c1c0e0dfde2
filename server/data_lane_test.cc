#include "server/data_lane.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "proto/codec/data_lane.h"
#include "tests/util/loopback.h"
#include "tests/util/status_matchers.h"

namespace weightstore::server {
namespace {

using ::weightstore::testing::StatusIs;

// What one ticket's `attach` was called with.
struct Attached {
  absl::Notification called;
  absl::StatusOr<UniqueFd> fd = absl::UnknownError("not called");
  std::function<void(absl::StatusOr<UniqueFd>)> callback() {
    return [this](absl::StatusOr<UniqueFd> got) {
      fd = std::move(got);
      called.Notify();
    };
  }
};

void Send(int fd, const std::string& bytes) { ASSERT_EQ(write(fd, bytes.data(), bytes.size()), bytes.size()); }

std::string Hello(const std::string& ticket) {
  return std::string(wire::kLaneHello.data(), wire::kLaneHello.size()) + ticket;
}

// True once the daemon closed `fd`: a read sees the end, or a reset where
// bytes were left unread.
bool ClosedByTheLane(int fd) {
  char byte;
  return read(fd, &byte, 1) <= 0;
}

std::unique_ptr<DataLane> StartLane(DataLaneOptions options = {}) {
  options.listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<DataLane>> lane = DataLane::Start(options);
  EXPECT_OK(lane.status());
  return lane.ok() ? *std::move(lane) : nullptr;
}

// (Each test's Attached outlive its lane, which calls back what is still
// offered as it stops.)
TEST(DataLaneTest, ATicketAttachesOneConnectionFromItsAddressOnce) {
  Attached attached;
  auto lane = StartLane();
  ASSERT_NE(lane, nullptr);
  EXPECT_NE(lane->port(), 0);
  ASSERT_OK_AND_ASSIGN(std::string ticket, lane->Offer("127.0.0.1", attached.callback()));
  EXPECT_EQ(ticket.size(), wire::kLaneTicketBytes);
  UniqueFd client = testing::ConnectLoopback(lane->port());
  Send(client.get(), Hello(ticket));
  attached.called.WaitForNotification();
  ASSERT_OK(attached.fd.status());
  // The daemon's end of this very connection.
  Send(attached.fd->get(), "ok");
  char got[2];
  ASSERT_EQ(read(client.get(), got, 2), 2);
  EXPECT_EQ(std::string(got, 2), "ok");
  // Spent: the same ticket again is refused.
  UniqueFd again = testing::ConnectLoopback(lane->port());
  Send(again.get(), Hello(ticket));
  EXPECT_TRUE(ClosedByTheLane(again.get()));
  EXPECT_EQ(lane->counts().attached, 1u);
  EXPECT_EQ(lane->counts().refused, 1u);
}

TEST(DataLaneTest, AWrongHelloAnUnknownTicketOrAnotherAddressIsRefusedAndTheTicketKept) {
  Attached elsewhere, here;
  auto lane = StartLane();
  ASSERT_NE(lane, nullptr);
  ASSERT_OK_AND_ASSIGN(std::string far_ticket, lane->Offer("10.9.8.7", elsewhere.callback()));
  ASSERT_OK_AND_ASSIGN(std::string ticket, lane->Offer("127.0.0.1", here.callback()));
  std::string wrong_hello = Hello(ticket);
  wrong_hello[0] = 'X';
  std::string unknown = ticket;
  unknown[3] ^= 1;
  for (const std::string& sent : {wrong_hello, Hello(unknown), Hello(far_ticket), std::string(64, 'A')}) {
    UniqueFd client = testing::ConnectLoopback(lane->port());
    Send(client.get(), sent);
    EXPECT_TRUE(ClosedByTheLane(client.get()));
  }
  EXPECT_EQ(lane->counts().refused, 4u);
  EXPECT_FALSE(here.called.HasBeenNotified());
  UniqueFd client = testing::ConnectLoopback(lane->port());
  Send(client.get(), Hello(ticket));  // still good
  here.called.WaitForNotification();
  EXPECT_OK(here.fd.status());
  EXPECT_FALSE(elsewhere.called.HasBeenNotified());
}

TEST(DataLaneTest, AHandshakeIsBoundedInTimeAndInNumber) {
  // (3 s: the third connection must come while the first two still wait.)
  auto lane = StartLane({.max_handshakes = 2, .handshake_time = std::chrono::seconds(3)});
  ASSERT_NE(lane, nullptr);
  UniqueFd slow = testing::ConnectLoopback(lane->port());
  Send(slow.get(), "WSLA");  // part of a hello, then nothing
  UniqueFd quiet = testing::ConnectLoopback(lane->port());
  UniqueFd third = testing::ConnectLoopback(lane->port());  // accepted after both: no slot left
  EXPECT_TRUE(ClosedByTheLane(third.get()));
  EXPECT_EQ(lane->counts().overflowed, 1u);
  // The two that never finish are closed once their time is up.
  EXPECT_TRUE(ClosedByTheLane(slow.get()));
  EXPECT_TRUE(ClosedByTheLane(quiet.get()));
  EXPECT_EQ(lane->counts().timed_out, 2u);

  // One address may fill half the slots; past that, its share is bounded.
  auto per_address =
      StartLane({.max_handshakes = 4, .max_handshakes_per_address = 1, .handshake_time = std::chrono::seconds(3)});
  ASSERT_NE(per_address, nullptr);
  UniqueFd first = testing::ConnectLoopback(per_address->port());
  UniqueFd second = testing::ConnectLoopback(per_address->port());
  UniqueFd over = testing::ConnectLoopback(per_address->port());
  EXPECT_TRUE(ClosedByTheLane(over.get()));
  EXPECT_EQ(per_address->counts().overflowed, 1u);
  EXPECT_TRUE(ClosedByTheLane(first.get()));  // its time is up
  EXPECT_EQ(per_address->counts().timed_out, 2u);
}

TEST(DataLaneTest, ATicketNotClaimedInTimeOrWithdrawnIsCalledBackOnce) {
  Attached expired, withdrawn;
  auto lane = StartLane({.ticket_life = std::chrono::milliseconds(200)});
  ASSERT_NE(lane, nullptr);
  ASSERT_OK(lane->Offer("127.0.0.1", expired.callback()).status());
  expired.called.WaitForNotification();
  EXPECT_THAT(expired.fd.status(), StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::HasSubstr("within")));
  EXPECT_EQ(lane->counts().unclaimed, 1u);

  auto long_lived = StartLane();
  ASSERT_OK_AND_ASSIGN(std::string ticket, long_lived->Offer("127.0.0.1", withdrawn.callback()));
  long_lived->Withdraw(ticket);
  withdrawn.called.WaitForNotification();
  EXPECT_THAT(withdrawn.fd.status(), StatusIs(absl::StatusCode::kCancelled));
  long_lived->Withdraw(ticket);  // again: nothing
  UniqueFd client = testing::ConnectLoopback(long_lived->port());
  Send(client.get(), Hello(ticket));
  EXPECT_TRUE(ClosedByTheLane(client.get()));
}

TEST(DataLaneTest, StoppingCallsEveryTicketBackAndRefusesNewOnes) {
  Attached pending;
  auto lane = StartLane();
  ASSERT_NE(lane, nullptr);
  ASSERT_OK(lane->Offer("127.0.0.1", pending.callback()).status());
  lane->Stop();
  ASSERT_TRUE(pending.called.HasBeenNotified());
  EXPECT_THAT(pending.fd.status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(lane->Offer("127.0.0.1", [](absl::StatusOr<UniqueFd>) { ADD_FAILURE() << "called"; }).status(),
              StatusIs(absl::StatusCode::kUnavailable));
  lane->Stop();  // again: nothing
}

TEST(DataLaneTest, AnAddressThatIsNotHostAndPortOrCannotBeBoundIsRefused) {
  EXPECT_THAT(DataLane::Start({.listen = "127.0.0.1"}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DataLane::Start({.listen = "127.0.0.1:99999"}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  auto lane = StartLane();
  ASSERT_NE(lane, nullptr);
  EXPECT_THAT(DataLane::Start({.listen = "127.0.0.1:" + std::to_string(lane->port())}).status(),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("data lane")));
}

}  // namespace
}  // namespace weightstore::server
