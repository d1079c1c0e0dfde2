#include "client/materialize.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/status_macros.h"

#if WEIGHTSTORE_HAVE_CUDA
#include "client/cuda_materializer.h"
#endif

namespace weightstore::client {
namespace {

// Host tensors as MaterializedTensors sharing their owners.
std::vector<MaterializedTensor> OnHost(const std::vector<SharedTensor>& tensors) {
  std::vector<MaterializedTensor> out;
  out.reserve(tensors.size());
  for (const SharedTensor& t : tensors) {
    std::shared_ptr<void> owner = std::const_pointer_cast<void>(t.bytes.owner());
    out.push_back({t.spec, Device::Cpu(), std::shared_ptr<void>(owner, const_cast<std::byte*>(t.bytes.data()))});
  }
  return out;
}

#if WEIGHTSTORE_HAVE_CUDA
absl::StatusOr<std::vector<MaterializedTensor>> OnCuda(Store& store, const std::string& name, const Query& query,
                                                       const MaterializeOptions& options) {
  std::vector<DeviceTensor> tensors;
  if (store.maps()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(MappedTensors mapped, store.MapTensors(name, query));
    CopyToDeviceOptions copy;
    copy.device = options.device.index;
    copy.pinned = options.pinned;
    WEIGHTSTORE_ASSIGN_OR_RETURN(tensors, CopyToDevice(mapped, copy));
  } else {
    CudaSinkOptions sink_options;
    sink_options.device = options.device.index;
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<CudaSink> sink, CudaSink::Create(sink_options));
    WEIGHTSTORE_RETURN_IF_ERROR(store.FetchTensors(name, query, sink.get()));
    WEIGHTSTORE_ASSIGN_OR_RETURN(tensors, sink->Finish());
  }
  std::vector<MaterializedTensor> out;
  out.reserve(tensors.size());
  for (DeviceTensor& t : tensors) out.push_back({t.spec, options.device, std::move(t.memory)});
  return out;
}
#endif

}  // namespace

absl::StatusOr<Device> Device::Parse(absl::string_view text) {
  if (text == "cpu") return Cpu();
  if (text == "cuda") return Cuda(0);
  int index = 0;
  if (absl::ConsumePrefix(&text, "cuda:") && absl::SimpleAtoi(text, &index) && index >= 0) return Cuda(index);
  return absl::InvalidArgumentError(absl::StrCat("device '", text, "' is not cpu, cuda or cuda:N"));
}

std::string Device::ToString() const { return kind == Kind::kCpu ? "cpu" : absl::StrCat("cuda:", index); }

absl::StatusOr<std::vector<MaterializedTensor>> Materialize(Store& store, const std::string& name, const Query& query,
                                                            const MaterializeOptions& options) {
  if (options.device.kind == Device::Kind::kCuda) {
#if WEIGHTSTORE_HAVE_CUDA
    if (!CudaAvailable()) return absl::UnavailableError(absl::StrCat("no CUDA device for ", options.device.ToString()));
    return OnCuda(store, name, query, options);
#else
    return absl::UnavailableError(absl::StrCat("this build of weightstore has no CUDA support (",
                                               options.device.ToString(), "); configure with the CUDA toolkit"));
#endif
  }
  if (store.maps()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(MappedTensors mapped, store.MapTensors(name, query));
    return OnHost(mapped.tensors);
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<SharedTensor> tensors, store.FetchAll(name, query));
  return OnHost(tensors);
}

}  // namespace weightstore::client
