#include "core/select/dtype_cast.h"

#include <algorithm>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/select/narrow_float.h"

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
      return IsNarrowFloat(dtype) ? DecodeNarrow(dtype, NarrowCode(dtype, p, i)) : 0;
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
      if (IsF8Target(dtype)) {  // through F32, as torch converts
        const float f = static_cast<float>(v);
        p[i] = static_cast<std::byte>(EncodeF8(dtype, std::bit_cast<uint32_t>(f)));
      }
      return;
  }
}

bool IsSigned(DType d) { return d == DType::kI8 || d == DType::kI16 || d == DType::kI32 || d == DType::kI64; }
bool IsUnsigned(DType d) { return d == DType::kU8 || d == DType::kU16 || d == DType::kU32 || d == DType::kU64; }
bool IsCastFloat(DType d) { return d == DType::kF64 || d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }
// Sources a float cast reads: the four above and the narrow types.
bool IsFloatSource(DType d) { return IsCastFloat(d) || IsNarrowFloat(d); }

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
  if (IsFloatSource(from)) {
    StoreFloat(to, dst, j, LoadFloat(from, src, i));
  } else if (IsSigned(from)) {
    StoreInteger(to, dst, j, static_cast<uint64_t>(LoadSigned(from, src, i)));
  } else {  // unsigned or bool
    StoreInteger(to, dst, j,
                 from == DType::kBool ? static_cast<uint64_t>(src[i] != std::byte{0}) : LoadUnsigned(from, src, i));
  }
}

// Exact bit-level conversions for the common float pairs: the same results as
// CastOne (round to nearest even, NaN made the canonical quiet NaN with its sign,
// overflow to infinity), at many times its speed (core_bench prints both).
// dtype_cast_test.cc checks them against CastOne.

uint16_t F32ToF16(uint32_t x) {
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t out;
  if (x >= 0x47800000u) {  // |x| >= 65536 (or Inf, NaN): past F16's range
    out = x > 0x7F800000u ? 0x7E00u : 0x7C00u;
  } else if (x < 0x38800000u) {  // |x| < 2^-14: an F16 subnormal or zero
    // In units of 2^-24 (F16's smallest subnormal), rounded to nearest even in
    // integers: no dependence on the FPU's rounding mode or flush-to-zero.
    const uint32_t exp = x >> 23;
    if (exp < 102) {  // below 2^-25 (F32 subnormals included): rounds to zero
      out = 0;
    } else {
      const uint32_t significand = (x & 0x7FFFFFu) | 0x800000u;  // value = significand x 2^(exp - 150)
      const uint32_t shift = 126 - exp;                          // 14..24
      uint32_t kept = significand >> shift;
      const uint32_t rest = significand & ((1u << shift) - 1), half = 1u << (shift - 1);
      if (rest > half || (rest == half && (kept & 1))) ++kept;
      out = kept;  // may carry into 0x400, the smallest normal: the right encoding
    }
  } else {
    const uint32_t odd = (x >> 13) & 1;
    x += 0xC8000FFFu + odd;  // rebias the exponent (-112 << 23), round half to even
    out = x >> 13;
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

uint16_t F32ToBF16(uint32_t x) {
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>(((x >> 16) & 0x8000u) | 0x7FC0u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);  // to nearest even; overflow is Inf
}

uint32_t F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1F) return sign | (mant != 0 ? 0x7FC00000u : 0x7F800000u);
  if (exp == 0) {  // zero or subnormal: mant x 2^-24, a normal float (exact, in integers)
    if (mant == 0) return sign;
    const int lead = std::bit_width(mant) - 1;  // mant = 2^lead + rest, lead in 0..9
    return sign | (static_cast<uint32_t>(lead + 103) << 23) | ((mant << (23 - lead)) & 0x7FFFFFu);
  }
  return sign | ((exp + 112) << 23) | (mant << 13);
}

uint32_t BF16ToF32(uint16_t b) {
  if ((b & 0x7FFFu) > 0x7F80u) return (static_cast<uint32_t>(b & 0x8000u) << 16) | 0x7FC00000u;
  return static_cast<uint32_t>(b) << 16;
}

template <typename From, typename To, To (*kConvert)(From)>
void CastOneFast(const std::byte* src, std::byte* dst) {
  From in;
  std::memcpy(&in, src, sizeof(From));
  const To out = kConvert(in);
  std::memcpy(dst, &out, sizeof(To));
}

using ElementCast = void (*)(const std::byte* src, std::byte* dst);

// The exact fast converter of one element for (from, to), or nullptr.
ElementCast FastCast(DType from, DType to) {
  if (from == DType::kF32 && to == DType::kF16) return CastOneFast<uint32_t, uint16_t, F32ToF16>;
  if (from == DType::kF32 && to == DType::kBF16) return CastOneFast<uint32_t, uint16_t, F32ToBF16>;
  if (from == DType::kF16 && to == DType::kF32) return CastOneFast<uint16_t, uint32_t, F16ToF32>;
  if (from == DType::kBF16 && to == DType::kF32) return CastOneFast<uint16_t, uint32_t, BF16ToF32>;
  return nullptr;
}

// Contiguous runs of a fast pair, as one loop the compiler can vectorize.
template <typename From, typename To, To (*kConvert)(From)>
void CastRun(const std::byte* src, std::byte* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) CastOneFast<From, To, kConvert>(src + i * sizeof(From), dst + i * sizeof(To));
}

#if defined(__x86_64__)
// F32 -> F16 eight at a time with the F16C instruction (rounding to nearest
// even, subnormals kept), where the CPU has it. Lanes holding NaN are redone by
// F32ToF16, which gives the canonical quiet NaN the reference gives (the
// instruction keeps part of the payload).
__attribute__((target("avx,f16c"))) void F32ToF16Run(const std::byte* src, std::byte* dst, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 4 * i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      CastRun<uint32_t, uint16_t, F32ToF16>(src + 4 * i, dst + 2 * i, 8);
    }
  }
  CastRun<uint32_t, uint16_t, F32ToF16>(src + 4 * i, dst + 2 * i, count - i);
}

bool HaveF16C() {
  // __builtin_cpu_supports("avx") also checks that the OS saves AVX state;
  // clang 14 does not know "f16c" there, so its CPUID bit is read directly.
  static const bool have = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  }();
  return have;
}
#endif

bool CastRunFast(DType from, DType to, const std::byte* src, std::byte* dst, size_t count) {
  if (from == DType::kF32 && to == DType::kF16) {
#if defined(__x86_64__)
    if (HaveF16C()) {
      F32ToF16Run(src, dst, count);
      return true;
    }
#endif
    CastRun<uint32_t, uint16_t, F32ToF16>(src, dst, count);
  } else if (from == DType::kF32 && to == DType::kBF16) {
    CastRun<uint32_t, uint16_t, F32ToBF16>(src, dst, count);
  } else if (from == DType::kF16 && to == DType::kF32) {
    CastRun<uint16_t, uint32_t, F16ToF32>(src, dst, count);
  } else if (from == DType::kBF16 && to == DType::kF32) {
    CastRun<uint16_t, uint32_t, BF16ToF32>(src, dst, count);
  } else {
    return false;
  }
  return true;
}

}  // namespace

bool IsCastTarget(DType dtype) { return IsCastFloat(dtype) || IsF8Target(dtype); }

absl::Status CheckCast(DType from, DType to) {
  if (from == to) return absl::OkStatus();
  if (IsFloatSource(from) && IsCastFloat(to)) return absl::OkStatus();  // decoded exactly, then rounded once
  if (IsFloatSource(from) && IsF8Target(to) && !IsSubByte(from)) return absl::OkStatus();  // as torch's .to()
  if (IsNarrowFloat(to) && IsFloatSource(from)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot cast ", DTypeName(from), " to ", DTypeName(to),
        ": weightstore casts into F8_E4M3, F8_E5M2, F8_E4M3FNUZ and F8_E5M2FNUZ only (as torch's .to()); F4, F6 "
        "and F8_E8M0 values come from a quantizer, with their scales"));
  }
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
    std::memcpy(dst, src, count / DTypeUnitElements(from) * DTypeSize(from));
    return;
  }
  if (DecodeNarrowRun(from, src, to, dst, count) || EncodeF8Run(from, src, to, dst, count)) return;
  if (from == DType::kF32 && to == DType::kF64) {  // common, exact: keep it tight
    for (size_t i = 0; i < count; ++i) {
      float f;
      std::memcpy(&f, src + 4 * i, 4);
      double d = f;
      std::memcpy(dst + 8 * i, &d, 8);
    }
    return;
  }
  if (CastRunFast(from, to, src, dst, count)) return;
  for (size_t i = 0; i < count; ++i) CastOne(from, src, i, to, dst, i);
}

void CastElementsReference(DType from, const std::byte* src, DType to, std::byte* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) CastOne(from, src, i, to, dst, i);
}

void CastStrided(DType from, const std::byte* src, uint64_t stride, DType to, std::byte* dst, size_t count) {
  if (stride == 1) return CastElements(from, src, to, dst, count);
  const size_t fs = DTypeSize(from), ts = DTypeSize(to);
  if (from == to) {
    for (size_t i = 0; i < count; ++i) std::memcpy(dst + i * ts, src + i * stride * fs, fs);
    return;
  }
  if (ElementCast fast = FastCast(from, to)) {
    for (size_t i = 0; i < count; ++i) fast(src + i * stride * fs, dst + i * ts);
    return;
  }
  for (size_t i = 0; i < count; ++i) CastOne(from, src, i * stride, to, dst, i);
}

void TransposeCast(DType from, const std::byte* src, DType to, std::byte* dst, size_t rows, size_t cols) {
  TransposeCastRows(from, src, to, dst, rows, cols, 0, cols);
}

namespace {

// Transposes an n x m block of kSize-byte elements: dst[c * dst_stride + r] =
// src[r * src_stride + c] (strides in elements). Blocks of 8 x 8 (2-byte) or
// 4 x 4 (4-byte) elements are transposed in SSE registers; the edges, and
// other sizes, an element at a time.
template <size_t kSize>
void TransposeBlock(const std::byte* src, size_t src_stride, std::byte* dst, size_t dst_stride, size_t n, size_t m) {
  const size_t in_row = src_stride * kSize, out_row = dst_stride * kSize;
  size_t r = 0, c = 0;
#if defined(__x86_64__)
  if constexpr (kSize == 2) {
    for (; r + 8 <= n; r += 8) {
      for (c = 0; c + 8 <= m; c += 8) {
        const std::byte* in = src + r * in_row + c * 2;
        __m128i a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * in_row));
        // Pairs of rows interleaved by 16, 32, then 64 bits: row i of the
        // result is column i of the block.
        __m128i b[8], d[8];
        for (int i = 0; i < 4; ++i) {
          b[i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
          b[i + 4] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
        }
        // d[0..3]: rows 0-3 of columns (0, 1), (2, 3), (4, 5), (6, 7);
        // d[4..7]: rows 4-7 of the same.
        for (int i = 0; i < 2; ++i) {
          d[2 * i] = _mm_unpacklo_epi32(b[4 * i], b[4 * i + 1]);
          d[2 * i + 1] = _mm_unpackhi_epi32(b[4 * i], b[4 * i + 1]);
          d[2 * i + 4] = _mm_unpacklo_epi32(b[4 * i + 2], b[4 * i + 3]);
          d[2 * i + 5] = _mm_unpackhi_epi32(b[4 * i + 2], b[4 * i + 3]);
        }
        std::byte* out = dst + c * out_row + r * 2;
        for (int i = 0; i < 4; ++i) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * i) * out_row), _mm_unpacklo_epi64(d[i], d[i + 4]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * i + 1) * out_row), _mm_unpackhi_epi64(d[i], d[i + 4]));
        }
      }
      for (size_t cc = c; cc < m; ++cc) {  // the columns past the last 8
        for (size_t rr = r; rr < r + 8; ++rr) std::memcpy(dst + cc * out_row + rr * 2, src + rr * in_row + cc * 2, 2);
      }
    }
  } else if constexpr (kSize == 4) {
    for (; r + 4 <= n; r += 4) {
      for (c = 0; c + 4 <= m; c += 4) {
        const std::byte* in = src + r * in_row + c * 4;
        // Shuffles move bits unchanged: NaN payloads survive.
        __m128 a0 = _mm_loadu_ps(reinterpret_cast<const float*>(in));
        __m128 a1 = _mm_loadu_ps(reinterpret_cast<const float*>(in + in_row));
        __m128 a2 = _mm_loadu_ps(reinterpret_cast<const float*>(in + 2 * in_row));
        __m128 a3 = _mm_loadu_ps(reinterpret_cast<const float*>(in + 3 * in_row));
        _MM_TRANSPOSE4_PS(a0, a1, a2, a3);
        std::byte* out = dst + c * out_row + r * 4;
        _mm_storeu_ps(reinterpret_cast<float*>(out), a0);
        _mm_storeu_ps(reinterpret_cast<float*>(out + out_row), a1);
        _mm_storeu_ps(reinterpret_cast<float*>(out + 2 * out_row), a2);
        _mm_storeu_ps(reinterpret_cast<float*>(out + 3 * out_row), a3);
      }
      for (size_t cc = c; cc < m; ++cc) {
        for (size_t rr = r; rr < r + 4; ++rr) std::memcpy(dst + cc * out_row + rr * 4, src + rr * in_row + cc * 4, 4);
      }
    }
  }
#endif
  for (; r < n; ++r) {  // the rows past the last whole block
    for (c = 0; c < m; ++c) std::memcpy(dst + c * out_row + r * kSize, src + r * in_row + c * kSize, kSize);
  }
}

using BlockKernel = void (*)(const std::byte*, size_t, std::byte*, size_t, size_t, size_t);

BlockKernel BlockKernelFor(size_t size) {
  switch (size) {
    case 1:
      return TransposeBlock<1>;
    case 2:
      return TransposeBlock<2>;
    case 4:
      return TransposeBlock<4>;
    case 8:
      return TransposeBlock<8>;
    default:
      return nullptr;
  }
}

}  // namespace

void TransposeCastRows(DType from, const std::byte* src, DType to, std::byte* dst, size_t rows, size_t cols,
                       size_t first, size_t end, size_t row_stride) {
  if (row_stride != 0) cols = row_stride;  // below, `cols` is only the distance between source rows
  const size_t fs = DTypeSize(from), ts = DTypeSize(to);
  const BlockKernel block = BlockKernelFor(fs);
  if (block == nullptr) {  // no such dtype today; kept correct all the same
    for (size_t c = first; c < end; ++c) {
      for (size_t r = 0; r < rows; ++r) CastOne(from, src, r * cols + c, to, dst, (c - first) * rows + r);
    }
    return;
  }
  // Tiles of 128 source rows by 2 KiB of each: fastest of the sizes tried on
  // a [11008, 4096] BF16 and F32 matrix (core_bench --cast-only), where the
  // source rows are a power of two apart and smaller tiles ran into cache
  // set conflicts.
  const size_t tile_rows = 128, tile_cols = 2048 / fs;
  // A cast transposes 64 x 64 elements at a time into `staged`, then casts
  // each of its rows as one run (CastElements' fast paths).
  constexpr size_t kStaged = 64;
  std::byte staged[kStaged * kStaged * 8];
  for (size_t r0 = 0; r0 < rows; r0 += tile_rows) {
    const size_t r1 = std::min(rows, r0 + tile_rows);
    for (size_t c0 = first; c0 < end; c0 += tile_cols) {
      const size_t c1 = std::min(end, c0 + tile_cols);
      if (from == to) {
        block(src + (r0 * cols + c0) * fs, cols, dst + ((c0 - first) * rows + r0) * ts, rows, r1 - r0, c1 - c0);
        continue;
      }
      for (size_t r = r0; r < r1; r += kStaged) {
        const size_t n = std::min(kStaged, r1 - r);
        for (size_t c = c0; c < c1; c += kStaged) {
          const size_t m = std::min(kStaged, c1 - c);
          block(src + (r * cols + c) * fs, cols, staged, n, n, m);
          for (size_t i = 0; i < m; ++i) {
            CastElements(from, staged + i * n * fs, to, dst + ((c + i - first) * rows + r) * ts, n);
          }
        }
      }
    }
  }
}

}  // namespace weightstore
