// Portable scalar path: the reference for the SIMD paths (same operation order, same bits).
#include <cmath>
#include <cstring>

#include "adam_kernel.h"

namespace infinity_adam {
namespace {

inline uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// fp16 -> fp32 is exact.
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
        const float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;
        return float_of(sign | bits_of(mag));
    }
    return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

// fp32 -> fp16, round to nearest-even, overflow to inf, NaN stays NaN (quiet).
inline uint16_t float_to_half(float f) {
    uint32_t u = bits_of(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint32_t out;
    if (u >= 0x47800000u) {  // >= 65536 in magnitude, inf or NaN
        out = u > 0x7f800000u ? (0x7e00u | ((u >> 13) & 0x3ffu)) : 0x7c00u;
    } else if (u < 0x38800000u) {  // below 2^-14: fp16 subnormal or zero
        // Adding 0.5 puts the 10 fp16 mantissa bits at the bottom of the fp32 mantissa, and
        // the fp32 addition itself rounds them to nearest-even.
        const float aligned = float_of(u) + 0.5f;
        out = bits_of(aligned) - 0x3f000000u;
    } else {
        const uint32_t odd = (u >> 13) & 1u;
        u += 0xc8000000u + 0xfffu + odd;  // rebias exponent (15 - 127) and round half to even
        out = u >> 13;                    // a carry into the exponent gives inf: correct
    }
    return static_cast<uint16_t>(out | sign);
}

// fp32 -> bf16, round to nearest-even in integer arithmetic; NaN -> 0x7fc0 (as torch).
inline uint16_t float_to_bf16(float f) {
    const uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct V {
    using T = float;
    static constexpr size_t W = 1;
    static T set1(float x) { return x; }
    static T load(const float* p) {
        float x;
        std::memcpy(&x, p, 4);
        return x;
    }
    static void store(float* p, T x) { *p = x; }
    static T load_f16(const uint16_t* p) {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return half_to_float(h);
    }
    static T load_bf16(const uint16_t* p) {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return float_of(static_cast<uint32_t>(h) << 16);
    }
    template <bool NT>
    static void store_f16(uint16_t* p, T x) {
        *p = float_to_half(x);
    }
    template <bool NT>
    static void store_bf16(uint16_t* p, T x) {
        *p = float_to_bf16(x);
    }
    static void fence() {}
    static T add(T a, T b) { return a + b; }
    static T sub(T a, T b) { return a - b; }
    static T mul(T a, T b) { return a * b; }
    static T div(T a, T b) { return a / b; }
    static T sqrt(T a) { return std::sqrt(a); }
    static T fma(T a, T b, T c) { return std::fma(a, b, c); }
    // The 8-bit step's operations (adam8_body.inc).
    using I = int32_t;
    static I load_u8(const uint8_t* p) { return *p; }
    static void store_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
    static T gather(const float* t, I i) { return t[i]; }
    static I gather_u8(const uint8_t* t, I i) { return t[i]; }
    static bool lookup_block(const QuantMap&, const uint8_t*, float*) { return false; }
    template <bool SIGNED>
    static bool quant_block(const QuantMap&, const float*, float, uint8_t*) {
        return false;
    }
    static T abs(T x) { return std::fabs(x); }
    static T max(T a, T b) { return b > a ? b : a; }
    static float hmax(T x) { return x; }
    static I bucket(T yabs) {
        const int32_t b = static_cast<int32_t>(bits_of(yabs) >> kBucketShift) - kBucketBase;
        return b < 0 ? 0 : (b > kBucketTop - kBucketBase ? kBucketTop - kBucketBase : b);
    }
    static I signed_code(I t, T y) { return y < 0.0f ? 127 - (t < 127 ? t : 127) : 127 + t; }
};

#include "adam_body.inc"
#include "adam8_body.inc"

}  // namespace

void adam_scalar(const AdamArgs& a, size_t begin, size_t end) { adam_entry(a, begin, end); }
void adam8_scalar(const Adam8Args& a, size_t begin, size_t end) { adam8_entry(a, begin, end); }

}  // namespace infinity_adam
