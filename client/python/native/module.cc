// weightstore._native: the C++ client (client/store.h) for Python. The
// `weightstore` package (client/python/weightstore) wraps it; this file only
// converts between Python objects and the client's types.
//
// Bytes never pass through Python objects: a fetched tensor is a Buffer that
// shares its C++ owner (a HostBuffer, or a copy-on-write mapping of the
// daemon's socket) and exposes it through DLPack (torch) and the buffer
// protocol (numpy), so both view it without a copy and keep it alive. Tensors
// fetched onto a GPU (client/materialize.h) are DeviceBuffers, DLPack only. The GIL is released while bytes move; a
// fetch runs on a worker thread while the calling thread waits for signals, so
// Ctrl-C cancels it and raises KeyboardInterrupt: within about 20 ms over gRPC
// (mid-tensor and mid-retry too) and while waiting for the socket's answer, and
// within one 64 MiB piece on local files.
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/device_patches.h"
#if WEIGHTSTORE_HAVE_CUDA
#include "client/cuda_materializer.h"
#endif
#include "client/materialize.h"
#include "client/store.h"
#include "client/updates.h"
#include "core/catalog/manifest.h"
#include "core/dtype.h"

namespace py = pybind11;

namespace weightstore::python {
namespace {

// Raises weightstore.Error(code, message): `code` is the gRPC status name
// ("INVALID_ARGUMENT", ...), as the daemon's clients in other languages see it.
[[noreturn]] void Raise(const absl::Status& status) {
  py::object error = py::module_::import("weightstore._errors").attr("Error");
  py::object instance = error(absl::StatusCodeToString(status.code()), std::string(status.message()));
  PyErr_SetObject(error.ptr(), instance.ptr());
  throw py::error_already_set();
}

template <typename T>
T Unwrap(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

// A DLPack export: the tensor torch.from_dlpack receives, and the owner it
// holds until torch calls the deleter (from any thread, with or without the
// GIL: releasing `owner` touches no Python object).
struct Exported {
  DLManagedTensor managed{};
  std::shared_ptr<void> owner;
  int64_t shape[1] = {0};
};

void DeleteExported(DLManagedTensor* managed) { delete static_cast<Exported*>(managed->manager_ctx); }

// A capsule that was never consumed still owns its export.
void DestroyCapsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;  // consumed: renamed "used_dltensor"
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

// `size` bytes at `data` on `device` as a DLPack capsule of a flat uint8
// tensor (the package views it as the tensor's dtype and shape), sharing
// `owner`.
py::object ToDLPack(std::shared_ptr<void> owner, void* data, size_t size, DLDevice device) {
  auto exported = std::make_unique<Exported>();
  exported->owner = std::move(owner);
  exported->shape[0] = static_cast<int64_t>(size);
  DLTensor& t = exported->managed.dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = 1;
  t.dtype = DLDataType{kDLUInt, 8, 1};
  t.shape = exported->shape;
  t.strides = nullptr;  // compact
  t.byte_offset = 0;
  exported->managed.manager_ctx = exported.get();
  exported->managed.deleter = &DeleteExported;
  PyObject* capsule = PyCapsule_New(&exported->managed, "dltensor", &DestroyCapsule);
  if (capsule == nullptr) throw py::error_already_set();
  exported.release();  // the capsule, then its consumer, owns it now
  return py::reinterpret_steal<py::object>(capsule);
}

// Bytes shared with their C++ owner, exposed through DLPack and the buffer
// protocol.
class Buffer {
 public:
  Buffer(SharedBytes bytes, bool writable) : bytes_(std::move(bytes)), writable_(writable) {}
  // DLPack's producer side; the bytes are ready, so any stream is fine.
  // DLPack has no read-only flag, so read-only bytes are not exported: a
  // write through the tensor would crash the process.
  py::object DLPack(const py::object& /*stream*/) const {
    if (!writable_)
      throw py::buffer_error("this buffer is read-only, and DLPack cannot say so: use the buffer protocol");
    std::shared_ptr<void> owner = std::const_pointer_cast<void>(bytes_.owner());
    return ToDLPack(std::move(owner), const_cast<std::byte*>(bytes_.data()), bytes_.size(), DLDevice{kDLCPU, 0});
  }
  py::buffer_info Info() const {
    // Writable when writes stay in this process: a fetch's own memory, or a
    // socket's copy-on-write mapping.
    return py::buffer_info(const_cast<std::byte*>(bytes_.data()), 1, py::format_descriptor<uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(bytes_.size())}, {1}, !writable_);
  }
  size_t size() const { return bytes_.size(); }
  bool writable() const { return writable_; }

 private:
  SharedBytes bytes_;
  bool writable_;
};

// A tensor's bytes in GPU memory (client::Materialize), exposed through DLPack.
// Materialize returns once every copy is done, so the bytes are ready on every
// stream and __dlpack__ ignores the consumer's.
class DeviceBuffer {
 public:
  DeviceBuffer(std::shared_ptr<void> memory, size_t size, int device)
      : memory_(std::move(memory)), size_(size), device_(device) {}
  py::object DLPack(const py::object& /*stream*/) const {
    return ToDLPack(memory_, memory_.get(), size_, DLDevice{kDLCUDA, device_});
  }
  py::tuple Device() const { return py::make_tuple(static_cast<int>(kDLCUDA), device_); }
  size_t size() const { return size_; }

 private:
  std::shared_ptr<void> memory_;
  size_t size_;
  int device_;
};

// Runs `work` on a worker thread with the GIL released, checking for signals
// every 20 ms; on one (Ctrl-C), sets `cancel`, waits for the worker to stop,
// and raises the signal's exception.
template <typename T>
T RunInterruptibly(const std::shared_ptr<std::atomic<bool>>& cancel, std::function<T()> work) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::optional<T> result;
  std::thread worker([&] {
    // Nothing may escape the thread (std::terminate): failures become statuses.
    T value = absl::InternalError("the fetch failed");
    try {
      value = work();
    } catch (const std::bad_alloc&) {
      value = absl::ResourceExhaustedError("out of memory while fetching");
    } catch (const std::exception& e) {
      value = absl::InternalError(absl::StrCat("the fetch failed: ", e.what()));
    }
    std::lock_guard<std::mutex> lock(mu);
    result.emplace(std::move(value));
    done = true;
    cv.notify_all();
  });
  while (true) {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mu);
      if (cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return done; })) break;
    }
    if (PyErr_CheckSignals() != 0) {
      cancel->store(true);
      {
        py::gil_scoped_release release;
        worker.join();
      }
      throw py::error_already_set();
    }
  }
  worker.join();
  return *std::move(result);
}

// `value` for an error message: its type and a repr of at most 96 characters
// (a repr that raises is shown as its type alone).
std::string Shown(py::handle value) {
  std::string type = py::str(py::type::handle_of(value).attr("__name__"));
  try {
    std::string repr = py::repr(value);
    if (repr.size() > 96) {
      size_t cut = 93;  // on a UTF-8 character's first byte
      while (cut > 0 && (static_cast<unsigned char>(repr[cut]) & 0xC0) == 0x80) --cut;
      repr = repr.substr(0, cut) + "...";
    }
    return absl::StrCat(type, " ", repr);
  } catch (const py::error_already_set&) {
    return type;
  }
}

// `value` as T, or a TypeError naming the argument and what it holds: never
// pybind11's "Unable to cast".
template <typename T>
T Cast(py::handle value, absl::string_view what, absl::string_view expected) {
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(absl::StrCat(what, ": expected ", expected, ", got ", Shown(value)));
  }
}

std::vector<std::string> Strings(const py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return {};
  return Cast<std::vector<std::string>>(d[key], key, "a list of strings");
}

// The query a Python selection dict describes (keys as weightstore.Store's
// keyword arguments, normalized by the package). Every value is checked: a
// wrong type or an integer out of range is a TypeError naming the argument.
client::Query ToQuery(const py::dict& s) {
  client::Query q;
  SelectionOptions& o = q.selection;
  if (s.contains("top_level_key")) o.top_level_key = Cast<std::string>(s["top_level_key"], "top_level_key", "a string");
  o.include = Strings(s, "include");
  o.exclude = Strings(s, "exclude");
  o.paths = Strings(s, "paths");
  if (s.contains("renames")) {
    for (auto [pattern, replacement] : Cast<std::vector<std::pair<std::string, std::string>>>(
             s["renames"], "rename", "a list of (regex, replacement) pairs of strings")) {
      o.renames.push_back({pattern, replacement});
    }
  }
  if (s.contains("contiguous_indices") && !s["contiguous_indices"].is_none()) {
    o.contiguous_indices = Cast<bool>(s["contiguous_indices"], "contiguous_indices", "True, False or None");
  }
  if (s.contains("adapter")) {
    const std::string name = Cast<std::string>(s["adapter"], "adapter", "a string");
    std::optional<Adapter> adapter = ParseAdapter(name);
    if (!adapter) Raise(absl::InvalidArgumentError(absl::StrCat("adapter '", name, "' is unknown")));
    o.adapter = *adapter;
  }
  if (s.contains("dtype") && !s["dtype"].is_none()) {
    const std::string name = Cast<std::string>(s["dtype"], "dtype", "a string");
    std::optional<DType> dtype = ParseDType(name);
    if (!dtype) Raise(absl::InvalidArgumentError(absl::StrCat("dtype '", name, "' is unknown")));
    o.dtype = dtype;
  }
  if (s.contains("shard") && !s["shard"].is_none()) {
    auto [rank, world, rules] =
        Cast<std::tuple<uint32_t, uint32_t, std::vector<std::tuple<std::string, uint32_t, uint32_t, bool>>>>(
            s["shard"], "shard",
            "(rank, world, [(pattern, dim, parts, uneven)]) with integers from 0 to 2**32-1 and a bool");
    o.shard.rank = rank;
    o.shard.world_size = world;
    for (auto& [pattern, dim, parts, uneven] : rules)
      o.shard.rules.push_back({pattern, ShardSplit{dim, parts, uneven}});
    if (s.contains("shard_scales")) {
      for (auto& [pattern, weight, block] :
           Cast<std::vector<std::tuple<std::string, std::string, std::vector<uint64_t>>>>(
               s["shard_scales"], "shard_scales", "{regex: weight or (weight, (block, ...))} with integer blocks")) {
        o.shard.scales.push_back({pattern, weight, block});
      }
    }
    if (s.contains("shard_experts")) {
      o.shard.experts = Cast<std::vector<std::string>>(s["shard_experts"], "shard_experts", "a list of strings");
    }
    if (s.contains("detect_scales")) o.shard.detect_scales = Cast<bool>(s["detect_scales"], "detect_scales", "a bool");
  }
  if (s.contains("slices")) {
    using Bound = std::pair<std::optional<uint64_t>, std::optional<uint64_t>>;
    for (auto& [name, bounds] : Cast<std::vector<std::pair<std::string, std::vector<Bound>>>>(
             s["slices"], "slices", "[(name, [(start, stop)])] with integers from 0 to 2**64-1 or None")) {
      NamedSlice& slice = o.slices.emplace_back();
      slice.name = name;
      for (auto& [start, stop] : bounds) slice.bounds.push_back({start, stop});
    }
  }
  if (s.contains("version")) q.version = Cast<std::string>(s["version"], "version", "a string");
  if (s.contains("allow_partial")) q.allow_partial = Cast<bool>(s["allow_partial"], "allow_partial", "a bool");
  if (s.contains("with_checksums")) q.with_checksums = Cast<bool>(s["with_checksums"], "with_checksums", "a bool");
  if (s.contains("target") && !s["target"].is_none()) {
    if (!py::isinstance<py::list>(s["target"]) && !py::isinstance<py::tuple>(s["target"])) {
      throw py::type_error(absl::StrCat("target: expected a list of dicts, got ", Shown(s["target"])));
    }
    TargetSchema schema;
    size_t i = 0;
    for (const py::handle item : s["target"]) {
      const std::string what = absl::StrCat("target[", i++, "]");
      // Exactly dicts (and their subclasses): a mapping of another type
      // (UserDict, MappingProxyType) is refused, never read as a dict.
      if (!py::isinstance<py::dict>(item)) {
        throw py::type_error(absl::StrCat(what, ": expected a dict with 'path' and 'shape', got ", Shown(item)));
      }
      const py::dict p = py::reinterpret_borrow<py::dict>(item);
      if (!p.contains("path") || !p.contains("shape")) {
        throw py::type_error(absl::StrCat(what, ": a dict with 'path' and 'shape' is needed, got ", Shown(item)));
      }
      TargetParameter param;
      param.path = Cast<std::string>(p["path"], what + "['path']", "a string");
      param.shape = Cast<std::vector<uint64_t>>(p["shape"], what + "['shape']", "a list of integers from 0 to 2**64-1");
      if (p.contains("dtype") && !p["dtype"].is_none()) {
        param.dtype = ParseDType(Cast<std::string>(p["dtype"], what + "['dtype']", "a string or None"));
      }
      if (p.contains("module")) param.module = Cast<std::string>(p["module"], what + "['module']", "a string");
      schema.parameters.push_back(std::move(param));
    }
    q.target = std::move(schema);
  }
  return q;
}

py::dict ToDict(const client::CheckpointSummary& c) {
  py::dict d;
  d["name"] = c.name;
  d["format"] = c.format;
  d["container"] = c.container;
  d["path"] = c.path;
  d["total_bytes"] = c.total_bytes;
  d["tensor_count"] = c.tensor_count;
  d["metadata"] = py::cast(c.metadata);
  d["version"] = c.version;
  d["quantization"] = c.quantization.empty() ? py::none() : py::cast(c.quantization);
  if (c.follow.has_value()) {
    py::dict f;
    f["upstream"] = c.follow->upstream;
    f["upstream_version"] = c.follow->upstream_version;
    f["lag_versions"] = c.follow->lag_versions;
    f["lag_seconds"] = c.follow->lag_seconds;
    f["upstream_connected"] = c.follow->upstream_connected;
    f["blocked"] = c.follow->blocked;
    d["follow"] = f;
  } else {
    d["follow"] = py::none();
  }
  return d;
}

py::dict ToDict(const client::TensorDescription& t) {
  py::dict d;
  d["name"] = t.spec.name;
  d["dtype"] = std::string(DTypeName(t.spec.dtype));
  d["shape"] = py::tuple(py::cast(t.spec.shape));
  d["byte_size"] = t.spec.byte_size();
  d["source_name"] = t.source_name;
  d["crc32c"] = t.crc32c ? py::cast(*t.crc32c) : py::none();
  d["scale_of"] = t.scale_of.empty() ? py::none() : py::cast(t.scale_of);
  d["shares_scale_blocks"] = t.shares_scale_blocks;
  d["scale_block"] = t.scale_block.empty() ? py::none() : py::object(py::tuple(py::cast(t.scale_block)));
  d["quantization"] = t.quantization.empty() ? py::none() : py::cast(t.quantization);
  if (t.slice.empty()) {
    d["unsliced_shape"] = py::none();
    d["slice"] = py::none();
  } else {
    d["unsliced_shape"] = py::tuple(py::cast(t.unsliced_shape));
    py::list dims;
    for (const auto& ranges : t.slice.dims) {
      py::list r;
      for (const IndexRange& range : ranges) r.append(py::make_tuple(range.start, range.stop));
      dims.append(py::tuple(r));
    }
    d["slice"] = py::tuple(dims);
  }
  return d;
}

py::object ToPython(const std::optional<ApplyResult>& r) {
  if (!r) return py::none();
  py::dict d;
  d["applied"] = py::cast(r->applied);
  d["skipped"] = py::cast(r->skipped);
  d["missing"] = py::cast(r->missing);
  d["unused"] = py::cast(r->unused);
  py::list errors;
  for (const ApplyError& e : r->errors) errors.append(absl::StrCat(e.path, ": ", e.message));
  d["errors"] = errors;
  d["suggestions"] = py::cast(r->suggestions);
  return d;
}

// (name, dtype, shape, Buffer) for each tensor.
py::list ToTensors(std::vector<SharedTensor> tensors, bool writable) {
  py::list out;
  for (SharedTensor& t : tensors) {
    out.append(py::make_tuple(t.spec.name, std::string(DTypeName(t.spec.dtype)), py::tuple(py::cast(t.spec.shape)),
                              Buffer(std::move(t.bytes), writable)));
  }
  return out;
}

// The element patches one Store.delta() received (client::ReceivedPatch).
struct Patches {
  std::vector<client::ReceivedPatch> patches;
};

// Views of caller-owned memory, [(name, dtype, shape, address, bytes)], as
// tensors (not copied: the caller keeps the memory alive for the call).
std::vector<SharedTensor> Views(const py::list& tensors) {
  std::vector<SharedTensor> out;
  for (const py::handle& item : tensors) {
    const auto [name, dtype_name, shape, address, bytes] =
        item.cast<std::tuple<std::string, std::string, std::vector<uint64_t>, uintptr_t, uint64_t>>();
    std::optional<DType> dtype = ParseDType(dtype_name);
    if (!dtype)
      Raise(absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has an unknown dtype '", dtype_name, "'")));
    TensorSpec spec{name, *dtype, shape};
    if (bytes != spec.byte_size() || (address == 0 && bytes > 0)) {
      Raise(absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' has ", bytes, " bytes; its shape needs ", spec.byte_size())));
    }
    out.push_back({std::move(spec), SharedBytes(nullptr, std::span<const std::byte>(
                                                             reinterpret_cast<const std::byte*>(address), bytes))});
  }
  return out;
}

// A patch's destination as Python gives it: (address, bytes[, device]),
// device >= 0 for a CUDA tensor on that device. INVALID_ARGUMENT naming the
// tensor for another form, a null address or a negative device.
client::PatchDestination ToPatchDestination(const std::string& name, const py::handle& given) {
  const py::tuple where = py::reinterpret_borrow<py::object>(given).cast<py::tuple>();
  if (where.size() != 2 && where.size() != 3) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat("the destination of tensor '", name, "' is not (address, bytes[, device])")));
  }
  const auto address = where[0].cast<uintptr_t>();
  const auto bytes = where[1].cast<uint64_t>();
  const int device = where.size() == 3 ? where[2].cast<int>() : -1;
  if (address == 0 || device < -1) {
    Raise(absl::InvalidArgumentError(absl::StrCat("the destination of tensor '", name, "' is not usable memory")));
  }
  return {{reinterpret_cast<std::byte*>(address), bytes}, device};
}

// Tensors a Python caller holds (a module's, or a dict's), as an update's
// destination: what is held is given up front; where patches go is asked of
// `patch_into` (with the GIL), whose exception cancels the update (`cancel`)
// and is raised in its place.
class PyDestination final : public client::UpdateDestination {
 public:
  PyDestination(const py::list& held, bool fixed, py::function patch_into, std::shared_ptr<std::atomic<bool>> cancel)
      : fixed_(fixed), patch_into_(std::move(patch_into)), cancel_(std::move(cancel)) {
    for (const py::handle& item : held) {
      const auto [name, dtype, shape, patchable] =
          item.cast<std::tuple<std::string, std::string, std::vector<uint64_t>, bool>>();
      names_.push_back(name);
      held_.insert_or_assign(name, Held{ParseDType(dtype), shape, patchable});
    }
  }

  std::optional<Held> Find(const std::string& name) const override {
    auto it = held_.find(name);
    if (it == held_.end()) return std::nullopt;
    return it->second;
  }
  std::vector<std::string> Names() const override { return names_; }
  bool fixed_names() const override { return fixed_; }

  absl::StatusOr<std::vector<client::PatchDestination>> PatchInto(std::span<const client::ReceivedPatch> patches,
                                                                  bool* in_place) override {
    py::gil_scoped_acquire acquire;
    try {
      py::list names;
      for (const client::ReceivedPatch& p : patches) names.append(p.spec.name);
      const py::tuple given = patch_into_(names).cast<py::tuple>();
      const py::list where = given[0].cast<py::list>();
      if (where.size() != patches.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where.size(), " patch destinations for ", patches.size(), " patches"));
      }
      std::vector<client::PatchDestination> out;
      for (size_t i = 0; i < patches.size(); ++i) out.push_back(ToPatchDestination(patches[i].spec.name, where[i]));
      *in_place = given[1].cast<bool>();  // once the destinations are known to be usable
      return out;
    } catch (py::error_already_set& error) {
      raised_.emplace(std::move(error));
      cancel_->store(true);
      return absl::CancelledError("the update's patch_into raised");
    } catch (const py::cast_error& error) {
      return absl::InvalidArgumentError(absl::StrCat("patch_into gave no (destinations, in_place): ", error.what()));
    }
  }

  // Raises what patch_into raised, if it did.
  void RaiseIfCallbackRaised() {
    if (raised_) throw std::move(*raised_);
  }

 private:
  bool fixed_;
  py::function patch_into_;
  std::shared_ptr<std::atomic<bool>> cancel_;
  std::vector<std::string> names_;
  absl::flat_hash_map<std::string, Held> held_;
  std::optional<py::error_already_set> raised_;
};

class Store {
 public:
  Store(std::unique_ptr<client::Store> store, client::SharedMemoryStore* shm, std::string kind)
      : store_(std::move(store)), shm_(shm), kind_(std::move(kind)) {}
  // A socket store: `socket_path` and `options` open the read-only connection
  // that device fetches use.
  Store(std::unique_ptr<client::SharedMemoryStore> store, std::string socket_path, client::SharedMemoryOptions options)
      : shm_(store.get()), kind_("socket"), socket_path_(std::move(socket_path)), socket_options_(options) {
    store_ = std::move(store);
  }

  const std::string& kind() const { return kind_; }

  // Listings run interruptibly, as fetches do: Ctrl-C ends a wait for a
  // stalled daemon within about 20 ms, not at the call's timeout.
  py::list List() {
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    std::vector<client::CheckpointSummary> list =
        Unwrap(RunInterruptibly<absl::StatusOr<std::vector<client::CheckpointSummary>>>(
            cancel, [&] { return store_->ListCheckpoints(cancel); }));
    py::list out;
    for (const auto& c : list) out.append(ToDict(c));
    return out;
  }

  py::dict Info(const std::string& name) {
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    return ToDict(Unwrap(RunInterruptibly<absl::StatusOr<client::CheckpointSummary>>(
        cancel, [&] { return store_->GetCheckpoint(name, cancel); })));
  }

  py::dict Listing(const std::string& name, const py::dict& selection) {
    client::Query query = ToQuery(selection);
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    query.cancel = cancel;
    absl::StatusOr<client::TensorListing> listing = RunInterruptibly<absl::StatusOr<client::TensorListing>>(
        cancel, [&] { return store_->ListTensors(name, query); });
    if (!listing.ok()) Raise(listing.status());
    py::dict out;
    out["version"] = listing->version;
    py::list tensors;
    for (const auto& t : listing->tensors) tensors.append(ToDict(t));
    out["tensors"] = tensors;
    out["apply_result"] = ToPython(listing->apply_result);
    return out;
  }

  // Every selected tensor: mapped without a copy through a socket
  // (copy-on-write), else fetched into memory the buffers own. With a
  // target, the apply result too; a failing load raises FAILED_PRECONDITION.
  py::dict Fetch(const std::string& name, const py::dict& selection) {
    client::Query query = ToQuery(selection);
    // A copy out of local files does not keep the files mapped beside it.
    query.release_source_pages = true;
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    query.cancel = cancel;
    py::dict out;
    if (shm_ != nullptr) {
      // The daemon may take a while to answer (a cast made, a checkpoint
      // pulled): Ctrl-C ends the wait.
      absl::StatusOr<client::MappedTensors> mapped = RunInterruptibly<absl::StatusOr<client::MappedTensors>>(
          cancel, [&] { return shm_->MapTensors(name, query); });
      if (!mapped.ok()) Raise(mapped.status());
      out["version"] = mapped->version;
      // Copy-on-write mappings (client/store.h): a write copies the page.
      out["tensors"] = ToTensors(std::move(mapped->tensors), /*writable=*/true);
      out["apply_result"] = ToPython(mapped->apply_result);
      return out;
    }
    // The apply result comes with the listing; the fetch follows it, pinned to
    // the listed version.
    std::optional<ApplyResult> applied;
    if (query.target) {
      client::TensorListing listing = Unwrap(RunInterruptibly<absl::StatusOr<client::TensorListing>>(
          cancel, [&] { return store_->ListTensors(name, query); }));
      query.version = listing.version;
      applied = std::move(listing.apply_result);
    }
    client::Store::Fetched fetched = Unwrap(RunInterruptibly<absl::StatusOr<client::Store::Fetched>>(
        cancel, [&] { return store_->FetchVersioned(name, query); }));
    out["version"] = fetched.version.empty() ? query.version : fetched.version;
    out["tensors"] = ToTensors(std::move(fetched.tensors), /*writable=*/true);
    out["apply_result"] = ToPython(applied);
    return out;
  }

  // Every selected tensor written straight into its place in `places`
  // ([(served name, dtype, shape, address, bytes)]: memory the caller keeps
  // alive and leaves alone for the call) where the place has the tensor's
  // dtype and shape: one copy from the mapping or the wire, with the GIL
  // released, the source's pages dropped once copied. The others are
  // fetched into memory of their own, as Fetch does, for the caller to
  // convert. The listing comes first and pins the version; with a target it
  // checks the load (FAILED_PRECONDITION, nothing written). A fetch that
  // fails once writing began says that the places may be partly written.
  // `written` gets True appended once anything may have been written, error
  // or not.
  py::dict LoadInto(const std::string& name, const py::dict& selection, const py::list& places, py::list written) {
    client::Query query = ToQuery(selection);
    query.release_source_pages = true;
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    query.cancel = cancel;
    absl::flat_hash_map<std::string, client::PlacingSink::Place> where;
    for (SharedTensor& view : Views(places)) {
      std::span<std::byte> bytes(const_cast<std::byte*>(view.bytes.data()), view.bytes.size());
      const std::string served = view.spec.name;
      if (!where.try_emplace(served, client::PlacingSink::Place{view.spec.dtype, std::move(view.spec.shape), bytes})
               .second) {
        Raise(absl::InvalidArgumentError(absl::StrCat("tensor '", served, "' is given two places")));
      }
    }
    client::TensorListing listing = Unwrap(RunInterruptibly<absl::StatusOr<client::TensorListing>>(
        cancel, [&] { return store_->ListTensors(name, query); }));
    query.version = listing.version;
    // Only what the listing names, as it names it, may be written in place.
    absl::flat_hash_map<std::string, client::PlacingSink::Place> listed;
    for (const client::TensorDescription& t : listing.tensors) {
      auto it = where.find(t.spec.name);
      if (it != where.end() && it->second.dtype == t.spec.dtype && it->second.shape == t.spec.shape) {
        listed.insert(where.extract(it));
      }
    }
    client::PlacingSink sink(std::move(listed), cancel);
    constexpr absl::string_view kPartlyWritten =
        "after the load began writing into the module: its parameters may be partly written; load again";
    absl::Status fetched;
    try {
      fetched = RunInterruptibly<absl::Status>(cancel, [&] { return store_->FetchTensors(name, query, &sink); });
    } catch (py::error_already_set& interrupted) {  // Ctrl-C: the fetch stopped before this
      if (sink.written_any()) written.append(true);
      if (!sink.written_any() || !interrupted.matches(PyExc_KeyboardInterrupt)) throw;
      PyErr_SetString(PyExc_KeyboardInterrupt, absl::StrCat("load_into was interrupted ", kPartlyWritten).c_str());
      throw py::error_already_set();
    }
    if (sink.written_any()) written.append(true);
    if (!fetched.ok() && sink.written_any()) {
      Raise(absl::Status(fetched.code(), absl::StrCat(fetched.message(), " (", kPartlyWritten, ")")));
    }
    if (!fetched.ok()) Raise(fetched);
    // Only what the listing named, each once, as it named it (a daemon's bug
    // or a forged stream would leave a parameter unloaded, or misshapen).
    if (absl::Status delivered = sink.CheckDelivered(listing); !delivered.ok()) {
      Raise(sink.written_any()
                ? absl::Status(delivered.code(), absl::StrCat(delivered.message(), " (", kPartlyWritten, ")"))
                : delivered);
    }
    py::dict out;
    out["version"] = sink.rest().version().empty() ? listing.version : sink.rest().version();
    out["placed"] = py::cast(sink.placed());
    out["tensors"] = ToTensors(std::move(sink.rest().tensors()), /*writable=*/true);
    out["apply_result"] = ToPython(listing.apply_result);
    return out;
  }

  // Every selected tensor copied onto CUDA device `device` by the C++ client
  // (client::Materialize): from a socket, one DMA per mapped extent out of the
  // daemon's mappings, registered for this call; from gRPC or local files,
  // through a ring of pinned staging buffers that overlaps the transfer.
  // UNAVAILABLE without a GPU or in a build without CUDA.
  py::dict FetchToDevice(const std::string& name, const py::dict& selection, int device) {
    client::Query query = ToQuery(selection);
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    query.cancel = cancel;
    client::MaterializeOptions options;
    options.device = client::Device::Cuda(device);
    std::vector<client::MaterializedTensor> tensors =
        Unwrap(RunInterruptibly<absl::StatusOr<std::vector<client::MaterializedTensor>>>(
            cancel, [&]() -> absl::StatusOr<std::vector<client::MaterializedTensor>> {
              absl::StatusOr<client::Store*> store = DeviceSource();
              if (!store.ok()) return store.status();
              return client::Materialize(**store, name, query, options);
            }));
    py::list out;
    for (client::MaterializedTensor& t : tensors) {
      const size_t size = t.spec.byte_size();
      out.append(py::make_tuple(t.spec.name, std::string(DTypeName(t.spec.dtype)), py::tuple(py::cast(t.spec.shape)),
                                DeviceBuffer(std::move(t.memory), size, device)));
    }
    py::dict result;
    result["version"] = query.version;
    result["tensors"] = out;
    return result;
  }

  // What changed since version `since` (empty: everything): the listing's
  // version, whether it is a delta (else why not), every selected name in
  // listing order, those unchanged (with their listed dtype and shape), and
  // the tensors received (the rest):
  // fetched pinned to the listed version, or through a socket mapped. The
  // local store sends everything.
  // With `patches`, a changed tensor may come as an element patch instead:
  // "patched" maps its name to its (dtype, shape), and "patches" holds them
  // for apply_patches().
  py::dict Delta(const std::string& name, const py::dict& selection, const std::string& since, bool patches) {
    client::Query query = ToQuery(selection);
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    query.cancel = cancel;
    query.since_version = since;
    query.patches = patches;
    client::ChangedTensors changed = Unwrap(RunInterruptibly<absl::StatusOr<client::ChangedTensors>>(
        cancel, [&] { return client::FetchChanged(*store_, name, query); }));
    py::dict out;
    out["version"] = changed.version;
    out["delta"] = changed.delta;
    out["full_reason"] = changed.full_reason;
    py::list names;
    py::dict unchanged;  // name: (dtype, shape) as listed
    for (const auto& t : changed.listed) {
      names.append(t.spec.name);
      if (changed.delta && t.unchanged) {
        unchanged[py::str(t.spec.name)] =
            py::make_tuple(std::string(DTypeName(t.spec.dtype)), py::tuple(py::cast(t.spec.shape)));
      }
    }
    out["names"] = names;
    out["unchanged"] = unchanged;
    out["tensors"] = ToTensors(std::move(changed.received), /*writable=*/true);
    py::dict patched;
    uint64_t patch_bytes = 0;
    for (const client::ReceivedPatch& p : changed.patched) {
      patched[py::str(p.spec.name)] =
          py::make_tuple(std::string(DTypeName(p.spec.dtype)), py::tuple(py::cast(p.spec.shape)));
      patch_bytes += p.patch.body.size();
    }
    out["patched"] = patched;
    out["patch_bytes"] = patch_bytes;
    out["patch_reason"] = changed.patch_reason;
    out["patches"] = Patches{std::move(changed.patched)};
    return out;
  }

  // Publishes `tensors`, [(name, dtype, shape, address, bytes)] of contiguous
  // CPU memory the caller keeps alive and unchanged for the call, as the next
  // version of `name` (client::PlanPush against the served version, with
  // `base`, in the same form, for element patches; then Store::Push), with
  // the GIL released. Returns {version, previous_version, whole, patched,
  // removed, unchanged, whole_bytes, patch_bytes}.
  py::dict Push(const std::string& name, const py::list& tensors, const py::list& base, uint64_t max_patch_bytes) {
    std::vector<SharedTensor> next = Views(tensors), held = Views(base);
    absl::StatusOr<client::PushPlan> plan;
    absl::StatusOr<client::CheckpointSummary> pushed;
    {
      py::gil_scoped_release release;
      absl::StatusOr<client::TensorListing> served = store_->ListTensors(name, {});
      plan = served.ok() ? client::PlanPush(*served, next, held, max_patch_bytes)
                         : absl::StatusOr<client::PushPlan>(served.status());
      pushed = plan.ok() ? store_->Push(name, plan->request) : absl::StatusOr<client::CheckpointSummary>(plan.status());
    }
    if (!pushed.ok()) Raise(pushed.status());
    py::dict out;
    out["version"] = pushed->version;
    out["previous_version"] = plan->request.base_version;
    py::list whole, patched;
    for (const SharedTensor& t : plan->request.tensors) whole.append(t.spec.name);
    for (const client::PushRequest::Patched& p : plan->request.patched) patched.append(p.spec.name);
    out["whole"] = whole;
    out["patched"] = patched;
    out["removed"] = plan->request.remove;
    out["unchanged"] = plan->unchanged;
    out["whole_bytes"] = plan->whole_bytes;
    out["patch_bytes"] = plan->patch_bytes;
    return out;
  }

  // Each patch of `patches` decoded, for callers that write elements
  // themselves (vLLM's load_checkpoint_weight_patches): [(name, dtype, shape,
  // digest, indices, values)], `indices` the changed elements' flat positions
  // as little-endian int64 in ascending order, `values` their new bytes in
  // the same order (PatchElementSize(dtype) bytes each). Each patch is checked
  // in full first (INVALID_ARGUMENT naming the tensor); decoding runs with the
  // GIL released.
  static py::list DecodePatches(const Patches& patches) {
    struct Decoded {
      std::vector<std::byte> indices, values;
    };
    std::vector<Decoded> decoded(patches.patches.size());
    absl::Status status;
    {
      py::gil_scoped_release release;
      for (size_t i = 0; i < patches.patches.size() && status.ok(); ++i) {
        const client::ReceivedPatch& p = patches.patches[i];
        const ElementPatch& patch = p.patch;
        if (absl::Status checked = CheckPatch(patch); !checked.ok()) {
          status = absl::InvalidArgumentError(
              absl::StrCat("the patch of tensor '", p.spec.name, "' is malformed: ", checked.message()));
          break;
        }
        // CheckPatch bounds `changed` by the tensor's elements, and the body
        // holds changed * element_size bytes of values.
        Decoded& d = decoded[i];
        d.indices.resize(patch.changed * sizeof(int64_t));
        d.values.resize(patch.changed * patch.element_size);
        uint64_t at = 0;
        status = ForEachRun(patch, [&](uint64_t start, uint64_t length, const std::byte* values) {
          // CheckPatch counted the runs already; a second parse that says
          // more (bytes changed under it) writes nothing past the buffers.
          if (at > patch.changed || length > patch.changed - at) {
            at = patch.changed + 1;
            return;
          }
          for (uint64_t k = 0; k < length; ++k) {
            const int64_t position = static_cast<int64_t>(start + k);
            std::memcpy(d.indices.data() + (at + k) * sizeof(int64_t), &position, sizeof(position));
          }
          std::memcpy(d.values.data() + at * patch.element_size, values, length * patch.element_size);
          at += length;
        });
        if (status.ok() && at != patch.changed) {
          status = absl::InvalidArgumentError(absl::StrCat("the patch of tensor '", p.spec.name, "' writes ", at,
                                                           " elements and says ", patch.changed));
        }
      }
    }
    if (!status.ok()) Raise(status);
    py::list out;
    for (size_t i = 0; i < decoded.size(); ++i) {
      const client::ReceivedPatch& p = patches.patches[i];
      out.append(py::make_tuple(p.spec.name, std::string(DTypeName(p.spec.dtype)), py::tuple(py::cast(p.spec.shape)),
                                p.digest, Buffer(SharedBytes::FromVector(std::move(decoded[i].indices)), true),
                                Buffer(SharedBytes::FromVector(std::move(decoded[i].values)), true)));
    }
    return out;
  }

  // Applies `patches` in one call, with the GIL released: each into the
  // memory `destinations` gives for its name, as (address, bytes) of a
  // writable, contiguous CPU tensor holding it at the since version, or
  // (address, bytes, device) with device >= 0 for a CUDA tensor on that
  // device (scattered there: client/device_patches.h); then checks each
  // result's digest (Error DATA_LOSS naming the tensor otherwise;
  // INVALID_ARGUMENT, with nothing written, for a malformed patch or a
  // destination that does not fit; UNAVAILABLE or UNIMPLEMENTED for a CUDA
  // destination without a GPU or in a build without CUDA).
  static void ApplyPatches(const Patches& patches, const py::dict& destinations) {
    std::vector<client::PatchDestination> to;
    for (const client::ReceivedPatch& p : patches.patches) {
      const py::str key(p.spec.name);
      if (!destinations.contains(key)) {
        Raise(absl::InvalidArgumentError(absl::StrCat("no destination for the patch of tensor '", p.spec.name, "'")));
      }
      to.push_back(ToPatchDestination(p.spec.name, destinations[key]));
    }
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client::ApplyPatchesAt(patches.patches, to);
    }
    if (!status.ok()) Raise(status);
  }

  // Brings tensors the caller holds to the current version of `name`, by
  // client::UpdateInto (the update algorithm: what to fetch, patches or
  // tensors, applying and checking them), with the GIL released. `held` is
  // [(name, dtype, shape, patchable)] of every tensor held, with the served
  // dtype's name ("" for none) and the served shape; `since_selection` the
  // selection_key() the held tensors were fetched with (b"": not known);
  // `fixed`: every tensor written must be held already, with its shape (a
  // module). `patch_into(names)` is called (with the GIL) at most once, for
  // the tensors that came as element patches, and returns (destinations,
  // in_place): each an (address, bytes[, device]) as apply_patches() takes,
  // holding the held bytes, and whether that is the held memory itself.
  // Returns the Update's fields, "tensors" (those that came whole, as
  // fetch() gives them) and "selection" (to record with the new version).
  py::dict Update(const std::string& name, const py::dict& selection, const std::string& since,
                  const py::bytes& since_selection, const py::list& held, bool fixed, const py::function& patch_into) {
    client::Query query = ToQuery(selection);
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    query.cancel = cancel;
    PyDestination destination(held, fixed, patch_into, cancel);
    const std::string recorded = since_selection;
    absl::StatusOr<client::Updated> done = RunInterruptibly<absl::StatusOr<client::Updated>>(
        cancel, [&] { return client::UpdateInto(*store_, name, query, since, recorded, destination); });
    destination.RaiseIfCallbackRaised();
    client::Updated updated = Unwrap(std::move(done));
    const client::UpdateResult& r = updated.result;
    py::dict out;
    out["version"] = r.new_version;
    out["delta"] = r.delta;
    out["full_reason"] = r.full_reason;
    out["changed"] = py::cast(r.changed);
    out["added"] = py::cast(r.added);
    out["removed"] = py::cast(r.removed);
    out["patched"] = py::cast(r.patched);
    out["fetched_bytes"] = r.fetched_bytes;
    out["patch_reason"] = r.patch_reason;
    out["patch_failure"] = r.patch_failure;
    out["tensors"] = ToTensors(std::move(updated.received), /*writable=*/true);
    out["selection"] = py::bytes(updated.selection);
    return out;
  }

  // What a query selects, as bytes equal exactly when two selections select
  // alike (client::SelectionKey): recorded with a version fetched, for
  // update()'s `since_selection`.
  static py::bytes SelectionKey(const py::dict& selection) {
    return py::bytes(client::SelectionKey(ToQuery(selection)));
  }

  // Follows checkpoints: calls `callback` with each event (a dict) until it
  // returns False. Ctrl-C ends it (the signal's exception); an exception in
  // the callback ends it and is raised.
  void Watch(const std::string& name, const std::string& prefix, const std::map<std::string, std::string>& known,
             const py::function& callback) {
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    std::optional<py::error_already_set> raised;
    absl::Status status = RunInterruptibly<absl::Status>(cancel, [&]() {
      return store_->Watch({.name = name, .prefix = prefix, .known = known, .cancel = cancel},
                           [&](const client::CheckpointEvent& e) {
                             py::gil_scoped_acquire acquire;
                             static constexpr const char* kKinds[] = {"added", "replaced", "removed", "synced"};
                             py::dict event;
                             event["kind"] = kKinds[static_cast<int>(e.kind)];
                             event["name"] = e.name;
                             event["old_version"] = e.old_version;
                             event["new_version"] = e.new_version;
                             event["delta"] = e.delta;
                             event["full_reason"] = e.full_reason;
                             event["changed"] = py::cast(e.changed);
                             event["added"] = py::cast(e.added);
                             event["removed"] = py::cast(e.removed);
                             try {
                               const int truth = PyObject_IsTrue(callback(event).ptr());
                               if (truth < 0) throw py::error_already_set();  // its __bool__ raised
                               return truth == 1;
                             } catch (py::error_already_set& error) {
                               raised.emplace(std::move(error));
                               return false;
                             }
                           });
    });
    if (raised) throw std::move(*raised);
    if (!status.ok()) Raise(status);
  }

 private:
  // The store device fetches read from. A socket store's own connection maps
  // copy-on-write, and cudaHostRegister of a copy-on-write file mapping hung
  // on the H100 test machine (client/store.h), so device fetches get a second
  // connection, opened on first use, that maps read-only.
  absl::StatusOr<client::Store*> DeviceSource() {
    if (shm_ == nullptr) return store_.get();
    std::lock_guard<std::mutex> lock(device_mu_);
    if (read_only_ == nullptr) {
      client::SharedMemoryOptions options = socket_options_;
      options.copy_on_write = false;
      absl::StatusOr<std::unique_ptr<client::SharedMemoryStore>> opened =
          client::ConnectSharedMemoryStore(socket_path_, options);
      if (!opened.ok()) return opened.status();
      read_only_ = *std::move(opened);
    }
    return read_only_.get();
  }

  std::unique_ptr<client::Store> store_;
  client::SharedMemoryStore* shm_ = nullptr;  // store_ itself, when it is a socket store
  std::string kind_;
  std::string socket_path_;
  client::SharedMemoryOptions socket_options_;
  std::mutex device_mu_;
  std::unique_ptr<client::SharedMemoryStore> read_only_;  // guarded by device_mu_
};

// "file:/models" (or a path), "unix:/run/ws.sock", or "host:port".
std::unique_ptr<Store> Connect(const std::string& url, const std::string& token, const std::string& tls_ca,
                               const std::string& tls_cert, const std::string& tls_key, int parallel_streams,
                               std::optional<bool> pipeline, int max_resumes, double timeout_seconds,
                               const std::string& record_layout, bool data_lane) {
  // Whole milliseconds, at least one (0 would mean no timeout to a socket).
  const auto timeout = std::chrono::milliseconds(std::max<int64_t>(1, std::llround(std::ceil(timeout_seconds * 1000))));
  if (absl::StartsWith(url, "file:") || absl::StartsWith(url, "/") || absl::StartsWith(url, ".")) {
    const std::string path = absl::StartsWith(url, "file:") ? url.substr(5) : url;
    absl::StatusOr<std::unique_ptr<client::Store>> local;
    {
      py::gil_scoped_release release;
      OpenOptions open;
      open.record_layout = record_layout;
      local = client::OpenLocalStore(path, open);
    }
    return std::make_unique<Store>(Unwrap(std::move(local)), nullptr, "local");
  }
  if (absl::StartsWith(url, "unix:")) {
    client::SharedMemoryOptions options;
    options.timeout = timeout;
    options.copy_on_write = true;  // tensors written in place get private pages, not a crash
    absl::StatusOr<std::unique_ptr<client::SharedMemoryStore>> shm;
    {
      py::gil_scoped_release release;
      shm = client::ConnectSharedMemoryStore(url.substr(5), options);
    }
    return std::make_unique<Store>(Unwrap(std::move(shm)), url.substr(5), options);
  }
  client::RemoteOptions options;
  options.deadline = timeout;
  options.token = token;
  options.tls_ca_file = tls_ca;
  options.tls_cert_file = tls_cert;
  options.tls_key_file = tls_key;
  options.parallel_streams = parallel_streams;
  options.pipeline = pipeline;
  options.max_resumes = max_resumes;
  options.data_lane = data_lane;
  const std::string address = absl::StartsWith(url, "grpc://") ? url.substr(7) : url;
  absl::StatusOr<std::unique_ptr<client::Store>> remote;
  {
    py::gil_scoped_release release;
    remote = client::ConnectRemoteStore(address, options);
  }
  return std::make_unique<Store>(Unwrap(std::move(remote)), nullptr, "remote");
}

}  // namespace
}  // namespace weightstore::python

PYBIND11_MODULE(_native, m) {
  using namespace weightstore::python;
  m.doc() = "weightstore's C++ client; use the weightstore package";
  py::class_<Buffer>(m, "Buffer", py::buffer_protocol())
      .def_buffer(&Buffer::Info)
      .def("__len__", &Buffer::size)
      .def("__dlpack__", &Buffer::DLPack, py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const Buffer&) { return py::make_tuple(static_cast<int>(kDLCPU), 0); })
      .def_property_readonly("writable", &Buffer::writable);
  py::class_<DeviceBuffer>(m, "DeviceBuffer")
      .def("__len__", &DeviceBuffer::size)
      .def("__dlpack__", &DeviceBuffer::DLPack, py::arg("stream") = py::none())
      .def("__dlpack_device__", &DeviceBuffer::Device);
  py::class_<Patches>(m, "Patches").def("__len__", [](const Patches& p) { return p.patches.size(); });
  py::class_<Store>(m, "Store")
      .def_property_readonly("kind", &Store::kind)
      .def("list", &Store::List)
      .def("info", &Store::Info, py::arg("name"))
      .def("listing", &Store::Listing, py::arg("name"), py::arg("selection"))
      .def("fetch", &Store::Fetch, py::arg("name"), py::arg("selection"))
      .def("load_into", &Store::LoadInto, py::arg("name"), py::arg("selection"), py::arg("places"), py::arg("written"))
      .def("fetch_to_device", &Store::FetchToDevice, py::arg("name"), py::arg("selection"), py::arg("device"))
      .def("delta", &Store::Delta, py::arg("name"), py::arg("selection"), py::arg("since"), py::arg("patches") = false)
      .def_static("apply_patches", &Store::ApplyPatches, py::arg("patches"), py::arg("destinations"))
      .def("update", &Store::Update, py::arg("name"), py::arg("selection"), py::arg("since"),
           py::arg("since_selection"), py::arg("held"), py::arg("fixed"), py::arg("patch_into"))
      .def_static("selection_key", &Store::SelectionKey, py::arg("selection"))
      .def_static("decode_patches", &Store::DecodePatches, py::arg("patches"))
      .def("push", &Store::Push, py::arg("name"), py::arg("tensors"), py::arg("base"), py::arg("max_patch_bytes"))
      .def("watch", &Store::Watch, py::arg("name"), py::arg("prefix"), py::arg("known"), py::arg("callback"));
  m.def("connect", &Connect, py::arg("url"), py::arg("token") = "", py::arg("tls_ca") = "", py::arg("tls_cert") = "",
        py::arg("tls_key") = "", py::arg("parallel_streams") = 0, py::arg("pipeline") = py::none(),
        py::arg("max_resumes") = 3, py::arg("timeout") = 600.0, py::arg("record_layout") = "",
        py::arg("data_lane") = true);
  m.def("tune_allocator_for_streaming", &weightstore::client::TuneAllocatorForStreaming);
  // The digest (core/catalog/manifest.h) of each (address, bytes) given, as
  // 32 hex digits: the caller keeps that memory alive and unchanged.
  m.def("digests", [](const std::vector<std::pair<uintptr_t, uint64_t>>& views) {
    std::vector<std::string> out;
    out.reserve(views.size());
    py::gil_scoped_release released;
    for (const auto& [address, bytes] : views) {
      out.push_back(weightstore::DigestBytes(std::span<const std::byte>(reinterpret_cast<const std::byte*>(address),
                                                                        static_cast<size_t>(bytes)))
                        .Hex());
    }
    return out;
  });
  // Whether this build has the C++ client's CUDA paths (WEIGHTSTORE_WITH_CUDA).
#if WEIGHTSTORE_HAVE_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  // Whether element patches can be written into GPU memory here: a build
  // with the scatter kernel, and a CUDA device its runtime can use (asked
  // once, by the caller).
  m.def("cuda_patches_usable", []() -> bool {
#if WEIGHTSTORE_HAVE_CUDA_KERNELS
    return weightstore::client::CudaAvailable();
#else
    return false;
#endif
  });
}
