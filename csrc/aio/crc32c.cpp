// CRC-32C, by the fastest kernel the CPU runs (chosen at run time): carry-less multiplication
// folding 256 bytes a step (AVX-512 VPCLMULQDQ), the crc32 instruction (SSE4.2 on x86-64,
// the CRC extension on ARMv8), else slicing-by-8 tables. The Python twin is
// infinity.io.checksum.crc32c_reference; tests compare every kernel with it.
#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define INFINITY_CRC_X86 1
#elif defined(__aarch64__) && defined(__linux__)
#include <arm_acle.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#define INFINITY_CRC_ARM 1
#endif

namespace infinity_aio {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, reflected

struct Tables {
    uint32_t t[8][256];
    Tables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
            t[0][i] = c;
        }
        for (int k = 1; k < 8; ++k)
            for (uint32_t i = 0; i < 256; ++i)
                t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFu];
    }
};

const Tables& tables() {
    static const Tables tabs;
    return tabs;
}

// Each kernel maps the CRC register (inverted at the ends by crc32c()) over n bytes.
uint32_t reg_table(const uint8_t* p, size_t n, uint32_t c) {
    const auto& t = tables().t;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);  // little-endian load; unaligned is fine
        v ^= c;
        c = t[7][v & 0xFF] ^ t[6][(v >> 8) & 0xFF] ^ t[5][(v >> 16) & 0xFF] ^
            t[4][(v >> 24) & 0xFF] ^ t[3][(v >> 32) & 0xFF] ^ t[2][(v >> 40) & 0xFF] ^
            t[1][(v >> 48) & 0xFF] ^ t[0][v >> 56];
    }
    for (; n; ++p, --n) c = t[0][(c ^ *p) & 0xFFu] ^ (c >> 8);
    return c;
}

#ifdef INFINITY_CRC_X86
// GCC 12's AVX-512 headers fill masked-off lanes from a dummy it then calls uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

__attribute__((target("sse4.2"))) uint32_t reg_instr(const uint8_t* p, size_t n, uint32_t c32) {
    uint64_t c = c32;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    c32 = static_cast<uint32_t>(c);
    for (; n; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
    return c32;
}

// [Note: CRC folding] The message is a polynomial over GF(2) and its CRC the remainder of
// (message * x^32) mod P. Four 512-bit accumulators hold the first 256 bytes; each step
// multiplies every 128-bit lane by x^2048 (256 bytes further on) modulo P and adds the next
// 256 bytes, so the remainder never changes. A lane's two 64-bit halves L and H (bits
// reflected: the first byte's low bit is the highest power) become L * k1 + H * k2 with
// k1 = x^(D + 31) mod P and k2 = x^(D - 33) mod P for a fold over D bits (the 31 and -33
// make up for the 64-bit half's own place and for the reflected product landing one bit
// short of a 128-bit lane's top). The lanes are then folded into one 128-bit remainder,
// which the crc32 instruction finishes as 16 bytes of message. The constants are checked
// against the table kernel in tests/test_io_checksum.py over every length and offset.
__attribute__((target("avx512f,vpclmulqdq"))) inline __m512i fold512(__m512i x, __m512i k,
                                                                     __m512i next) {
    const __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00);
    const __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
}

__attribute__((target("pclmul,sse4.1"))) inline __m128i fold128(__m128i x, __m128i k,
                                                                 __m128i next) {
    const __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
    const __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

constexpr size_t kPrefetch = 2048;

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) uint32_t reg_fold(
    const uint8_t* p, size_t n, uint32_t c) {
    if (n < 256) return reg_instr(p, n, c);
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0xB9E02B86, 0xDCB17AA4));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x9E4ADDF8, 0x740EEF02));
    const __m128i k128 = _mm_set_epi64x(0x493C7D27, 0xF20C0DFE);
    // The register enters as the first 32 bits of the message; the other lanes are zero.
    const __m512i start = _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c)));
    __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), start);
    __m512i a1 = _mm512_loadu_si512(p + 64);
    __m512i a2 = _mm512_loadu_si512(p + 128);
    __m512i a3 = _mm512_loadu_si512(p + 192);
    size_t at = 256;
    for (; at + 256 <= n; at += 256) {
        for (int line = 0; line < 256; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(p + at + kPrefetch + line), _MM_HINT_T0);
        a0 = fold512(a0, k2048, _mm512_loadu_si512(p + at));
        a1 = fold512(a1, k2048, _mm512_loadu_si512(p + at + 64));
        a2 = fold512(a2, k2048, _mm512_loadu_si512(p + at + 128));
        a3 = fold512(a3, k2048, _mm512_loadu_si512(p + at + 192));
    }
    __m512i a = fold512(fold512(fold512(a0, k512, a1), k512, a2), k512, a3);
    __m128i r = _mm512_castsi512_si128(a);
    r = fold128(r, k128, _mm512_extracti32x4_epi32(a, 1));
    r = fold128(r, k128, _mm512_extracti32x4_epi32(a, 2));
    r = fold128(r, k128, _mm512_extracti32x4_epi32(a, 3));
    uint64_t reg = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(r)));
    reg = _mm_crc32_u64(reg, static_cast<uint64_t>(_mm_extract_epi64(r, 1)));
    return reg_instr(p + at, n - at, static_cast<uint32_t>(reg));
}

// Three chunks of `n` bytes each, interleaved: the instruction's latency is 3 cycles and its
// throughput 1 per cycle, so three independent chains run about three times as fast as one.
__attribute__((target("sse4.2"))) void instr3(const uint8_t* a, const uint8_t* b,
                                              const uint8_t* c, size_t n, uint32_t* out) {
    uint64_t x = 0xFFFFFFFFu, y = 0xFFFFFFFFu, z = 0xFFFFFFFFu;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t va, vb, vc;
        std::memcpy(&va, a + i, 8);
        std::memcpy(&vb, b + i, 8);
        std::memcpy(&vc, c + i, 8);
        x = _mm_crc32_u64(x, va);
        y = _mm_crc32_u64(y, vb);
        z = _mm_crc32_u64(z, vc);
    }
    out[0] = ~reg_instr(a + i, n - i, static_cast<uint32_t>(x));
    out[1] = ~reg_instr(b + i, n - i, static_cast<uint32_t>(y));
    out[2] = ~reg_instr(c + i, n - i, static_cast<uint32_t>(z));
}
#endif

#ifdef INFINITY_CRC_ARM
__attribute__((target("+crc"))) uint32_t reg_instr(const uint8_t* p, size_t n, uint32_t c) {
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        c = __crc32cd(c, v);
    }
    for (; n; ++p, --n) c = __crc32cb(c, *p);
    return c;
}
#endif

using RegFn = uint32_t (*)(const uint8_t*, size_t, uint32_t);

RegFn kernel_fn(CrcKernel k) {
    switch (k) {
#ifdef INFINITY_CRC_X86
        case CrcKernel::kFold: return reg_fold;
#endif
#if defined(INFINITY_CRC_X86) || defined(INFINITY_CRC_ARM)
        case CrcKernel::kInstruction: return reg_instr;
#endif
        default: return reg_table;
    }
}

}  // namespace

bool crc32c_runs(CrcKernel k) {
    switch (k) {
        case CrcKernel::kTable: return true;
#ifdef INFINITY_CRC_X86
        case CrcKernel::kInstruction: {
            static const bool has = __builtin_cpu_supports("sse4.2");
            return has;
        }
        case CrcKernel::kFold: {
            static const bool has = __builtin_cpu_supports("sse4.2") &&
                                    __builtin_cpu_supports("pclmul") &&
                                    __builtin_cpu_supports("avx512f") &&
                                    __builtin_cpu_supports("vpclmulqdq");
            return has;
        }
#endif
#ifdef INFINITY_CRC_ARM
        case CrcKernel::kInstruction: {
            static const bool has = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
            return has;
        }
#endif
        default: return false;
    }
}

CrcKernel crc32c_best() {
    static const CrcKernel best = crc32c_runs(CrcKernel::kFold)          ? CrcKernel::kFold
                                  : crc32c_runs(CrcKernel::kInstruction) ? CrcKernel::kInstruction
                                                                         : CrcKernel::kTable;
    return best;
}

uint32_t crc32c(const uint8_t* data, size_t nbytes, uint32_t crc, CrcKernel kernel) {
    return ~kernel_fn(kernel)(data, nbytes, ~crc);
}

void crc32c_chunks(const uint8_t* data, size_t nbytes, size_t chunk, uint32_t* out,
                   CrcKernel kernel, size_t sample, size_t stride) {
    if (chunk == 0) return;
    const RegFn fn = kernel_fn(kernel);
    const bool sampled = sample > 0 && stride > sample;
    size_t k = 0;
#ifdef INFINITY_CRC_X86
    if (kernel == CrcKernel::kInstruction && !sampled)
        for (; k + 3 <= nbytes / chunk; k += 3) instr3(data + k * chunk, data + (k + 1) * chunk,
                                                       data + (k + 2) * chunk, chunk, out + k);
#endif
    for (; k * chunk < nbytes; ++k) {
        const size_t end = nbytes - k * chunk < chunk ? nbytes - k * chunk : chunk;
        if (!sampled) {
            out[k] = ~fn(data + k * chunk, end, ~0u);
            continue;
        }
        uint32_t reg = ~0u;
        for (size_t at = 0; at < end; at += stride)
            reg = fn(data + k * chunk + at, end - at < sample ? end - at : sample, reg);
        out[k] = ~reg;
    }
}

}  // namespace infinity_aio
