// GoogleTest helpers for absl::Status (our Abseil predates absl/status/status_matchers.h).
#ifndef WEIGHTSTORE_TESTS_UTIL_STATUS_MATCHERS_H_
#define WEIGHTSTORE_TESTS_UTIL_STATUS_MATCHERS_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace weightstore::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// StatusIs(code) and StatusIs(code, message_matcher) for Status and StatusOr.
MATCHER_P(StatusIs, code, "") {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code;
}
MATCHER_P2(StatusIs, code, message_matcher, "") {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(status.message()), result_listener);
}

// IsOkAndHolds(value_matcher) for StatusOr.
MATCHER_P(IsOkAndHolds, value_matcher, "") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace weightstore::testing

#define EXPECT_OK(expr) \
  EXPECT_TRUE((::weightstore::testing::GetStatus(expr)).ok()) << ::weightstore::testing::GetStatus(expr)
#define ASSERT_OK(expr) \
  ASSERT_TRUE((::weightstore::testing::GetStatus(expr)).ok()) << ::weightstore::testing::GetStatus(expr)

// Declares `lhs` from a StatusOr, failing the test on error.
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(WEIGHTSTORE_TEST_CONCAT_(status_or_, __LINE__), lhs, rexpr)
#define WEIGHTSTORE_TEST_CONCAT_INNER_(a, b) a##b
#define WEIGHTSTORE_TEST_CONCAT_(a, b) WEIGHTSTORE_TEST_CONCAT_INNER_(a, b)
#define ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                               \
  ASSERT_TRUE(tmp.ok()) << tmp.status();            \
  lhs = std::move(tmp).value()

#endif  // WEIGHTSTORE_TESTS_UTIL_STATUS_MATCHERS_H_
