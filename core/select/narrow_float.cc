#include "core/select/narrow_float.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/select/dtype_cast.h"

namespace weightstore {
namespace {

// A narrow format: its exponent and mantissa bits and exponent bias.
struct Format {
  int exponent_bits, mantissa_bits, bias;
};

Format FormatOf(DType dtype) {
  switch (dtype) {
    case DType::kF8E4M3:
      return {4, 3, 7};
    case DType::kF8E5M2:
      return {5, 2, 15};
    case DType::kF8E4M3FNUZ:
      return {4, 3, 8};
    case DType::kF8E5M2FNUZ:
      return {5, 2, 16};
    case DType::kF4:
      return {2, 1, 1};
    case DType::kF6E2M3:
      return {2, 3, 1};
    case DType::kF6E3M2:
      return {3, 2, 3};
    default:  // F8_E8M0 is decoded on its own
      return {8, 0, 127};
  }
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The code of |x| (F32 bits, finite, below the format's overflow) rounded to
// nearest even, with the exponent unbounded above: a value past the largest
// finite one gets the next code up.
uint32_t RoundMagnitude(uint32_t a, const Format& f) {
  if (a == 0) return 0;
  const int exp = static_cast<int>(a >> 23);
  const int target = exp - 127 + f.bias;  // the biased exponent in the format
  if (target >= 1) {                      // a normal of the format
    const int shift = 23 - f.mantissa_bits;
    const uint32_t mant = a & 0x7FFFFFu, kept = mant >> shift, rest = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    uint32_t code = (static_cast<uint32_t>(target) << f.mantissa_bits) | kept;
    if (rest > half || (rest == half && (kept & 1))) ++code;  // a carry moves into the exponent
    return code;
  }
  // A subnormal of the format: |x| in units of its smallest step,
  // 2^(1 - bias - mantissa_bits), rounded to nearest even.
  const uint32_t significand = exp == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
  const int scale = (exp == 0 ? 1 : exp) - 127 - 23;         // |x| = significand * 2^scale
  const int shift = (1 - f.bias - f.mantissa_bits) - scale;  // >= 1 here
  if (shift >= 32) return 0;                                 // below half the smallest step
  const uint32_t kept = significand >> shift, rest = significand & ((uint32_t{1} << shift) - 1);
  const uint32_t half = uint32_t{1} << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1))) ? 1 : 0);
}

}  // namespace

bool IsNarrowFloat(DType dtype) {
  switch (dtype) {
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kF8E4M3FNUZ:
    case DType::kF8E5M2FNUZ:
    case DType::kF8E8M0:
    case DType::kF4:
    case DType::kF6E2M3:
    case DType::kF6E3M2:
      return true;
    default:
      return false;
  }
}

bool IsF8Target(DType dtype) {
  return dtype == DType::kF8E4M3 || dtype == DType::kF8E5M2 || dtype == DType::kF8E4M3FNUZ ||
         dtype == DType::kF8E5M2FNUZ;
}

double DecodeNarrow(DType dtype, uint32_t code) {
  if (dtype == DType::kF8E8M0) return code == 0xFF ? kNaN : std::ldexp(1.0, static_cast<int>(code) - 127);
  const Format f = FormatOf(dtype);
  const uint32_t magnitude_bits = static_cast<uint32_t>(f.exponent_bits + f.mantissa_bits);
  const bool negative = (code >> magnitude_bits) & 1;
  const uint32_t exp = (code >> f.mantissa_bits) & ((1u << f.exponent_bits) - 1);
  const uint32_t mant = code & ((1u << f.mantissa_bits) - 1);
  switch (dtype) {
    case DType::kF8E4M3:
      if (exp == 15 && mant == 7) return negative ? -kNaN : kNaN;
      break;
    case DType::kF8E5M2:
      if (exp == 31) {
        if (mant != 0) return negative ? -kNaN : kNaN;
        return negative ? -HUGE_VAL : HUGE_VAL;
      }
      break;
    case DType::kF8E4M3FNUZ:
    case DType::kF8E5M2FNUZ:
      if (code == 0x80) return kNaN;
      break;
    default:  // F4, F6: every code is a number
      break;
  }
  const double v = exp == 0 ? std::ldexp(static_cast<double>(mant), 1 - f.bias - f.mantissa_bits)
                            : std::ldexp(static_cast<double>(mant | (1u << f.mantissa_bits)),
                                         static_cast<int>(exp) - f.bias - f.mantissa_bits);
  return negative ? -v : v;
}

uint8_t EncodeF8(DType dtype, uint32_t f32) {
  const uint32_t sign = f32 & 0x80000000u, a = f32 ^ sign;
  const uint8_t sign_bit = static_cast<uint8_t>(sign >> 24);
  const Format f = FormatOf(dtype);
  switch (dtype) {
    case DType::kF8E4M3: {
      if (a > 0x7F800000u) return 0x7F | sign_bit;  // NaN
      // Saturated: past 448 (infinities too) is 448, the largest finite.
      const uint32_t code = a >= 0x43F00000u ? 0x7Eu : std::min<uint32_t>(RoundMagnitude(a, f), 0x7Eu);
      return static_cast<uint8_t>(code) | sign_bit;
    }
    case DType::kF8E5M2:
      if (a > 0x7F800000u) return 0x7F | sign_bit;   // NaN
      if (a >= 0x47800000u) return 0x7C | sign_bit;  // >= 65536 and infinities: infinity
      return static_cast<uint8_t>(RoundMagnitude(a, f)) | sign_bit;
    case DType::kF8E4M3FNUZ:
    case DType::kF8E5M2FNUZ: {
      // Past the largest exponent (2^8 and 2^16), infinities and NaN: NaN.
      const uint32_t overflow = dtype == DType::kF8E4M3FNUZ ? 0x43800000u : 0x47800000u;
      if (a >= overflow) return 0x80;
      const uint32_t code = RoundMagnitude(a, f);
      if (code >= 0x80) return 0x80;  // rounded up past the largest finite value
      if (code == 0) return 0;        // no negative zero
      return static_cast<uint8_t>(code) | sign_bit;
    }
    default:
      return 0;
  }
}

namespace {

// Decoded values of every code of a narrow type, as F32, F16 and BF16 bits;
// for F4 also of every byte (two codes, the low nibble first), so that a byte
// is one lookup and one store.
struct Table {
  std::array<uint32_t, 256> f32{};
  std::array<uint16_t, 256> f16{}, bf16{};
  std::array<uint64_t, 256> pair_f32{};
  std::array<uint32_t, 256> pair_f16{}, pair_bf16{};
};

Table MakeTable(DType dtype) {
  Table t;
  const uint32_t codes = 1u << DTypeBits(dtype);
  for (uint32_t c = 0; c < codes; ++c) {
    const double v = DecodeNarrow(dtype, c);
    const float f = static_cast<float>(v);  // exact: every narrow value is an F32
    std::memcpy(&t.f32[c], &f, 4);
    std::byte half[2], brain[2];
    CastElements(DType::kF32, reinterpret_cast<const std::byte*>(&f), DType::kF16, half, 1);
    CastElements(DType::kF32, reinterpret_cast<const std::byte*>(&f), DType::kBF16, brain, 1);
    std::memcpy(&t.f16[c], half, 2);
    std::memcpy(&t.bf16[c], brain, 2);
  }
  if (codes == 16) {
    for (uint32_t b = 0; b < 256; ++b) {
      t.pair_f32[b] = t.f32[b & 0xF] | (uint64_t{t.f32[b >> 4]} << 32);  // little-endian: the low code first
      t.pair_f16[b] = t.f16[b & 0xF] | (uint32_t{t.f16[b >> 4]} << 16);
      t.pair_bf16[b] = t.bf16[b & 0xF] | (uint32_t{t.bf16[b >> 4]} << 16);
    }
  }
  return t;
}

const Table& TableOf(DType dtype) {
  static const Table e4m3 = MakeTable(DType::kF8E4M3), e5m2 = MakeTable(DType::kF8E5M2),
                     e4m3fnuz = MakeTable(DType::kF8E4M3FNUZ), e5m2fnuz = MakeTable(DType::kF8E5M2FNUZ),
                     e8m0 = MakeTable(DType::kF8E8M0), f4 = MakeTable(DType::kF4), f6e2m3 = MakeTable(DType::kF6E2M3),
                     f6e3m2 = MakeTable(DType::kF6E3M2);
  switch (dtype) {
    case DType::kF8E4M3:
      return e4m3;
    case DType::kF8E5M2:
      return e5m2;
    case DType::kF8E4M3FNUZ:
      return e4m3fnuz;
    case DType::kF8E5M2FNUZ:
      return e5m2fnuz;
    case DType::kF8E8M0:
      return e8m0;
    case DType::kF4:
      return f4;
    case DType::kF6E2M3:
      return f6e2m3;
    default:
      return f6e3m2;
  }
}

// Writes the decoded `count` elements as `Out` values from `table`, or for F4
// a byte at a time from `pairs` (stores through memcpy: `dst` may be
// unaligned, a slice of a mapping).
template <typename Out, typename Pair>
void DecodeWith(DType from, const std::byte* src, const std::array<Out, 256>& table, const std::array<Pair, 256>& pairs,
                std::byte* dst, size_t count) {
  auto put = [dst](size_t i, Out v) { std::memcpy(dst + i * sizeof(Out), &v, sizeof(Out)); };
  const uint8_t* in = reinterpret_cast<const uint8_t*>(src);
  switch (DTypeBits(from)) {
    case 8: {
      size_t i = 0;
      for (; i + 4 <= count; i += 4) {  // four lookups, then the stores together
        const Out a = table[in[i]], b = table[in[i + 1]], c = table[in[i + 2]], d = table[in[i + 3]];
        put(i, a), put(i + 1, b), put(i + 2, c), put(i + 3, d);
      }
      for (; i < count; ++i) put(i, table[in[i]]);
      return;
    }
    case 4:
      for (size_t i = 0; i < count / 2; ++i) {
        const Pair p = pairs[in[i]];
        std::memcpy(dst + i * sizeof(Pair), &p, sizeof(Pair));
      }
      return;
    default:  // 6: four elements in each three bytes, low bits first
      for (size_t u = 0; u < count / 4; ++u) {
        const uint32_t w = in[3 * u] | (uint32_t{in[3 * u + 1]} << 8) | (uint32_t{in[3 * u + 2]} << 16);
        put(4 * u, table[w & 0x3F]);
        put(4 * u + 1, table[(w >> 6) & 0x3F]);
        put(4 * u + 2, table[(w >> 12) & 0x3F]);
        put(4 * u + 3, table[(w >> 18) & 0x3F]);
      }
      return;
  }
}

}  // namespace

bool DecodeNarrowRun(DType from, const std::byte* src, DType to, std::byte* dst, size_t count) {
  if (!IsNarrowFloat(from)) return false;
  const Table& table = TableOf(from);
  switch (to) {
    case DType::kF32:
      DecodeWith(from, src, table.f32, table.pair_f32, dst, count);
      return true;
    case DType::kF16:
      DecodeWith(from, src, table.f16, table.pair_f16, dst, count);
      return true;
    case DType::kBF16:
      DecodeWith(from, src, table.bf16, table.pair_bf16, dst, count);
      return true;
    default:
      return false;
  }
}

bool EncodeF8Run(DType from, const std::byte* src, DType to, std::byte* dst, size_t count) {
  if (!IsF8Target(to)) return false;
  uint8_t* out = reinterpret_cast<uint8_t*>(dst);
  switch (from) {
    case DType::kF32:
      for (size_t i = 0; i < count; ++i) {
        uint32_t bits;
        std::memcpy(&bits, src + 4 * i, 4);
        out[i] = EncodeF8(to, bits);
      }
      return true;
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        out[i] = EncodeF8(to, uint32_t{bits} << 16);
      }
      return true;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        std::byte f[4];
        CastElements(DType::kF16, src + 2 * i, DType::kF32, f, 1);
        uint32_t bits;
        std::memcpy(&bits, f, 4);
        out[i] = EncodeF8(to, bits);
      }
      return true;
    default:
      return false;
  }
}

}  // namespace weightstore
