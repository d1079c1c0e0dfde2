// The format registry's table (core/format.h). A new format adds its line here,
// in detection order: a format whose `detect` takes anything goes last.
#include "core/format.h"
#include "core/formats/burn_record.h"
#include "core/formats/burnpack.h"
#include "core/formats/pytorch.h"
#include "core/formats/safetensors.h"

namespace weightstore {

std::span<const FormatSpec* const> Formats() {
  static constexpr const FormatSpec* kTable[] = {&kBurnpackFormat, &kSafeTensorsFormat, &kBurnRecordFormat,
                                                 &kPyTorchFormat};
  return kTable;
}

}  // namespace weightstore
