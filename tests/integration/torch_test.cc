// LibTorch: a C++ process loads a model's weights from a running weightstored
// into torch::Tensors and a torch::nn::Module with one call, byte-exact,
// through the same-host socket and over gRPC (and from local files).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "client/torch_tensors.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/daemon.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

torch::nn::Sequential MakeModel() {
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::BatchNorm1d(5), torch::nn::ReLU(),
                               torch::nn::Linear(5, 3));
}

// Every parameter and buffer of `model` by path, as a SafeTensors checkpoint.
std::string Serialize(torch::nn::Sequential& model) {
  std::vector<SharedTensor> tensors;
  auto add = [&](const std::string& path, const torch::Tensor& t) {
    torch::Tensor c = t.contiguous();
    std::vector<std::byte> bytes(c.nbytes());
    std::memcpy(bytes.data(), c.data_ptr(), bytes.size());
    DType dtype = c.scalar_type() == torch::kInt64 ? DType::kI64 : DType::kF32;
    std::vector<uint64_t> shape(c.sizes().begin(), c.sizes().end());
    tensors.push_back({{path, dtype, shape}, SharedBytes::FromVector(std::move(bytes))});
  };
  for (auto& p : model->named_parameters()) add(p.key(), p.value());
  for (auto& b : model->named_buffers()) add(b.key(), b.value());
  return *SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
}

class TorchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    source_ = MakeModel();
    torch::NoGradGuard no_grad;
    source_[1]->as<torch::nn::BatchNorm1d>()->running_mean.uniform_();
    models_ = testing::MakeScratchDir("models");
    testing::WriteFileOrDie(models_ + "/mlp.safetensors", Serialize(source_));
    socket_ = testing::MakeScratchDir("sock") + "/ws.sock";
    daemon_ = std::make_unique<testing::Daemon>(models_, std::vector<std::string>{"--socket", socket_});
    ASSERT_NE(daemon_->port(), 0) << daemon_->log();
  }

  std::vector<std::pair<std::string, std::unique_ptr<client::Store>>> Stores() {
    std::vector<std::pair<std::string, std::unique_ptr<client::Store>>> stores;
    stores.emplace_back("socket", *client::ConnectSharedMemoryStore(socket_));
    stores.emplace_back("grpc", *client::ConnectRemoteStore(daemon_->address()));
    stores.emplace_back("local", *client::OpenLocalStore(models_));
    return stores;
  }

  void ExpectSameState(torch::nn::Sequential& got) {
    auto want = source_->named_parameters();
    for (auto& p : got->named_parameters()) EXPECT_TRUE(torch::equal(p.value(), *want.find(p.key()))) << p.key();
    auto want_buffers = source_->named_buffers();
    for (auto& b : got->named_buffers()) EXPECT_TRUE(torch::equal(b.value(), *want_buffers.find(b.key()))) << b.key();
  }

  torch::nn::Sequential source_{nullptr};
  std::string models_, socket_;
  std::unique_ptr<testing::Daemon> daemon_;
};

TEST_F(TorchTest, LoadsIntoAModuleWithOneCallFromEveryStore) {
  for (auto& [label, store] : Stores()) {
    SCOPED_TRACE(label);
    torch::nn::Sequential fresh = MakeModel();
    ASSERT_OK_AND_ASSIGN(ApplyResult result, client::LoadIntoModule(*store, "mlp", *fresh));
    EXPECT_EQ(result.applied.size(), 9u);  // 4 parameters, 3 BatchNorm buffers, 2 more parameters
    EXPECT_TRUE(result.missing.empty());
    EXPECT_TRUE(result.errors.empty());
    ExpectSameState(fresh);
  }
}

TEST_F(TorchTest, TensorsFromTheSocketAreViewsOfTheMapping) {
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectSharedMemoryStore(socket_));
  ASSERT_OK_AND_ASSIGN(client::MappedTensors mapped, store->MapTensors("mlp", {}));
  for (const SharedTensor& t : mapped.tensors) {
    ASSERT_OK_AND_ASSIGN(torch::Tensor view, client::ToTorch(t));
    EXPECT_EQ(view.data_ptr(), static_cast<const void*>(t.bytes.data())) << t.spec.name;
  }
  ASSERT_OK_AND_ASSIGN(auto tensors, client::LoadTorchTensors(*store, "mlp", {}));
  auto want = source_->named_parameters();
  for (auto& [name, tensor] : tensors) {
    if (const torch::Tensor* w = want.find(name)) {
      EXPECT_TRUE(torch::equal(tensor, *w)) << name;
    }
  }
  // A cast selection arrives as torch's own cast would make it.
  client::Query half;
  half.selection.dtype = DType::kBF16;
  ASSERT_OK_AND_ASSIGN(auto cast, client::LoadTorchTensors(*store, "mlp", half));
  for (auto& [name, tensor] : cast) {
    if (const torch::Tensor* w = want.find(name)) {
      EXPECT_TRUE(torch::equal(tensor, w->to(torch::kBFloat16))) << name;
    }
  }
}

TEST_F(TorchTest, AFailedLoadNamesTheTensorAndLeavesTheModuleUntouched) {
  for (auto& [label, store] : Stores()) {
    SCOPED_TRACE(label);
    torch::nn::Sequential wrong(torch::nn::Linear(6, 4));
    torch::Tensor before = wrong[0]->as<torch::nn::Linear>()->weight.clone();
    EXPECT_THAT(client::LoadIntoModule(*store, "mlp", *wrong),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("0.weight")));
    EXPECT_TRUE(torch::equal(wrong[0]->as<torch::nn::Linear>()->weight, before));
  }
}

}  // namespace
}  // namespace weightstore
