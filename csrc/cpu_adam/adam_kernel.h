// Shared declarations of the CPU-Adam kernel: argument record, dtype codes, per-ISA entries.
//
// The kernel is stateless: every buffer belongs to the caller. Each ISA file compiles the same
// loop body (adam_body.inc) against its own SIMD type layer, with per-function target
// attributes, so one binary carries every path and picks one at run time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity_adam {

enum class DType : int { none = -1, f32 = 0, f16 = 1, bf16 = 2 };

// Per-call constants, derived once in double (like torch's Python-side scalars) and then
// rounded to float, which is the precision torch's CPU kernels use for fp32 tensors.
struct AdamArgs {
    float* param = nullptr;
    const void* grad = nullptr;
    float* exp_avg = nullptr;
    float* exp_avg_sq = nullptr;
    void* half_out = nullptr;
    DType grad_dtype = DType::f32;
    DType half_dtype = DType::none;
    float grad_scale = 1.0f;     // g = grad * grad_scale
    float l2 = 0.0f;             // Adam: g = fma(param, l2, g)
    float decay = 1.0f;          // AdamW: param *= decay (1 - lr * wd)
    bool use_l2 = false;
    bool use_decay = false;
    bool use_grad_scale = false;
    float lerp_coeff = 0.1f;     // exp_avg = fma(lerp_coeff, g - exp_avg, lerp_base)
    bool lerp_base_is_grad = false;  // torch.lerp switches form when the weight is >= 0.5
    float beta2 = 0.999f;        // exp_avg_sq = fma(one_minus_beta2 * g, g, exp_avg_sq * beta2)
    float one_minus_beta2 = 0.001f;
    float bc2_sqrt = 1.0f;       // denom = sqrt(exp_avg_sq) / bc2_sqrt + eps
    float eps = 1e-8f;
    float neg_step_size = -1e-3f;  // param = param + (neg_step_size * exp_avg) / denom
    bool stream_half = true;       // non-temporal stores for half_out when aligned
};

// Each updates elements [begin, end) of the buffers in `a`.
using KernelFn = void (*)(const AdamArgs& a, size_t begin, size_t end);

// The tables of one dynamic quantization map (infinity/optim/quant8.py computes them; the
// kernel only reads them, so both sides use the same fp32 numbers).
struct QuantMap {
    const float* qmap = nullptr;    // [256] the value of each code
    const uint8_t* codes = nullptr;  // per bucket of |y| (bits >> kBucketShift): its code side
    const uint8_t* planes = nullptr;  // [4][256] byte b of each qmap value: the VBMI lookup
    const uint8_t* mirror = nullptr;  // [4][128] byte b of qmap[127 + k]: a symmetric map's
    const int16_t* tree = nullptr;    // [256] the code table's steps as a search tree (AVX-512)
    const uint8_t* index = nullptr;   // [896] the code table as a coarse index (AVX-512 VBMI)
};

constexpr size_t kBlock = 256;                     // elements per absmax
constexpr int kBucketShift = 13;                   // exponent and 10 mantissa bits
constexpr int32_t kBucketBase = (127 - 24) << 10;  // bucket 0: |y| below 2^-24
constexpr int32_t kBucketTop = 127 << 10;          // the bucket of 1.0
constexpr float kTiny = 1.17549435e-38f;          // divisor of an all-zero block

// The 8-bit step: AdamArgs' fp32 exp_avg/exp_avg_sq are unused; the moments are uint8 codes
// with one fp32 absmax per kBlock elements ([Note: the 8-bit scheme] in quant8.py).
struct Adam8Args {
    AdamArgs base;
    uint8_t* m_codes = nullptr;
    uint8_t* v_codes = nullptr;
    float* m_absmax = nullptr;
    float* v_absmax = nullptr;
    QuantMap m_map;  // signed
    QuantMap v_map;  // unsigned
};

// Each updates elements [begin, end) of `a`; begin is a multiple of kBlock.
using Kernel8Fn = void (*)(const Adam8Args& a, size_t begin, size_t end);

void adam_scalar(const AdamArgs& a, size_t begin, size_t end);
void adam8_scalar(const Adam8Args& a, size_t begin, size_t end);
#if defined(__x86_64__) || defined(_M_X64)
void adam_avx2(const AdamArgs& a, size_t begin, size_t end);
void adam_avx512(const AdamArgs& a, size_t begin, size_t end);
void adam8_avx2(const Adam8Args& a, size_t begin, size_t end);
void adam8_avx512(const Adam8Args& a, size_t begin, size_t end);
void adam8_avx512vbmi(const Adam8Args& a, size_t begin, size_t end);
void adam8_avx512bf16(const Adam8Args& a, size_t begin, size_t end);
#endif
#if defined(__aarch64__)
void adam_neon(const AdamArgs& a, size_t begin, size_t end);
#endif

}  // namespace infinity_adam
