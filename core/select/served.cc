#include "core/select/served.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/dtype.h"
#include "core/host_buffer.h"
#include "core/status_macros.h"

namespace weightstore {

ServedTensorPlan PlanServedTensor(const Snapshot& snapshot, const SnapshotTensor& tensor) {
  ServedTensorPlan plan;
  plan.tensor = &tensor;
  plan.entry = static_cast<size_t>(tensor.source - snapshot.checkpoint().entries().data());
  plan.transpose = tensor.transpose;
  plan.cast = tensor.spec.dtype != tensor.source->spec.dtype;
  plan.gather =
      !Checkpoint::IsZeroCopy(*tensor.source) || !tensor.slice.ContiguousStart(tensor.unsliced_shape()).has_value();
  plan.byte_size = tensor.spec.byte_size();
  plan.key = absl::StrCat(plan.entry, ":", DTypeName(tensor.spec.dtype), plan.transpose ? ":T" : "",
                          tensor.slice.empty() ? "" : ":", tensor.slice.ToString(tensor.unsliced_shape()));
  return plan;
}

absl::StatusOr<SharedBytes> ReadServedView(const Snapshot& snapshot, const ServedTensorPlan& plan) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor read, snapshot.Read(*plan.tensor));
  return read.bytes;
}

absl::Status MaterializeServed(const Snapshot& snapshot, const ServedTensorPlan& plan, uint64_t offset,
                               std::span<std::byte> out) {
  // The whole tensor in one pass when asked for (a socket segment); ranges
  // stream (a gRPC chunk).
  if (offset == 0 && out.size() == plan.byte_size) return snapshot.ReadInto(*plan.tensor, out);
  return snapshot.ReadRange(*plan.tensor, offset, out);
}

uint64_t ServedPieceBytes(const ServedTensorPlan& plan, uint64_t about) {
  const TensorSpec& spec = plan.tensor->spec;
  uint64_t unit = ServedUnitBytes(*plan.tensor);
  if (plan.transpose && spec.shape.size() == 2) unit *= spec.shape[1];  // a served row (of the slice, if any)
  if (unit == 0) return std::max<uint64_t>(about, 1);
  return std::max<uint64_t>(1, about / unit) * unit;
}

absl::Status MaterializeServedInPieces(const Snapshot& snapshot, const ServedTensorPlan& plan, std::span<std::byte> out,
                                       uint64_t piece_bytes, const std::function<bool()>& cancelled) {
  const uint64_t piece = ServedPieceBytes(plan, piece_bytes);
  for (uint64_t at = 0; at < out.size(); at += piece) {
    if (cancelled && cancelled()) {
      return absl::CancelledError(
          absl::StrCat("cancelled in tensor '", plan.tensor->spec.name, "' at byte ", at, " of ", out.size()));
    }
    const std::span<std::byte> to = out.subspan(at, std::min(piece, out.size() - at));
    PrefaultForWriting(to);
    WEIGHTSTORE_RETURN_IF_ERROR(MaterializeServed(snapshot, plan, at, to));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> ServedChecksum(const Snapshot& snapshot, const ServedTensorPlan& plan,
                                        const ChecksumCache& cache, const std::function<bool()>& cancelled) {
  return cache.FindOrCompute(
      plan.key,
      [&]() -> absl::StatusOr<uint32_t> {
        constexpr uint64_t kChunk = 1 << 20;  // a multiple of every element size
        auto stop = [&]() -> absl::Status {
          if (cancelled && cancelled()) {
            return absl::CancelledError(absl::StrCat(
                "the checksum of '", plan.tensor != nullptr ? plan.tensor->spec.name : plan.key, "' was cancelled"));
          }
          return absl::OkStatus();
        };
        uint32_t crc = 0;
        if (plan.is_byte_range()) {
          WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes bytes, ReadServedView(snapshot, plan));
          const absl::string_view view = bytes.view();
          for (size_t at = 0; at < view.size(); at += kChunk) {
            WEIGHTSTORE_RETURN_IF_ERROR(stop());
            crc = Crc32cExtend(crc, view.substr(at, kChunk));
          }
          return crc;
        }
        std::vector<std::byte> chunk;
        const uint64_t piece = ServedPieceBytes(plan, kChunk);  // whole rows: a transpose by tiles
        for (uint64_t at = 0; at < plan.byte_size; at += piece) {
          WEIGHTSTORE_RETURN_IF_ERROR(stop());
          chunk.resize(std::min(piece, plan.byte_size - at));
          WEIGHTSTORE_RETURN_IF_ERROR(MaterializeServed(snapshot, plan, at, chunk));
          crc = Crc32cExtend(crc, absl::string_view(reinterpret_cast<const char*>(chunk.data()), chunk.size()));
        }
        return crc;
      },
      cancelled);
}

}  // namespace weightstore
