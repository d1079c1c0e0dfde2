#include "client/torch_tensors.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/status_macros.h"

namespace weightstore::client {
namespace {

// "torch::nn::LinearImpl" -> "Linear": the PyTorch class name adapters know.
std::string ModuleKind(const torch::nn::Module& module) {
  absl::string_view name = module.name();
  absl::ConsumePrefix(&name, "torch::nn::");
  absl::ConsumeSuffix(&name, "Impl");
  return std::string(name);
}

std::optional<DType> FromTorch(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat64:
      return DType::kF64;
    case torch::kFloat32:
      return DType::kF32;
    case torch::kFloat16:
      return DType::kF16;
    case torch::kBFloat16:
      return DType::kBF16;
    case torch::kInt64:
      return DType::kI64;
    case torch::kInt32:
      return DType::kI32;
    case torch::kInt16:
      return DType::kI16;
    case torch::kInt8:
      return DType::kI8;
    case torch::kUInt8:
      return DType::kU8;
    case torch::kBool:
      return DType::kBool;
    default:
      return std::nullopt;
  }
}

// Every parameter and buffer of `module` by dotted path, with its owner's kind.
void Collect(torch::nn::Module& module, const std::string& prefix,
             std::vector<std::tuple<std::string, torch::Tensor, std::string>>* out) {
  const std::string kind = ModuleKind(module);
  for (auto& p : module.named_parameters(/*recurse=*/false)) out->emplace_back(prefix + p.key(), p.value(), kind);
  for (auto& b : module.named_buffers(/*recurse=*/false)) out->emplace_back(prefix + b.key(), b.value(), kind);
  for (auto& child : module.named_children()) Collect(*child.value(), prefix + child.key() + ".", out);
}

}  // namespace

absl::StatusOr<torch::ScalarType> TorchType(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return torch::kFloat64;
    case DType::kF32:
      return torch::kFloat32;
    case DType::kF16:
      return torch::kFloat16;
    case DType::kBF16:
      return torch::kBFloat16;
    case DType::kI64:
      return torch::kInt64;
    case DType::kI32:
      return torch::kInt32;
    case DType::kI16:
      return torch::kInt16;
    case DType::kI8:
      return torch::kInt8;
    case DType::kU8:
      return torch::kUInt8;
    case DType::kBool:
      return torch::kBool;
    default:
      return absl::UnimplementedError(absl::StrCat("torch 1.13 has no ", DTypeName(dtype), " tensors"));
  }
}

absl::StatusOr<torch::Tensor> ToTorch(const SharedTensor& tensor) {
  absl::StatusOr<torch::ScalarType> type = TorchType(tensor.spec.dtype);
  if (!type.ok())
    return absl::UnimplementedError(absl::StrCat("tensor '", tensor.spec.name, "': ", type.status().message()));
  std::vector<int64_t> shape(tensor.spec.shape.begin(), tensor.spec.shape.end());
  auto* owner = new std::shared_ptr<const void>(tensor.bytes.owner());
  return torch::from_blob(
      const_cast<std::byte*>(tensor.bytes.data()), shape, [owner](void*) { delete owner; },
      torch::TensorOptions().dtype(*type));
}

absl::StatusOr<std::vector<std::pair<std::string, torch::Tensor>>> LoadTorchTensors(Store& store,
                                                                                    const std::string& name,
                                                                                    const Query& query) {
  std::vector<SharedTensor> tensors;
  if (store.maps()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(MappedTensors mapped, store.MapTensors(name, query));
    tensors = std::move(mapped.tensors);
  } else {
    WEIGHTSTORE_ASSIGN_OR_RETURN(tensors, store.FetchAll(name, query));
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.reserve(tensors.size());
  for (const SharedTensor& t : tensors) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(torch::Tensor tensor, ToTorch(t));
    out.emplace_back(t.spec.name, std::move(tensor));
  }
  return out;
}

absl::StatusOr<ApplyResult> LoadIntoModule(Store& store, const std::string& name, torch::nn::Module& module,
                                           Query query) {
  std::vector<std::tuple<std::string, torch::Tensor, std::string>> slots;
  Collect(module, "", &slots);
  TargetSchema target;
  absl::flat_hash_map<std::string, torch::Tensor> by_path;
  for (auto& [path, tensor, kind] : slots) {
    TargetParameter p;
    p.path = path;
    p.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
    p.dtype = FromTorch(tensor.scalar_type());
    p.module = kind;
    target.parameters.push_back(std::move(p));
    by_path[path] = tensor;
  }
  query.target = std::move(target);
  if (!query.selection.contiguous_indices.has_value()) query.selection.contiguous_indices = false;
  // The apply result: from the mapping itself over the socket (one request),
  // from a listing otherwise.
  std::optional<ApplyResult> result;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  if (store.maps()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(MappedTensors mapped, store.MapTensors(name, query));
    for (const SharedTensor& t : mapped.tensors) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(torch::Tensor tensor, ToTorch(t));
      tensors.emplace_back(t.spec.name, std::move(tensor));
    }
    result = std::move(mapped.apply_result);
  } else {
    WEIGHTSTORE_ASSIGN_OR_RETURN(TensorListing listing, store.ListTensors(name, query));
    query.version = listing.version;  // the tensors the listing's apply result describes
    WEIGHTSTORE_ASSIGN_OR_RETURN(tensors, LoadTorchTensors(store, name, query));
    result = std::move(listing.apply_result);
  }
  if (!result) return absl::InternalError("the store sent no apply result");
  torch::NoGradGuard no_grad;
  for (auto& [path, tensor] : tensors) {
    auto it = by_path.find(path);
    if (it == by_path.end())
      return absl::InternalError(absl::StrCat("the daemon served '", path, "', not in the module"));
    it->second.copy_(tensor);
  }
  return *std::move(result);
}

}  // namespace weightstore::client
