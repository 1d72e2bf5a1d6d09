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
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif

namespace infinity_adam {
namespace {

// The target of the code that only the "avx512vbmi" level runs (bindings.cpp checks the CPU).
#define INFINITY_VBMI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma,f16c")))

// [Note: byte-plane lookup] Dequantizing by a memory gather costs a load per lane, and on
// the CPUs measured it was most of the 8-bit step. With AVX-512 VBMI, 64 codes are looked
// up at once: the 256 fp32 map values are cut into four planes of 256 bytes (byte b of each
// value), each plane is read with two 128-entry byte permutes picked by the code's top bit,
// and the four planes are interleaved back into fp32 lanes. The codes are first permuted
// so that the in-lane interleave leaves the values in order. A pure selection: exact.
// Only called on a CPU that reports VBMI (the "avx512vbmi" level), hence its own target.
INFINITY_VBMI inline __attribute__((always_inline)) __m512i lookup_order(const uint8_t* codes) {
    const __m512i order = _mm512_set_epi64(  // lane L, quarter k <- codes 16k + 4L + j
        0x3f3e3d3c2f2e2d2c, 0x1f1e1d1c0f0e0d0c, 0x3b3a39382b2a2928, 0x1b1a19180b0a0908,
        0x3736353427262524, 0x1716151407060504, 0x3332313023222120, 0x1312111003020100);
    return _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes));
}

// The four byte planes b[] of 64 values back into 16 fp32 values per register, in order.
INFINITY_VBMI inline __attribute__((always_inline)) void interleave_planes(const __m512i* b,
                                                                         __m512* out) {
    const __m512i w0 = _mm512_unpacklo_epi8(b[0], b[1]), w1 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i w2 = _mm512_unpacklo_epi8(b[2], b[3]), w3 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w0, w2));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w0, w2));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w1, w3));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w1, w3));
}

// The map values of 64 codes through the four 256-byte planes.
INFINITY_VBMI inline __attribute__((always_inline)) void lookup_planes(const uint8_t* planes,
                                                                     const uint8_t* codes,
                                                                     __m512* out) {
    const __m512i c = lookup_order(codes);
    const __mmask64 upper = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int p = 0; p < 4; ++p) {
        const uint8_t* t = planes + 256 * p;
        const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(t), c,
                                                    _mm512_loadu_si512(t + 64));
        const __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(t + 128), c,
                                                    _mm512_loadu_si512(t + 192));
        b[p] = _mm512_mask_blend_epi8(upper, lo, hi);
    }
    interleave_planes(b, out);
}

// The signed map's half of that lookup: its codes 127 - k and 127 + k (k = 1..127) hold
// opposite values and 255 holds 1.0, so four planes of the 128 magnitudes at 127 + k
// (k = 0..127) need one 128-entry permute each instead of two and a blend; k = |c - 127|
// is 128 only for 1.0, whose two high bytes are set afterwards, and the sign bit is set for
// the codes below 127. The same bits as lookup_planes; bindings.cpp checks the symmetry.
INFINITY_VBMI inline __attribute__((always_inline)) void lookup_mirror(const uint8_t* planes,
                                                                     const uint8_t* codes,
                                                                     __m512* out) {
    const __m512i k127 = _mm512_set1_epi8(127), sign = _mm512_set1_epi8(-128);
    const __m512i c = lookup_order(codes);
    const __m512i k = _mm512_abs_epi8(_mm512_sub_epi8(c, k127));
    const __mmask64 neg = _mm512_cmplt_epu8_mask(c, k127);
    const __mmask64 one = _mm512_cmpeq_epi8_mask(c, _mm512_set1_epi8(-1));
    __m512i b[4];
    for (int p = 0; p < 4; ++p)
        b[p] = _mm512_permutex2var_epi8(_mm512_loadu_si512(planes + 128 * p), k,
                                        _mm512_loadu_si512(planes + 128 * p + 64));
    b[2] = _mm512_mask_mov_epi8(b[2], one, sign);  // 1.0f: 0x3f800000
    b[3] = _mm512_mask_mov_epi8(b[3], one, _mm512_set1_epi8(0x3f));
    b[3] = _mm512_mask_add_epi8(b[3], neg, b[3], sign);  // a magnitude's bit 7 is 0
    interleave_planes(b, out);
}

// [Note: quantizing by a search tree] The code of |y| is the code table's entry for its bucket
// (quant8.py), and that table is a staircase: 255 (unsigned) or 128 (signed) steps. A gather
// from it costs a load per lane, most of the 8-bit step on the CPUs measured. Here the
// step positions (the first bucket of each code, 0x7fff past the last) sit in eight registers
// as an implicit binary tree (node i's children are 2i and 2i + 1), and 32 buckets, as 16-bit
// lanes, walk its eight levels at once with word permutes: after them each lane's node
// number minus 256 is the count of steps at or below its bucket, the table's entry. Exact
// for every bucket (quant8.py builds the tree from the table; a test sweeps all buckets).
template <bool SIGNED>
void quant_tree(const int16_t* tree, const float* values, float inverse, uint8_t* out) {
    __m512i t[8];
    for (int r = 0; r < 8; ++r) t[r] = _mm512_loadu_si512(tree + 32 * r);
    const __m512 inv = _mm512_set1_ps(inverse);
    const __m512i base = _mm512_set1_epi32(kBucketBase), one = _mm512_set1_epi16(1);
    const __m512i top = _mm512_set1_epi16(kBucketTop - kBucketBase);
    const __m512i k127 = _mm512_set1_epi16(127), bit6 = _mm512_set1_epi16(64);
    for (size_t k = 0; k < kBlock; k += 32) {
        const __m512 y0 = _mm512_mul_ps(_mm512_loadu_ps(values + k), inv);
        const __m512 y1 = _mm512_mul_ps(_mm512_loadu_ps(values + k + 16), inv);
        const auto bucket = [&](__m512 y) {  // saturating: NaN and huge |y| take the top
            const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(_mm512_abs_ps(y)), kBucketShift);
            return _mm512_cvtsepi32_epi16(_mm512_sub_epi32(b, base));
        };
        // Below 2^-24 the bucket is negative: under every step, as bucket 0 (code 0).
        const __m512i b = _mm512_min_epi16(
            _mm512_inserti64x4(_mm512_castsi256_si512(bucket(y0)), bucket(y1), 1), top);
        __m512i node = one;
        for (int level = 0; level < 5; ++level) {  // nodes 1..31: all in t[0]
            const __mmask32 right = _mm512_cmpge_epi16_mask(b, _mm512_permutexvar_epi16(node, t[0]));
            node = _mm512_mask_add_epi16(_mm512_add_epi16(node, node), right,
                                         _mm512_add_epi16(node, node), one);
        }
        __mmask32 right = _mm512_cmpge_epi16_mask(b, _mm512_permutexvar_epi16(node, t[1]));
        node = _mm512_mask_add_epi16(_mm512_add_epi16(node, node), right,
                                     _mm512_add_epi16(node, node), one);  // nodes 64..127
        right = _mm512_cmpge_epi16_mask(b, _mm512_permutex2var_epi16(t[2], node, t[3]));
        node = _mm512_mask_add_epi16(_mm512_add_epi16(node, node), right,
                                     _mm512_add_epi16(node, node), one);  // nodes 128..255
        const __mmask32 upper = _mm512_test_epi16_mask(node, bit6);
        const __m512i step = _mm512_mask_blend_epi16(
            upper, _mm512_permutex2var_epi16(t[4], node, t[5]),
            _mm512_permutex2var_epi16(t[6], node, t[7]));
        right = _mm512_cmpge_epi16_mask(b, step);
        node = _mm512_mask_add_epi16(_mm512_add_epi16(node, node), right,
                                     _mm512_add_epi16(node, node), one);  // 256 + count
        __m512i code = _mm512_and_si512(node, _mm512_set1_epi16(0xff));
        if constexpr (SIGNED) {
            const __mmask32 neg = _mm512_kunpackw(
                _mm512_cmp_ps_mask(y1, _mm512_setzero_ps(), _CMP_LT_OQ),
                _mm512_cmp_ps_mask(y0, _mm512_setzero_ps(), _CMP_LT_OQ));
            code = _mm512_mask_blend_epi16(neg, _mm512_add_epi16(k127, code),
                                           _mm512_sub_epi16(k127, _mm512_min_epi16(code, k127)));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtepi16_epi8(code));
    }
}

// [Note: quantizing by a coarse index] With VBMI, 64 values find their codes with a few byte
// permutes instead of the tree's eight levels. h, the fp16 bits of y * 2^10 rounded toward
// zero, is the bucket of |y| plus 1024 (from 2^-24 up; lower is bucket 0, higher the top
// bucket) beside y's sign: the bucket in one conversion. h's bits 9..14 name a region, whose
// word holds a shift (16 where the region has one code, else at most 8) and an offset:
// key = (h >> shift) + offset, in 7 bits, cuts the region into power-of-two intervals, at
// most 128 keys in all (h's sign lands on bit 7 of the key or above, or is shifted out). A
// key gives its interval's first code and the positions (h's low byte, minus one) of the
// at most 2 (signed) or 5 (unsigned) steps inside it: the code is the first code plus the
// steps the low byte passes. quant8.py builds the index from the code table and checks it
// on every h; the sweep test compares the kernel. y * 2^10 is exact unless the scaled
// reciprocal overflows: such a block takes the tree. y < 0 is h <= -1024 as int16: a
// negative NaN is above, and a -0 or tiny negative y below -1024 has code 0 either way.
constexpr float kMaxIndexInverse = 3.0e35f;  // * 1024 stays finite

template <bool SIGNED>
INFINITY_VBMI void quant_index(const uint8_t* index, const float* values, float inverse,
                               uint8_t* out) {
    constexpr int kSteps = SIGNED ? 2 : 5;
    const auto table = [index](int at) { return _mm512_loadu_si512(index + at); };
    const __m512i word_lo = table(0), word_hi = table(64), first_lo = table(128);
    const __m512i first_hi = table(192);
    __m512i step_lo[kSteps], step_hi[kSteps];
    for (int j = 0; j < kSteps; ++j) {
        step_lo[j] = table(256 + 128 * j);
        step_hi[j] = table(320 + 128 * j);
    }
    alignas(64) uint8_t even[64];  // byte 2i of the pair (w0, w1): value i's low byte
    for (int i = 0; i < 64; ++i) even[i] = static_cast<uint8_t>(2 * i);
    const __m512i evens = _mm512_load_si512(even), below = _mm512_set1_epi16(-1023);
    const __m512i one = _mm512_set1_epi8(1), k127 = _mm512_set1_epi8(127);
    const __m512 inv = _mm512_set1_ps(inverse * 1024.0f);
    const auto key_of = [&](__m512i h) {
        const __m512i word = _mm512_permutex2var_epi16(word_lo, _mm512_srli_epi16(h, 9), word_hi);
        return _mm512_add_epi16(_mm512_srlv_epi16(h, _mm512_srli_epi16(word, 8)), word);
    };
    for (size_t k = 0; k < kBlock; k += 64) {
        __m256i h[4];
        for (int j = 0; j < 4; ++j)
            h[j] = _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(values + k + 16 * j), inv),
                                   _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m512i w0 = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
        const __m512i w1 = _mm512_inserti64x4(_mm512_castsi256_si512(h[2]), h[3], 1);
        const __m512i key = _mm512_permutex2var_epi8(key_of(w0), evens, key_of(w1));
        const __m512i low = _mm512_permutex2var_epi8(w0, evens, w1);
        __m512i code = _mm512_permutex2var_epi8(first_lo, key, first_hi);
        for (int j = 0; j < kSteps; ++j) {
            const __m512i at = _mm512_permutex2var_epi8(step_lo[j], key, step_hi[j]);
            code = _mm512_mask_add_epi8(code, _mm512_cmpgt_epu8_mask(low, at), code, one);
        }
        if constexpr (SIGNED) {
            const __mmask64 neg = _mm512_kunpackd(_mm512_cmplt_epi16_mask(w1, below),
                                                  _mm512_cmplt_epi16_mask(w0, below));
            code = _mm512_mask_blend_epi8(neg, _mm512_add_epi8(code, k127),
                                          _mm512_subs_epu8(k127, code));
        }
        _mm512_storeu_si512(out + k, code);
    }
}

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
    // The 8-bit step's operations (adam8_body.inc).
    using I = __m512i;
    static I load_u8(const uint8_t* p) {
        return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static void store_u8(uint8_t* p, I x) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
    }
    static T gather(const float* t, I i) { return _mm512_i32gather_ps(i, t, 4); }
    static I gather_u8(const uint8_t* t, I i) {  // 4 bytes at each offset; the table is padded
        return _mm512_and_si512(_mm512_i32gather_epi32(i, t, 1), _mm512_set1_epi32(0xff));
    }
    // Dequantizing by a gather per vector: no whole-block way without VBMI.
    static bool lookup_block(const QuantMap&, const uint8_t*, float*) { return false; }
    // A block's codes by the search tree when the caller built one, else false.
    template <bool SIGNED>
    static bool quant_block(const QuantMap& map, const float* values, float inverse,
                            uint8_t* out) {
        if (map.tree == nullptr) return false;
        quant_tree<SIGNED>(map.tree, values, inverse, out);
        return true;
    }
    static T abs(T x) { return _mm512_abs_ps(x); }
    static T max(T a, T b) { return _mm512_max_ps(a, b); }
    static float hmax(T x) { return _mm512_reduce_max_ps(x); }
    static I bucket(T yabs) {
        const I b = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(yabs), kBucketShift),
                                     _mm512_set1_epi32(kBucketBase));
        return _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()),
                                _mm512_set1_epi32(kBucketTop - kBucketBase));
    }
    static I signed_code(I t, T y) {
        const I k = _mm512_set1_epi32(127);
        const __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
        return _mm512_mask_blend_epi32(neg, _mm512_add_epi32(k, t),
                                       _mm512_sub_epi32(k, _mm512_min_epi32(t, k)));
    }
};

#include "adam_body.inc"
#include "adam8_body.inc"

// The 8-bit step again, for CPUs with VBMI: the same loop over a V whose byte permutes look
// up 64 codes into registers (no buffer between the dequantize and the update) and find
// codes by the coarse index. Consts and load_grad are the ones above.
// Its target list replaces the file's for this part (not nested: one list per function).
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(                                                   \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma,f16c")
#endif
namespace vbmi {

struct V : ::infinity_adam::V {
    static constexpr size_t kGroup = 64;
    // bindings.cpp sets the planes (and the signed map's mirror) for this level.
    static void lookup_group(const QuantMap& map, const uint8_t* codes, T* out) {
        if (map.mirror != nullptr)
            lookup_mirror(map.mirror, codes, out);
        else
            lookup_planes(map.planes, codes, out);
    }
    template <bool SIGNED>
    static bool quant_block(const QuantMap& map, const float* values, float inverse,
                            uint8_t* out) {
        if (map.index != nullptr && inverse <= kMaxIndexInverse)
            quant_index<SIGNED>(map.index, values, inverse, out);
        else if (map.tree != nullptr)
            quant_tree<SIGNED>(map.tree, values, inverse, out);
        else
            return false;
        return true;
    }
};

#include "adam8_body.inc"

}  // namespace vbmi

// [Note: the bf16 copy by one instruction] The half copy's round to nearest-even costs eight
// instructions per vector, a tenth of the 8-bit step's work on the CPUs measured (it is
// bound by instructions, not bytes). AVX512_BF16's vcvtneps2bf16 rounds the same way in one,
// except that it reads denormal inputs as zero and keeps a NaN's sign and payload (ours
// writes 0x7fc0): a vector with either takes the eight-instruction path, so the copy keeps
// every bit. The level "avx512bf16" (VBMI and AVX512_BF16) is the VBMI loop over this V.
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,fma,f16c")
#endif
namespace vbmi_bf16 {

struct V : vbmi::V {
    template <bool NT>
    static void store_bf16(uint16_t* p, T x) {
        constexpr int kNanOrDenormal = 0x01 | 0x80 | 0x20;  // fpclass: QNaN, SNaN, denormal
        if (__builtin_expect(_mm512_fpclass_ps_mask(x, kNanOrDenormal) != 0, 0))
            ::infinity_adam::V::store_bf16<NT>(p, x);
        else
            store16<NT>(p, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    }
};

#include "adam8_body.inc"

}  // namespace vbmi_bf16
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(                                      \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif

}  // namespace

void adam_avx512(const AdamArgs& a, size_t begin, size_t end) { adam_entry(a, begin, end); }
void adam8_avx512(const Adam8Args& a, size_t begin, size_t end) { adam8_entry(a, begin, end); }
void adam8_avx512vbmi(const Adam8Args& a, size_t begin, size_t end) {
    vbmi::adam8_entry(a, begin, end);
}
void adam8_avx512bf16(const Adam8Args& a, size_t begin, size_t end) {
    vbmi_bf16::adam8_entry(a, begin, end);
}

}  // namespace infinity_adam

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#undef INFINITY_VBMI

#endif  // x86-64
