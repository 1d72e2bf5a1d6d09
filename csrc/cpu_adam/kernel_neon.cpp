// NEON path for aarch64 (4 lanes); NEON and fp16 conversion are baseline there, so no target
// attributes are needed. Conversions round to nearest-even (the default FPCR mode).
#if defined(__aarch64__)

#include <arm_neon.h>

#include <cstring>

#include "adam_kernel.h"

namespace infinity_adam {
namespace {

struct V {
    using T = float32x4_t;
    static constexpr size_t W = 4;
    static T set1(float x) { return vdupq_n_f32(x); }
    static T load(const float* p) { return vld1q_f32(p); }
    static void store(float* p, T x) { vst1q_f32(p, x); }
    static T load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
    static T load_bf16(const uint16_t* p) {
        return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
    }
    template <bool NT>
    static void store_f16(uint16_t* p, T x) {
        vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x)));
    }
    static void fence() {}
    template <bool NT>
    static void store_bf16(uint16_t* p, T x) {
        const uint32x4_t u = vreinterpretq_u32_f32(x);
        const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
        uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), odd), 16);
        const uint32x4_t ordered = vceqq_f32(x, x);  // all ones unless NaN
        r = vbslq_u32(ordered, r, vdupq_n_u32(0x7fc0));
        vst1_u16(p, vmovn_u32(r));
    }
    static T add(T a, T b) { return vaddq_f32(a, b); }
    static T sub(T a, T b) { return vsubq_f32(a, b); }
    static T mul(T a, T b) { return vmulq_f32(a, b); }
    static T div(T a, T b) { return vdivq_f32(a, b); }
    static T sqrt(T a) { return vsqrtq_f32(a); }
    static T fma(T a, T b, T c) { return vfmaq_f32(c, a, b); }
};

#include "adam_body.inc"

}  // namespace

void adam_neon(const AdamArgs& a, size_t begin, size_t end) { adam_entry(a, begin, end); }

}  // namespace infinity_adam

#endif  // aarch64
