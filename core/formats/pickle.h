// A data-only pickle interpreter for PyTorch checkpoints.
//
// It never imports or calls Python code: GLOBAL names are looked up in a fixed
// allow-list (collections.OrderedDict, torch's tensor/parameter rebuild
// functions, storage classes and dtypes, torch.Size, _codecs.encode, set,
// frozenset, bytearray) and anything else is refused with an error naming the
// global. Protocols 0 to 5 are understood except extension codes and out-of-band
// buffers. Container mutations are type-checked, and every length, memo index
// and count is bounded before allocation. Values live in an arena owned by the
// PickleResult, so cyclic or shared structures cost nothing to free.
#ifndef WEIGHTSTORE_CORE_FORMATS_PICKLE_H_
#define WEIGHTSTORE_CORE_FORMATS_PICKLE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"

namespace weightstore {

// Allow-listed callables and classes a pickle may name.
enum class PickleGlobal {
  kOrderedDict,
  kRebuildTensor,     // torch._utils._rebuild_tensor
  kRebuildTensorV2,   // torch._utils._rebuild_tensor_v2
  kRebuildTensorV3,   // torch._utils._rebuild_tensor_v3
  kRebuildParameter,  // torch._utils._rebuild_parameter
  kRebuildParameterWithState,
  kRebuildFromTypeV2,  // torch._tensor._rebuild_from_type_v2
  kTensorClass,        // torch.Tensor, torch.nn.parameter.Parameter
  kTorchSize,
  kCodecsEncode,
  kSet,  // builtins.set / frozenset
  kBytearray,
  kStorageClass,  // torch.FloatStorage, ... (dtype set), torch.UntypedStorage
  kDTypeObject,   // torch.float32, ...
  // torch._utils._rebuild_qtensor: a quantized tensor, rebuilt as a tensor of
  // its storage (whose dtype weightstore refuses, naming the tensor).
  kRebuildQTensor,
  kInert,  // a value that is only named, never called (torch.per_tensor_affine)
};

struct PickleValue;

// A storage named by a persistent id ('storage', class, key, location, numel[, view]).
struct PickleStorage {
  DType dtype = DType::kU8;
  bool untyped = false;  // UntypedStorage: numel counts bytes, dtype from the tensor
  std::string key;
  uint64_t numel = 0;
  std::string unsupported;  // a storage class of a dtype weightstore does not read ("torch.ComplexDoubleStorage")
  bool has_view = false;    // legacy view metadata (view_key, offset, size)
  std::string view_key;
  uint64_t view_offset = 0;  // in elements of the root storage
  uint64_t view_size = 0;
};

struct PickleTensor {
  const PickleValue* storage = nullptr;  // kind kStorage
  std::optional<DType> dtype;            // from _rebuild_tensor_v3
  std::string unsupported_dtype;         // ... when weightstore does not read it ("torch.complex128")
  uint64_t storage_offset = 0;           // in elements
  std::vector<uint64_t> shape;
  std::vector<uint64_t> strides;
};

struct PickleValue {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kBytes,
    kList,
    kTuple,
    kDict,
    kGlobal,
    kStorage,
    kTensor,
    kPersistentId
  };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                                                        // string, bytes, persistent-id key
  std::vector<const PickleValue*> items;                                // list, tuple
  std::vector<std::pair<const PickleValue*, const PickleValue*>> dict;  // in insertion order
  PickleGlobal global = PickleGlobal::kOrderedDict;
  std::string global_name;          // "module.name"
  DType global_dtype = DType::kU8;  // storage classes and dtype objects
  bool global_untyped = false;
  bool global_unsupported = false;  // a dtype (or its storage class) weightstore does not read
  PickleStorage storage;
  PickleTensor tensor;
};

struct PickleLimits {
  // Default: 1,000,000 memo entries.
  uint64_t max_memo = 1000000;
  // Total values created: a bound on memory (a PickleValue is ~320 bytes, so
  // ~640 MB at most). A state dict needs 15-20 a tensor. Default: 2,000,000.
  uint64_t max_values = 2000000;
  // Largest string or bytes value. Default: 64 MiB.
  uint64_t max_string = uint64_t{64} << 20;
};

// The values of one pickle. Persistent ids that are ('storage', ...) tuples become
// kStorage values; a bare string or integer id (legacy TAR checkpoints name
// tensors that way) becomes kPersistentId with the key in `s`.
class PickleResult {
 public:
  const PickleValue* root() const { return root_; }
  // Every value the pickle created, in creation order.
  const std::deque<PickleValue>& values() const { return values_; }

 private:
  friend class PickleMachine;
  std::deque<PickleValue> values_;
  const PickleValue* root_ = nullptr;
};

// Interprets one pickle that starts at data[0]. On success `*consumed` (if set)
// receives the bytes read up to and including STOP. `what` names the source in
// errors ("'model.pt' (data.pkl)").
absl::StatusOr<std::unique_ptr<PickleResult>> Unpickle(absl::string_view data, absl::string_view what,
                                                       const PickleLimits& limits = {}, size_t* consumed = nullptr);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_PICKLE_H_
