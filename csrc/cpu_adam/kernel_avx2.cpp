// AVX2 + FMA + F16C path (8 lanes). Compiled with target attributes, so the rest of the binary
// stays baseline x86-64; bindings.cpp calls it only when the CPU reports these features.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cstring>

#include "adam_kernel.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
// GCC 12 warns inside its own intrinsics headers (`__Y = __Y` placeholders): not our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace infinity_adam {
namespace {

struct V {
    using T = __m256;
    static constexpr size_t W = 8;
    static T set1(float x) { return _mm256_set1_ps(x); }
    static T load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
    static T load_f16(const uint16_t* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static T load_bf16(const uint16_t* p) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m256i w = _mm256_cvtepu16_epi32(raw);
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    template <bool NT>
    static void store16(uint16_t* p, __m128i x) {
        if constexpr (NT)
            _mm_stream_si128(reinterpret_cast<__m128i*>(p), x);
        else
            _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
    }
    static void fence() { _mm_sfence(); }
    template <bool NT>
    static void store_f16(uint16_t* p, T x) {
        store16<NT>(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
    template <bool NT>
    static void store_bf16(uint16_t* p, T x) {
        // Round to nearest-even: add 0x7fff plus the lowest kept bit, keep the top 16 bits.
        const __m256i u = _mm256_castps_si256(x);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
        // Values are < 2^16, so unsigned saturation packs them unchanged; fix the lane order.
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
        store16<NT>(p, _mm256_castsi256_si128(packed));
    }
    static T add(T a, T b) { return _mm256_add_ps(a, b); }
    static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
    static T div(T a, T b) { return _mm256_div_ps(a, b); }
    static T sqrt(T a) { return _mm256_sqrt_ps(a); }
    static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
    // The 8-bit step's operations (adam8_body.inc).
    using I = __m256i;
    static I load_u8(const uint8_t* p) {
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    }
    static void store_u8(uint8_t* p, I x) {
        // Lanes hold 0..255: unsigned saturation packs them unchanged.
        const __m128i w =
            _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
    }
    static T gather(const float* t, I i) { return _mm256_i32gather_ps(t, i, 4); }
    static I gather_u8(const uint8_t* t, I i) {  // 4 bytes at each offset; the table is padded
        const I x = _mm256_i32gather_epi32(reinterpret_cast<const int*>(t), i, 1);
        return _mm256_and_si256(x, _mm256_set1_epi32(0xff));
    }
    static bool lookup_block(const QuantMap&, const uint8_t*, float*) { return false; }
    template <bool SIGNED>
    static bool quant_block(const QuantMap&, const float*, float, uint8_t*) {
        return false;
    }
    static T abs(T x) {
        return _mm256_castsi256_ps(
            _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)));
    }
    static T max(T a, T b) { return _mm256_max_ps(a, b); }
    static float hmax(T x) {
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        return _mm_cvtss_f32(m);
    }
    static I bucket(T yabs) {
        const I b = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(yabs), kBucketShift),
                                     _mm256_set1_epi32(kBucketBase));
        return _mm256_min_epi32(_mm256_max_epi32(b, _mm256_setzero_si256()),
                                _mm256_set1_epi32(kBucketTop - kBucketBase));
    }
    static I signed_code(I t, T y) {
        const I k = _mm256_set1_epi32(127);
        const I neg = _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_LT_OQ));
        return _mm256_blendv_epi8(_mm256_add_epi32(k, t),
                                  _mm256_sub_epi32(k, _mm256_min_epi32(t, k)), neg);
    }
};

#include "adam_body.inc"
#include "adam8_body.inc"

}  // namespace

void adam_avx2(const AdamArgs& a, size_t begin, size_t end) { adam_entry(a, begin, end); }
void adam8_avx2(const Adam8Args& a, size_t begin, size_t end) { adam8_entry(a, begin, end); }

}  // namespace infinity_adam

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // x86-64
