#include "core/catalog/element_patch.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/parallel_for.h"
#include "core/status_macros.h"

namespace weightstore {

namespace {

// Elements [start, start + length) take `length * element_size` bytes at
// `values`.
struct Segment {
  uint64_t start = 0, length = 0;
  const std::byte* values = nullptr;
};

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

std::byte* PutVarint(std::byte* p, uint64_t v) {
  for (; v >= 0x80; v >>= 7) *p++ = static_cast<std::byte>((v & 0x7f) | 0x80);
  *p++ = static_cast<std::byte>(v);
  return p;
}

// Reads one varint at `*p`, advancing it. False when it runs past `end` or
// past 64 bits.
bool GetVarint(const std::byte*& p, const std::byte* end, uint64_t* v) {
  uint64_t out = 0;
  for (int shift = 0; shift < 64 && p < end; shift += 7) {
    const auto byte = static_cast<uint8_t>(*p++);
    if (shift == 63 && byte > 1) return false;
    out |= uint64_t{byte & 0x7fu} << shift;
    if (byte < 0x80) {
      *v = out;
      return true;
    }
  }
  return false;
}

// Calls on_run(start, length) for each run `segments` make once adjacent ones
// are joined.
template <typename F>
void ForEachJoinedRun(const std::vector<Segment>& segments, F on_run) {
  uint64_t start = 0, length = 0;
  for (const Segment& s : segments) {
    if (length > 0 && start + length == s.start) {
      length += s.length;
      continue;
    }
    if (length > 0) on_run(start, length);
    start = s.start;
    length = s.length;
  }
  if (length > 0) on_run(start, length);
}

// The patch that writes `segments` (sorted, disjoint) into a tensor of
// `elements` elements, in the smaller encoding; nullopt if not smaller than
// the tensor.
std::optional<ElementPatch> Encode(const std::vector<Segment>& segments, uint32_t element_size, uint64_t elements) {
  uint64_t changed = 0, runs = 0, runs_bytes = 0, positions_bytes = 0, end = 0;
  ForEachJoinedRun(segments, [&](uint64_t start, uint64_t length) {
    const uint64_t skip = start - end;  // the first run's start, or the gap
    runs_bytes += VarintSize(skip) + VarintSize(length - 1);
    positions_bytes += VarintSize(skip) + (length - 1);  // a gap of 0 is one byte
    changed += length;
    end = start + length;
    ++runs;
  });
  const uint64_t values = changed * element_size;
  const uint64_t as_runs = VarintSize(runs) + runs_bytes + values;
  const uint64_t as_positions = VarintSize(changed) + positions_bytes + values;
  const uint64_t size = std::min(as_runs, as_positions);
  if (size >= elements * element_size) return std::nullopt;

  ElementPatch patch;
  patch.encoding = as_runs < as_positions ? PatchEncoding::kRuns : PatchEncoding::kPositions;
  patch.element_size = element_size;
  patch.elements = elements;
  patch.changed = changed;
  std::vector<std::byte> body(size);
  std::byte* p = body.data();
  p = PutVarint(p, patch.encoding == PatchEncoding::kRuns ? runs : changed);
  end = 0;
  ForEachJoinedRun(segments, [&](uint64_t start, uint64_t length) {
    p = PutVarint(p, start - end);
    if (patch.encoding == PatchEncoding::kRuns) {
      p = PutVarint(p, length - 1);
    } else {
      for (uint64_t i = 1; i < length; ++i) *p++ = std::byte{0};
    }
    end = start + length;
  });
  for (const Segment& s : segments) {
    std::memcpy(p, s.values, s.length * element_size);
    p += s.length * element_size;
  }
  patch.body = SharedBytes::FromVector(std::move(body));
  return patch;
}

// Parses the positions or runs of `patch`, calling on_run(start, length) for
// each run (consecutive positions joined), and checks them and the values'
// length against the tensor. Returns where the values begin in the body.
template <typename F>
absl::StatusOr<size_t> ParseRuns(const ElementPatch& patch, F on_run) {
  if (patch.element_size == 0 || patch.elements > UINT64_MAX / patch.element_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch of ", patch.elements, " elements of ", patch.element_size, " bytes describes no tensor"));
  }
  if (patch.encoding != PatchEncoding::kRuns && patch.encoding != PatchEncoding::kPositions) {
    return absl::InvalidArgumentError("patch encoding is neither positions nor runs");
  }
  const std::byte* p = patch.body.data();
  const std::byte* const end = p + patch.body.size();
  uint64_t count = 0;
  if (!GetVarint(p, end, &count)) return absl::InvalidArgumentError("patch body ends before its count");
  if (count > patch.elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch lists ", count, " entries for a tensor of ", patch.elements, " elements"));
  }
  uint64_t next = 0;  // the first position the next entry may take
  uint64_t changed = 0;
  uint64_t run_start = 0, run_length = 0;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t skip = 0, length = 1;
    if (!GetVarint(p, end, &skip) ||
        (patch.encoding == PatchEncoding::kRuns && (!GetVarint(p, end, &length) || length++ == UINT64_MAX))) {
      return absl::InvalidArgumentError(absl::StrCat("patch entry ", i, " runs past the body or past 64 bits"));
    }
    if (patch.encoding == PatchEncoding::kRuns && i > 0 && skip == 0) {
      return absl::InvalidArgumentError(absl::StrCat("patch run ", i, " starts where run ", i - 1, " ends"));
    }
    if (skip > patch.elements - next || length > patch.elements - next - skip) {
      return absl::InvalidArgumentError(
          absl::StrCat("patch entry ", i, " reaches past the tensor's ", patch.elements, " elements"));
    }
    const uint64_t start = next + skip;
    if (run_length > 0 && run_start + run_length == start) {
      run_length += length;
    } else {
      if (run_length > 0) on_run(run_start, run_length);
      run_start = start;
      run_length = length;
    }
    next = start + length;
    changed += length;
  }
  if (run_length > 0) on_run(run_start, run_length);
  if (changed != patch.changed) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch says ", patch.changed, " elements change but lists ", changed));
  }
  const size_t values_at = p - patch.body.data();
  if (static_cast<uint64_t>(end - p) != changed * patch.element_size) {
    return absl::InvalidArgumentError(absl::StrCat("patch carries ", end - p, " bytes of values for ", changed,
                                                   " elements of ", patch.element_size, " bytes"));
  }
  return values_at;
}

// The segments `patch` (checked) writes, its values in its body.
std::vector<Segment> Segments(const ElementPatch& patch, size_t values_at) {
  std::vector<Segment> out;
  const std::byte* values = patch.body.data() + values_at;
  (void)ParseRuns(patch, [&](uint64_t start, uint64_t length) {
    out.push_back({start, length, values});
    values += length * patch.element_size;
  });
  return out;
}

// Writes the values of `patch`, checked (its values at `values_at`), into
// `tensor` of its size.
void WriteChecked(const ElementPatch& patch, size_t values_at, std::span<std::byte> tensor) {
  const uint32_t e = patch.element_size;
  const std::byte* values = patch.body.data() + values_at;
  (void)ParseRuns(patch, [&](uint64_t start, uint64_t length) {
    std::memcpy(tensor.data() + start * e, values, length * e);
    values += length * e;
  });
}

}  // namespace

absl::string_view PatchEncodingName(PatchEncoding encoding) {
  return encoding == PatchEncoding::kRuns ? "runs" : "positions";
}

std::optional<PatchEncoding> ParsePatchEncoding(absl::string_view name) {
  if (name == "runs") return PatchEncoding::kRuns;
  if (name == "positions") return PatchEncoding::kPositions;
  return std::nullopt;
}

uint32_t PatchElementSize(DType dtype) { return static_cast<uint32_t>(std::max<uint64_t>(1, DTypeSize(dtype))); }

std::optional<ElementPatch> DiffElements(std::span<const std::byte> before, std::span<const std::byte> after,
                                         uint32_t element_size) {
  if (element_size == 0 || before.size() != after.size() || after.size() % element_size != 0) return std::nullopt;
  const uint64_t elements = after.size() / element_size;
  std::vector<Segment> segments;
  uint64_t changed = 0;
  // Not smaller once the values and the least their positions can take (a
  // byte per element, or two per run) reach the tensor's size.
  auto hopeless = [&] {
    return changed * element_size + std::min<uint64_t>(changed, 2 * segments.size()) >= after.size();
  };
  auto add = [&](uint64_t i) {
    if (!segments.empty() && segments.back().start + segments.back().length == i) {
      ++segments.back().length;
    } else {
      segments.push_back({i, 1, after.data() + i * element_size});
    }
    ++changed;
  };
  const std::byte* a = before.data();
  const std::byte* b = after.data();
  uint64_t i = 0;  // element
  if (element_size <= 8 && 8 % element_size == 0) {
    // 32 bytes at a time; only a block that differs is looked at by element.
    const uint64_t per_block = 32 / element_size;
    for (; (i + per_block) * element_size <= after.size(); i += per_block) {
      uint64_t x[4], y[4];
      std::memcpy(x, a + i * element_size, 32);
      std::memcpy(y, b + i * element_size, 32);
      if (((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0) continue;
      for (uint64_t k = i; k < i + per_block; ++k) {
        if (std::memcmp(a + k * element_size, b + k * element_size, element_size) != 0) add(k);
      }
      if (hopeless()) return std::nullopt;
    }
  }
  for (; i < elements; ++i) {
    if (std::memcmp(a + i * element_size, b + i * element_size, element_size) == 0) continue;
    add(i);
    if (hopeless()) return std::nullopt;
  }
  return Encode(segments, element_size, elements);
}

absl::Status CheckPatch(const ElementPatch& patch) {
  return ParseRuns(patch, [](uint64_t, uint64_t) {}).status();
}

absl::Status ApplyPatch(const ElementPatch& patch, std::span<std::byte> tensor) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(const size_t values_at, ParseRuns(patch, [](uint64_t, uint64_t) {}));
  if (tensor.size() != patch.tensor_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch is for ", patch.tensor_bytes(), " bytes, the tensor holds ", tensor.size()));
  }
  WriteChecked(patch, values_at, tensor);
  return absl::OkStatus();
}

absl::Status WritePatched(const ElementPatch& patch, std::span<const std::byte> base,
                          const std::function<absl::Status(absl::string_view)>& out) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(const size_t values_at, ParseRuns(patch, [](uint64_t, uint64_t) {}));
  if (base.size() != patch.tensor_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch is for ", patch.tensor_bytes(), " bytes, the base holds ", base.size()));
  }
  const uint32_t e = patch.element_size;
  auto bytes = [](const std::byte* p, uint64_t n) { return absl::string_view(reinterpret_cast<const char*>(p), n); };
  const std::byte* values = patch.body.data() + values_at;
  uint64_t at = 0;  // elements of `base` written so far
  absl::Status status;
  (void)ParseRuns(patch, [&](uint64_t start, uint64_t length) {
    if (!status.ok()) return;
    if (start > at) status = out(bytes(base.data() + at * e, (start - at) * e));
    if (status.ok()) status = out(bytes(values, length * e));
    values += length * e;
    at = start + length;
  });
  WEIGHTSTORE_RETURN_IF_ERROR(status);
  if (at < patch.elements) return out(bytes(base.data() + at * e, (patch.elements - at) * e));
  return absl::OkStatus();
}

absl::StatusOr<std::optional<ElementPatch>> ComposePatches(const ElementPatch& first, const ElementPatch& second) {
  if (first.element_size != second.element_size || first.elements != second.elements) {
    return absl::InvalidArgumentError(absl::StrCat("patches of ", first.elements, "x", first.element_size, " and ",
                                                   second.elements, "x", second.element_size,
                                                   " bytes are not of one tensor"));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(const size_t first_at, ParseRuns(first, [](uint64_t, uint64_t) {}));
  WEIGHTSTORE_ASSIGN_OR_RETURN(const size_t second_at, ParseRuns(second, [](uint64_t, uint64_t) {}));
  const std::vector<Segment> older = Segments(first, first_at);
  const std::vector<Segment> newer = Segments(second, second_at);
  const uint32_t e = first.element_size;
  // Sweep both in position order: a newer segment is taken whole, the older
  // ones only where no newer one covers them.
  std::vector<Segment> out;
  size_t i = 0, j = 0;
  Segment piece;  // what is left of older[i]
  bool have_piece = false;
  auto next_piece = [&] {
    have_piece = i < older.size();
    if (have_piece) piece = older[i++];
  };
  next_piece();
  while (have_piece || j < newer.size()) {
    if (j < newer.size() && (!have_piece || newer[j].start <= piece.start)) {
      const Segment& n = newer[j++];
      out.push_back(n);
      const uint64_t n_end = n.start + n.length;
      while (have_piece && piece.start < n_end) {
        const uint64_t p_end = piece.start + piece.length;
        if (p_end <= n_end) {
          next_piece();
        } else {
          piece.values += (n_end - piece.start) * e;
          piece.length = p_end - n_end;
          piece.start = n_end;
        }
      }
    } else {
      const uint64_t p_end = piece.start + piece.length;
      const uint64_t cut = j < newer.size() ? std::min(p_end, newer[j].start) : p_end;
      out.push_back({piece.start, cut - piece.start, piece.values});
      if (cut == p_end) {
        next_piece();
      } else {
        piece.values += (cut - piece.start) * e;
        piece.length = p_end - cut;
        piece.start = cut;
      }
    }
  }
  return Encode(out, e, first.elements);
}

absl::Status ApplyPatches(std::span<const PatchTarget> targets, unsigned threads) {
  auto named = [&](size_t i, const absl::Status& status) {
    return absl::InvalidArgumentError(absl::StrCat("patch of tensor '", targets[i].name, "': ", status.message()));
  };
  std::vector<size_t> values_at(targets.size());
  WEIGHTSTORE_RETURN_IF_ERROR(ParallelFor(targets.size(), threads, [&](size_t i) -> absl::Status {
    const PatchTarget& t = targets[i];
    absl::StatusOr<size_t> at = ParseRuns(*t.patch, [](uint64_t, uint64_t) {});
    if (!at.ok()) return named(i, at.status());
    if (t.tensor.size() != t.patch->tensor_bytes()) {
      return named(i, absl::InvalidArgumentError(absl::StrCat("patch is for ", t.patch->tensor_bytes(),
                                                              " bytes, the tensor holds ", t.tensor.size())));
    }
    values_at[i] = *at;
    return absl::OkStatus();
  }));
  return ParallelFor(targets.size(), threads, [&](size_t i) -> absl::Status {
    WriteChecked(*targets[i].patch, values_at[i], targets[i].tensor);
    return absl::OkStatus();
  });
}

}  // namespace weightstore
