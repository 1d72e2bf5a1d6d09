// CRC-32C (Castagnoli) of memory: the checksum of swap extents (infinity/io/checksum.py).
// No Python or PyTorch types: raw pointers and sizes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity_aio {

// The ways to compute it, slowest first; all give the same CRC.
enum class CrcKernel : int {
    kTable = 0,        // slicing-by-8 tables: any CPU
    kInstruction = 1,  // the crc32 instruction: SSE4.2 (x86-64) or the ARMv8 CRC extension
    kFold = 2,         // carry-less multiplication, 256 bytes a step (AVX-512 VPCLMULQDQ)
};

// True when this CPU runs `kernel` (checked once, at run time).
bool crc32c_runs(CrcKernel kernel);

// The fastest kernel this CPU runs.
CrcKernel crc32c_best();

// The CRC-32C of `nbytes` at `data`, continuing from `crc` (0 to start), by `kernel` (one
// that crc32c_runs).
uint32_t crc32c(const uint8_t* data, size_t nbytes, uint32_t crc, CrcKernel kernel);

// The CRC-32C of each `chunk` bytes of [data, data + nbytes) into out[0..ceil(nbytes/chunk)),
// the last chunk short if nbytes is not a multiple.
//
// With `sample` > 0, each chunk's CRC covers only the first `sample` bytes of every `stride`
// bytes of the chunk (counted from the chunk's start), chained in order: a sampled sum.
void crc32c_chunks(const uint8_t* data, size_t nbytes, size_t chunk, uint32_t* out,
                   CrcKernel kernel, size_t sample = 0, size_t stride = 0);

}  // namespace infinity_aio
