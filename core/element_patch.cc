#include "core/element_patch.h"

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

// Builds a patch from runs added in position order, in one pass: the values,
// and the positions both ways (positions and runs), so the smaller can be
// chosen at the end without a second look at the tensors. Holds O(tensor)
// bytes at most: Add says once the patch can no longer be smaller than the
// tensor.
class PatchBuilder {
 public:
  PatchBuilder(uint32_t element_size, uint64_t elements)
      : e_(element_size), elements_(elements), limit_(elements * element_size) {}

  // Adds elements [start, start + length), after all added so far, whose new
  // values are at `values`. False once the patch cannot be smaller than the
  // tensor (the caller may stop).
  bool Add(uint64_t start, uint64_t length, const std::byte* values) {
    if (length_ > 0 && start_ + length_ == start) {
      length_ += length;
    } else {
      Flush();
      start_ = start;
      length_ = length;
    }
    values_.insert(values_.end(), values, values + length * e_);
    changed_ += length;
    // At least a byte a position, or two a run, besides the values.
    return values_.size() + std::min(positions_.size() + length_, runs_.size() + 2) < limit_;
  }

  // The patch, in the smaller encoding; nullopt if not smaller than the tensor.
  std::optional<ElementPatch> Finish() && {
    Flush();
    const uint64_t as_runs = VarintSize(runs_count_) + runs_.size() + values_.size();
    const uint64_t as_positions = VarintSize(changed_) + positions_.size() + values_.size();
    if (std::min(as_runs, as_positions) >= limit_) return std::nullopt;
    ElementPatch patch;
    patch.encoding = as_runs < as_positions ? PatchEncoding::kRuns : PatchEncoding::kPositions;
    patch.element_size = e_;
    patch.elements = elements_;
    patch.changed = changed_;
    const bool runs = patch.encoding == PatchEncoding::kRuns;
    const std::vector<std::byte>& index = runs ? runs_ : positions_;
    std::vector<std::byte> body(std::min(as_runs, as_positions));
    std::byte* p = PutVarint(body.data(), runs ? runs_count_ : changed_);
    if (!index.empty()) p = static_cast<std::byte*>(std::memcpy(p, index.data(), index.size())) + index.size();
    if (!values_.empty()) std::memcpy(p, values_.data(), values_.size());
    patch.body = SharedBytes::FromVector(std::move(body));
    return patch;
  }

 private:
  // Writes the pending run's position both ways.
  void Flush() {
    if (length_ == 0) return;
    const uint64_t skip = start_ - end_;  // the first run's start, or the gap
    Put(runs_, skip);
    Put(runs_, length_ - 1);
    Put(positions_, skip);
    positions_.insert(positions_.end(), length_ - 1, std::byte{0});  // a gap of 0 is one byte
    end_ = start_ + length_;
    ++runs_count_;
    length_ = 0;
  }
  static void Put(std::vector<std::byte>& out, uint64_t v) {
    std::byte bytes[10];
    out.insert(out.end(), bytes, PutVarint(bytes, v));
  }

  uint32_t e_;
  uint64_t elements_, limit_;
  uint64_t start_ = 0, length_ = 0;  // the pending run
  uint64_t end_ = 0;                 // where the last flushed run ended
  uint64_t changed_ = 0, runs_count_ = 0;
  std::vector<std::byte> values_, positions_, runs_;
};

// Reads the entries of a checked patch one at a time (an entry: one position,
// or one run), with its values.
class EntryReader {
 public:
  EntryReader(const ElementPatch& patch, size_t values_at)
      : p_(patch.body.data()),
        end_(patch.body.data() + values_at),
        values_(patch.body.data() + values_at),
        runs_(patch.encoding == PatchEncoding::kRuns),
        e_(patch.element_size) {
    (void)GetVarint(p_, end_, &count_);
  }
  // The next entry; false after the last.
  bool Next(Segment* s) {
    if (read_ == count_) return false;
    uint64_t skip = 0, length = 0;
    (void)GetVarint(p_, end_, &skip);
    if (runs_) (void)GetVarint(p_, end_, &length);
    ++length;
    *s = {next_ + skip, length, values_};
    values_ += length * e_;
    next_ = s->start + length;
    ++read_;
    return true;
  }

 private:
  const std::byte* p_;
  const std::byte* end_;
  const std::byte* values_;
  bool runs_;
  uint32_t e_;
  uint64_t count_ = 0, read_ = 0, next_ = 0;
};

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
  PatchBuilder builder(element_size, elements);
  const std::byte* a = before.data();
  const std::byte* b = after.data();
  auto differs = [&](uint64_t k) { return std::memcmp(a + k * element_size, b + k * element_size, element_size) != 0; };
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
        if (differs(k) && !builder.Add(k, 1, b + k * element_size)) return std::nullopt;
      }
    }
  }
  for (; i < elements; ++i) {
    if (differs(i) && !builder.Add(i, 1, b + i * element_size)) return std::nullopt;
  }
  return std::move(builder).Finish();
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

absl::Status ForEachRun(const ElementPatch& patch,
                        const std::function<void(uint64_t start, uint64_t length, const std::byte* values)>& on_run) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(const size_t values_at, ParseRuns(patch, [](uint64_t, uint64_t) {}));
  const std::byte* values = patch.body.data() + values_at;
  return ParseRuns(patch,
                   [&](uint64_t start, uint64_t length) {
                     on_run(start, length, values);
                     values += length * patch.element_size;
                   })
      .status();
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
  const uint32_t e = first.element_size;
  EntryReader older(first, first_at), newer(second, second_at);
  PatchBuilder out(e, first.elements);
  // Sweep both in position order: a newer entry is taken whole, the older
  // ones only where no newer one covers them. `piece` is what is left of the
  // current older entry; `next` the newer entry due.
  Segment piece, next;
  bool have_piece = older.Next(&piece), have_next = newer.Next(&next);
  while (have_piece || have_next) {
    if (have_next && (!have_piece || next.start <= piece.start)) {
      if (!out.Add(next.start, next.length, next.values)) return std::nullopt;
      const uint64_t next_end = next.start + next.length;
      while (have_piece && piece.start < next_end) {
        const uint64_t piece_end = piece.start + piece.length;
        if (piece_end <= next_end) {
          have_piece = older.Next(&piece);
        } else {
          piece.values += (next_end - piece.start) * e;
          piece.length = piece_end - next_end;
          piece.start = next_end;
        }
      }
      have_next = newer.Next(&next);
    } else {
      const uint64_t piece_end = piece.start + piece.length;
      const uint64_t cut = have_next ? std::min(piece_end, next.start) : piece_end;
      if (!out.Add(piece.start, cut - piece.start, piece.values)) return std::nullopt;
      if (cut == piece_end) {
        have_piece = older.Next(&piece);
      } else {
        piece.values += (cut - piece.start) * e;
        piece.length = piece_end - cut;
        piece.start = cut;
      }
    }
  }
  return std::move(out).Finish();
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
