// CRC-32C: the SSE4.2 instruction where the CPU has it (chosen at run time), else slicing-by-8
// tables. The Python twin is infinity.io.checksum.crc32c_reference; tests compare the three.
#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define INFINITY_CRC_X86 1
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

uint32_t crc_table(const uint8_t* p, size_t n, uint32_t crc) {
    const auto& t = tables().t;
    uint32_t c = ~crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);  // little-endian load; unaligned is fine
        v ^= c;
        c = t[7][v & 0xFF] ^ t[6][(v >> 8) & 0xFF] ^ t[5][(v >> 16) & 0xFF] ^
            t[4][(v >> 24) & 0xFF] ^ t[3][(v >> 32) & 0xFF] ^ t[2][(v >> 40) & 0xFF] ^
            t[1][(v >> 48) & 0xFF] ^ t[0][v >> 56];
    }
    for (; n; ++p, --n) c = t[0][(c ^ *p) & 0xFFu] ^ (c >> 8);
    return ~c;
}

#ifdef INFINITY_CRC_X86
__attribute__((target("sse4.2"))) uint32_t crc_hw(const uint8_t* p, size_t n, uint32_t crc) {
    uint64_t c = ~crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    uint32_t c32 = static_cast<uint32_t>(c);
    for (; n; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
    return ~c32;
}

// Three chunks of `n` bytes each, interleaved: the instruction's latency is 3 cycles and its
// throughput 1 per cycle, so three independent chains run about three times as fast as one.
__attribute__((target("sse4.2"))) void crc_hw3(const uint8_t* a, const uint8_t* b,
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
    uint32_t x32 = static_cast<uint32_t>(x), y32 = static_cast<uint32_t>(y),
             z32 = static_cast<uint32_t>(z);
    for (; i < n; ++i) {
        x32 = _mm_crc32_u8(x32, a[i]);
        y32 = _mm_crc32_u8(y32, b[i]);
        z32 = _mm_crc32_u8(z32, c[i]);
    }
    out[0] = ~x32;
    out[1] = ~y32;
    out[2] = ~z32;
}
#endif

}  // namespace

bool crc32c_hardware() {
#ifdef INFINITY_CRC_X86
    static const bool has = __builtin_cpu_supports("sse4.2");
    return has;
#else
    return false;
#endif
}

uint32_t crc32c(const uint8_t* data, size_t nbytes, uint32_t crc, bool hardware) {
#ifdef INFINITY_CRC_X86
    if (hardware && crc32c_hardware()) return crc_hw(data, nbytes, crc);
#endif
    (void)hardware;
    return crc_table(data, nbytes, crc);
}

void crc32c_chunks(const uint8_t* data, size_t nbytes, size_t chunk, uint32_t* out,
                   bool hardware, size_t sample, size_t stride) {
    if (chunk == 0) return;
    if (sample > 0 && stride > sample) {
        for (size_t k = 0; k * chunk < nbytes; ++k) {
            const size_t end = nbytes - k * chunk < chunk ? nbytes - k * chunk : chunk;
            uint32_t crc = 0;
            for (size_t at = 0; at < end; at += stride) {
                const size_t n = end - at < sample ? end - at : sample;
                crc = crc32c(data + k * chunk + at, n, crc, hardware);
            }
            out[k] = crc;
        }
        return;
    }
    const size_t full = nbytes / chunk;
    size_t k = 0;
#ifdef INFINITY_CRC_X86
    if (hardware && crc32c_hardware()) {
        for (; k + 3 <= full; k += 3) {
            const uint8_t* p = data + k * chunk;
            crc_hw3(p, p + chunk, p + 2 * chunk, chunk, out + k);
        }
    }
#endif
    for (; k * chunk < nbytes; ++k) {
        const size_t n = nbytes - k * chunk < chunk ? nbytes - k * chunk : chunk;
        out[k] = crc32c(data + k * chunk, n, 0, hardware);
    }
}

}  // namespace infinity_aio
