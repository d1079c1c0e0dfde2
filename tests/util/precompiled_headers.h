// The third-party headers that most test files include, compiled once per
// build and reused by every GoogleTest binary (weightstore_cc_test;
// WEIGHTSTORE_PRECOMPILED_HEADERS). About 6 s of a test file's 10 s compile
// was these headers. Only headers that rarely change belong here: a change
// rebuilds every test. Test files still include what they use.
#ifndef WEIGHTSTORE_TESTS_UTIL_PRECOMPILED_HEADERS_H_
#define WEIGHTSTORE_TESTS_UTIL_PRECOMPILED_HEADERS_H_

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "weightstore/v1/weight_store.grpc.pb.h"
#include "weightstore/v1/weight_store.pb.h"

#endif  // WEIGHTSTORE_TESTS_UTIL_PRECOMPILED_HEADERS_H_
