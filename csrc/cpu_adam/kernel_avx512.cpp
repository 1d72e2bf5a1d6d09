// AVX-512 path (16 lanes: F for the math and fp16 conversion, BW/VL for 16-bit packing).
// Compiled with target attributes; bindings.cpp calls it only when the CPU reports AVX-512.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cstring>

#include "adam_kernel.h"

#if defined(__clang__)
#pragma clang attribute push(                                      \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#else
// GCC 12 warns inside its own intrinsics headers (`__Y = __Y` placeholders): not our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif

namespace infinity_adam {
namespace {

struct V {
    using T = __m512;
    static constexpr size_t W = 16;
    static T set1(float x) { return _mm512_set1_ps(x); }
    static T load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
    static T load_f16(const uint16_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static T load_bf16(const uint16_t* p) {
        const __m512i w =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    template <bool NT>
    static void store16(uint16_t* p, __m256i x) {
        if constexpr (NT)
            _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
        else
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
    }
    static void fence() { _mm_sfence(); }
    template <bool NT>
    static void store_f16(uint16_t* p, T x) {
        store16<NT>(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    template <bool NT>
    static void store_bf16(uint16_t* p, T x) {
        // Round to nearest-even: add 0x7fff plus the lowest kept bit, keep the top 16 bits.
        const __m512i u = _mm512_castps_si512(x);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
        store16<NT>(p, _mm512_cvtepi32_epi16(r));
    }
    static T add(T a, T b) { return _mm512_add_ps(a, b); }
    static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
    static T div(T a, T b) { return _mm512_div_ps(a, b); }
    static T sqrt(T a) { return _mm512_sqrt_ps(a); }
    static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
};

#include "adam_body.inc"

}  // namespace

void adam_avx512(const AdamArgs& a, size_t begin, size_t end) { adam_entry(a, begin, end); }

}  // namespace infinity_adam

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // x86-64
