#include "core/select/dtype_cast.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace weightstore {

uint32_t EncodeFloat(double value, int exponent_bits, int mantissa_bits) {
  const int E = exponent_bits, M = mantissa_bits;
  const uint64_t bits = std::bit_cast<uint64_t>(value);
  const uint32_t sign = static_cast<uint32_t>(bits >> 63) << (E + M);
  const int exp = static_cast<int>((bits >> 52) & 0x7FF);
  const uint64_t mant = bits & ((uint64_t{1} << 52) - 1);
  const uint32_t exp_all_ones = ((uint32_t{1} << E) - 1) << M;
  if (exp == 0x7FF) {  // Inf or NaN (quiet NaN, sign kept)
    return sign | exp_all_ones | (mant != 0 ? uint32_t{1} << (M - 1) : 0);
  }
  if (exp == 0) return sign;  // zero, or a double subnormal: below every target's range
  const int bias = (1 << (E - 1)) - 1;
  int target_exp = exp - 1023 + bias;
  const uint64_t significand = mant | (uint64_t{1} << 52);  // 53 bits, implicit 1
  int shift = 52 - M;                                       // bits dropped for a normal result
  if (target_exp < 1) {                                     // subnormal in the target
    shift += 1 - target_exp;
    target_exp = 0;
  }
  if (shift > 54) return sign;  // under half the smallest subnormal: rounds to zero
  uint64_t kept = significand >> shift;
  const uint64_t rest = significand & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  if (rest > half || (rest == half && (kept & 1))) ++kept;
  if (target_exp == 0) return sign | static_cast<uint32_t>(kept);  // may carry into the smallest normal
  if (kept >> (M + 1)) {                                           // rounding carried out of the significand
    kept >>= 1;
    ++target_exp;
  }
  if (target_exp >= (1 << E) - 1) return sign | exp_all_ones;  // overflow to infinity
  return sign | (static_cast<uint32_t>(target_exp) << M) | (static_cast<uint32_t>(kept) & ((uint32_t{1} << M) - 1));
}

double DecodeFloat(uint32_t bits, int exponent_bits, int mantissa_bits) {
  const int E = exponent_bits, M = mantissa_bits;
  const bool negative = (bits >> (E + M)) & 1;
  const uint32_t exp = (bits >> M) & ((1u << E) - 1);
  const uint32_t mant = bits & ((1u << M) - 1);
  const int bias = (1 << (E - 1)) - 1;
  double v;
  if (exp == (1u << E) - 1) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - bias - M);
  } else {
    v = std::ldexp(static_cast<double>(mant | (1u << M)), static_cast<int>(exp) - bias - M);
  }
  return negative ? -v : v;
}

namespace {

// Reads element i of `dtype` as double (floats) or int64/uint64 (integers).
double LoadFloat(DType dtype, const std::byte* p, size_t i) {
  switch (dtype) {
    case DType::kF64: {
      double v;
      std::memcpy(&v, p + 8 * i, 8);
      return v;
    }
    case DType::kF32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case DType::kF16:
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return dtype == DType::kF16 ? DecodeFloat(b, 5, 10) : DecodeFloat(b, 8, 7);
    }
    default:
      return 0;
  }
}

void StoreFloat(DType dtype, std::byte* p, size_t i, double v) {
  switch (dtype) {
    case DType::kF64:
      std::memcpy(p + 8 * i, &v, 8);
      return;
    case DType::kF32: {
      float f = static_cast<float>(v);  // IEEE double -> float rounds to nearest even
      std::memcpy(p + 4 * i, &f, 4);
      return;
    }
    case DType::kF16:
    case DType::kBF16: {
      uint16_t b = static_cast<uint16_t>(dtype == DType::kF16 ? EncodeFloat(v, 5, 10) : EncodeFloat(v, 8, 7));
      std::memcpy(p + 2 * i, &b, 2);
      return;
    }
    default:
      return;
  }
}

bool IsSigned(DType d) { return d == DType::kI8 || d == DType::kI16 || d == DType::kI32 || d == DType::kI64; }
bool IsUnsigned(DType d) { return d == DType::kU8 || d == DType::kU16 || d == DType::kU32 || d == DType::kU64; }
bool IsCastFloat(DType d) { return d == DType::kF64 || d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

int64_t LoadSigned(DType dtype, const std::byte* p, size_t i) {
  switch (DTypeSize(dtype)) {
    case 1:
      return static_cast<int8_t>(p[i]);
    case 2: {
      int16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      return v;
    }
    case 4: {
      int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    default: {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      return v;
    }
  }
}

uint64_t LoadUnsigned(DType dtype, const std::byte* p, size_t i) {
  switch (DTypeSize(dtype)) {
    case 1:
      return static_cast<uint8_t>(p[i]);
    case 2: {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      return v;
    }
    case 4: {
      uint32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    default: {
      uint64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      return v;
    }
  }
}

void StoreInteger(DType dtype, std::byte* p, size_t i, uint64_t v) {
  // Two's complement: the low bytes of the 64-bit value are the narrower value.
  const size_t size = DTypeSize(dtype);
  std::memcpy(p + size * i, &v, size);  // little-endian host
}

// Converts element i of src into element j of dst.
void CastOne(DType from, const std::byte* src, size_t i, DType to, std::byte* dst, size_t j) {
  if (IsCastFloat(from)) {
    StoreFloat(to, dst, j, LoadFloat(from, src, i));
  } else if (IsSigned(from)) {
    StoreInteger(to, dst, j, static_cast<uint64_t>(LoadSigned(from, src, i)));
  } else {  // unsigned or bool
    StoreInteger(to, dst, j,
                 from == DType::kBool ? static_cast<uint64_t>(src[i] != std::byte{0}) : LoadUnsigned(from, src, i));
  }
}

}  // namespace

absl::Status CheckCast(DType from, DType to) {
  if (from == to) return absl::OkStatus();
  if (IsCastFloat(from) && IsCastFloat(to)) return absl::OkStatus();
  const uint64_t fs = DTypeSize(from), ts = DTypeSize(to);
  if (IsSigned(from) && IsSigned(to) && ts > fs) return absl::OkStatus();
  if (IsUnsigned(from) && IsUnsigned(to) && ts > fs) return absl::OkStatus();
  if (IsUnsigned(from) && IsSigned(to) && ts > fs) return absl::OkStatus();
  if (from == DType::kBool && to == DType::kU8) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("cannot cast ", DTypeName(from), " to ", DTypeName(to), " without losing data"));
}

void CastElements(DType from, const std::byte* src, DType to, std::byte* dst, size_t count) {
  if (from == to) {
    std::memcpy(dst, src, count * DTypeSize(from));
    return;
  }
  if (from == DType::kF32 && to == DType::kF64) {  // common, exact: keep it tight
    for (size_t i = 0; i < count; ++i) {
      float f;
      std::memcpy(&f, src + 4 * i, 4);
      double d = f;
      std::memcpy(dst + 8 * i, &d, 8);
    }
    return;
  }
  for (size_t i = 0; i < count; ++i) CastOne(from, src, i, to, dst, i);
}

void CastStrided(DType from, const std::byte* src, uint64_t stride, DType to, std::byte* dst, size_t count) {
  if (stride == 1) return CastElements(from, src, to, dst, count);
  const size_t fs = DTypeSize(from), ts = DTypeSize(to);
  if (from == to) {
    for (size_t i = 0; i < count; ++i) std::memcpy(dst + i * ts, src + i * stride * fs, fs);
    return;
  }
  for (size_t i = 0; i < count; ++i) CastOne(from, src, i * stride, to, dst, i);
}

void TransposeCast(DType from, const std::byte* src, DType to, std::byte* dst, size_t rows, size_t cols) {
  // Tiles keep both the reads and the writes within a few cache lines.
  constexpr size_t kTile = 32;
  const size_t fs = DTypeSize(from), ts = DTypeSize(to);
  for (size_t r0 = 0; r0 < rows; r0 += kTile) {
    for (size_t c0 = 0; c0 < cols; c0 += kTile) {
      const size_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (size_t r = r0; r < r1; ++r) {
        for (size_t c = c0; c < c1; ++c) {
          if (from == to) {
            std::memcpy(dst + (c * rows + r) * ts, src + (r * cols + c) * fs, fs);
          } else {
            CastOne(from, src, r * cols + c, to, dst, c * rows + r);
          }
        }
      }
    }
  }
}

}  // namespace weightstore
