// CRC-32C (Castagnoli) of memory: the checksum of swap extents (infinity/io/checksum.py).
// No Python or PyTorch types: raw pointers and sizes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity_aio {

// True when the CPU runs the SSE4.2 crc32 instruction (checked once, at run time).
bool crc32c_hardware();

// The CRC-32C of `nbytes` at `data`, continuing from `crc` (0 to start). `hardware` false
// takes the table-driven path even where the instruction exists (for tests).
uint32_t crc32c(const uint8_t* data, size_t nbytes, uint32_t crc, bool hardware);

// The CRC-32C of each `chunk` bytes of [data, data + nbytes) into out[0..ceil(nbytes/chunk)),
// the last chunk short if nbytes is not a multiple. Chunks are independent, so the hardware
// path runs three of them at once (three dependency chains keep the unit busy).
//
// With `sample` > 0, each chunk's CRC covers only the first `sample` bytes of every `stride`
// bytes of the chunk (counted from the chunk's start), chained in order: a sampled sum.
void crc32c_chunks(const uint8_t* data, size_t nbytes, size_t chunk, uint32_t* out,
                   bool hardware, size_t sample = 0, size_t stride = 0);

}  // namespace infinity_aio
