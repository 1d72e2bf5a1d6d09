// Python binding of the CPU-Adam kernel: checks scalars, picks the SIMD path from the CPU's
// features, splits the buffers into tiles over the thread pool, releases the GIL meanwhile.
// Buffers arrive as raw addresses with an element count; infinity/optim/native_adam.py checks
// the tensors (dtype, device, contiguity, sizes) before calling in.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_kernel.h"
#include "thread_pool.h"

namespace py = pybind11;
using namespace infinity_adam;

namespace {

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

// AVX-512 with VBMI's byte permutes: the 8-bit step's table lookup ([Note: byte-plane lookup]).
bool cpu_has_avx512vbmi() {
#if defined(__x86_64__) || defined(_M_X64)
    return cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi");
#else
    return false;
#endif
}

// VBMI and AVX512_BF16: the 8-bit step's bf16 copy by one conversion instruction.
bool cpu_has_avx512bf16() {
#if defined(__x86_64__) || defined(_M_X64)
    return cpu_has_avx512vbmi() && __builtin_cpu_supports("avx512bf16");
#else
    return false;
#endif
}

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

// The levels this CPU can run, fastest first; "scalar" is always last.
std::vector<std::string> simd_levels() {
    std::vector<std::string> out;
    if (cpu_has_avx512bf16()) out.push_back("avx512bf16");
    if (cpu_has_avx512vbmi()) out.push_back("avx512vbmi");
    if (cpu_has_avx512()) out.push_back("avx512");
    if (cpu_has_avx2()) out.push_back("avx2");
#if defined(__aarch64__)
    out.push_back("neon");
#endif
    out.push_back("scalar");
    return out;
}

KernelFn kernel_for(const std::string& requested) {
    static const std::vector<std::string> levels = simd_levels();
    const std::string level = requested == "auto" ? levels.front() : requested;
    bool supported = false;
    for (const auto& l : levels) supported = supported || l == level;
    if (!supported) {
        std::string have;
        for (const auto& l : levels) have += (have.empty() ? "" : ", ") + l;
        throw std::invalid_argument("simd='" + requested + "' is not available on this CPU (" +
                                    "it supports: " + have + "); pass one of those or 'auto'");
    }
#if defined(__x86_64__) || defined(_M_X64)
    if (level == "avx512" || level == "avx512vbmi" || level == "avx512bf16")
        return adam_avx512;  // same 32-bit path
    if (level == "avx2") return adam_avx2;
#endif
#if defined(__aarch64__)
    if (level == "neon") return adam_neon;
#endif
    return adam_scalar;
}

// The level a request names: "auto" is the fastest this CPU runs.
std::string level_of(const std::string& requested) {
    static const std::vector<std::string> levels = simd_levels();
    return requested == "auto" ? levels.front() : requested;
}

// Whether a request runs the 8-bit step's VBMI lookup (kernel_for has validated it).
bool uses_vbmi(const std::string& requested) {
    const std::string level = level_of(requested);
    return level == "avx512vbmi" || level == "avx512bf16";
}

// The 8-bit step's path for a level: NEON has none yet, so aarch64 runs the scalar one.
Kernel8Fn kernel8_for(const std::string& requested) {
    const KernelFn k = kernel_for(requested);  // validates the request
#if defined(__x86_64__) || defined(_M_X64)
    if (uses_vbmi(requested))
        return level_of(requested) == "avx512bf16" ? adam8_avx512bf16 : adam8_avx512vbmi;
    if (k == adam_avx512) return adam8_avx512;
    if (k == adam_avx2) return adam8_avx2;
#endif
    (void)k;
    return adam8_scalar;
}

DType parse_dtype(const std::string& name, bool allow_none, const char* what) {
    if (name == "fp32" && !allow_none) return DType::f32;
    if (name == "fp16") return DType::f16;
    if (name == "bf16") return DType::bf16;
    if (name.empty() && allow_none) return DType::none;
    throw std::invalid_argument(std::string(what) + " dtype '" + name + "' is not supported; use " +
                                (allow_none ? "'fp16', 'bf16' or '' (no copy)"
                                            : "'fp32', 'fp16' or 'bf16'"));
}

// The four byte planes of qmap[127 + k], k = 0..127, when the map is symmetric as the signed
// dynamic map is (qmap[127 - k] = -qmap[127 + k], qmap[127] = 0, qmap[255] = 1): then the
// VBMI step reads one 128-entry plane per byte. False, and nothing to use, otherwise.
bool mirror_planes(const float* qmap, uint8_t* out) {
    uint32_t bits[256];
    std::memcpy(bits, qmap, sizeof bits);
    if (bits[127] != 0 || bits[255] != 0x3f800000u) return false;
    for (int k = 1; k < 128; ++k)
        if (bits[127 - k] != (bits[127 + k] ^ 0x80000000u) || (bits[127 + k] >> 31)) return false;
    for (int k = 0; k < 128; ++k)
        for (int b = 0; b < 4; ++b) out[128 * b + k] = (bits[127 + k] >> (8 * b)) & 0xff;
    return true;
}

void* as_ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

// The hyperparameters of one step, read once from infinity.optim.AdamHyper (which has
// checked them): the record crosses the binding as one value.
struct Hyper {
    double lr, beta1, beta2, eps, weight_decay;
    bool adamw_mode, bias_correction;
};

Hyper read_hyper(const py::handle& h) {
    Hyper out{};
    out.lr = h.attr("lr").cast<double>();
    out.beta1 = h.attr("beta1").cast<double>();
    out.beta2 = h.attr("beta2").cast<double>();
    out.eps = h.attr("eps").cast<double>();
    out.weight_decay = h.attr("weight_decay").cast<double>();
    out.adamw_mode = h.attr("adamw_mode").cast<bool>();
    out.bias_correction = h.attr("bias_correction").cast<bool>();
    return out;
}

// The kernel's per-call constants: as torch derives them, in double, then rounded to float by
// the fp32 kernels.
void derive_constants(const Hyper& h, long step, double grad_scale, AdamArgs& a) {
    const double s = static_cast<double>(step);
    const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, s) : 1.0;
    const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, s) : 1.0;
    a.neg_step_size = static_cast<float>(-h.lr / bc1);
    a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    a.eps = static_cast<float>(h.eps);
    a.beta2 = static_cast<float>(h.beta2);
    a.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    const float weight = static_cast<float>(1.0 - h.beta1);
    a.lerp_base_is_grad = !(std::fabs(weight) < 0.5f);  // torch.lerp's two forms
    a.lerp_coeff = a.lerp_base_is_grad ? weight - 1.0f : weight;
    a.use_grad_scale = grad_scale != 1.0;
    a.grad_scale = static_cast<float>(grad_scale);
    if (h.weight_decay != 0.0) {
        a.use_decay = h.adamw_mode;
        a.use_l2 = !h.adamw_mode;
        a.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
        a.l2 = static_cast<float>(h.weight_decay);
    }
}

void adam_step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
               size_t numel, const std::string& grad_dtype, uintptr_t half_out,
               const std::string& half_dtype, long step, const py::object& hyper,
               double grad_scale, const std::string& simd, size_t tile_numel, bool stream_half) {
    AdamArgs a;
    a.grad_dtype = parse_dtype(grad_dtype, false, "gradient");
    a.half_dtype = parse_dtype(half_dtype, true, "half_out");
    const KernelFn kernel = kernel_for(simd);
    const Hyper h = read_hyper(hyper);
    if (step < 1) throw std::invalid_argument("step must be >= 1 (1-based, after this update)");
    if (tile_numel == 0) throw std::invalid_argument("tile_numel must be > 0");
    if (numel == 0) return;
    if (!param || !grad || !exp_avg || !exp_avg_sq || (a.half_dtype != DType::none && !half_out))
        throw std::invalid_argument("null buffer address with numel > 0");
    a.param = static_cast<float*>(as_ptr(param));
    a.grad = as_ptr(grad);
    a.exp_avg = static_cast<float*>(as_ptr(exp_avg));
    a.exp_avg_sq = static_cast<float*>(as_ptr(exp_avg_sq));
    a.half_out = a.half_dtype == DType::none ? nullptr : as_ptr(half_out);
    a.stream_half = stream_half;
    derive_constants(h, step, grad_scale, a);

    py::gil_scoped_release no_gil;
    const size_t ntiles = (numel + tile_numel - 1) / tile_numel;
    pool_parallel_for(ntiles, [&](size_t t) {
        const size_t begin = t * tile_numel;
        kernel(a, begin, std::min(numel, begin + tile_numel));
    });
}

// The 8-bit step: the same checks and constants as adam_step, the moments as codes and
// absmax, and the eight quantization tables (quant8.py) as addresses.
void adam8_step(uintptr_t param, uintptr_t grad, uintptr_t m_codes, uintptr_t v_codes,
                uintptr_t m_absmax, uintptr_t v_absmax, size_t numel,
                const std::string& grad_dtype, uintptr_t half_out, const std::string& half_dtype,
                long step, const py::object& hyper, double grad_scale,
                const std::vector<uintptr_t>& tables, const std::string& simd,
                size_t tile_numel) {
    Adam8Args a8;
    AdamArgs& a = a8.base;
    a.grad_dtype = parse_dtype(grad_dtype, false, "gradient");
    a.half_dtype = parse_dtype(half_dtype, true, "half_out");
    const Kernel8Fn kernel = kernel8_for(simd);
    const Hyper h = read_hyper(hyper);
    if (step < 1) throw std::invalid_argument("step must be >= 1 (1-based, after this update)");
    if (tile_numel == 0 || tile_numel % kBlock)
        throw std::invalid_argument("tile_numel must be a positive multiple of 256");
    if (tables.size() != 8)
        throw std::invalid_argument(
            "tables must be eight addresses (qmap, codes, tree, index) x 2");
    for (uintptr_t t : tables)
        if (!t) throw std::invalid_argument("null quantization table address");
    if (numel == 0) return;
    if (!param || !grad || !m_codes || !v_codes || !m_absmax || !v_absmax ||
        (a.half_dtype != DType::none && !half_out))
        throw std::invalid_argument("null buffer address with numel > 0");
    a.param = static_cast<float*>(as_ptr(param));
    a.grad = as_ptr(grad);
    a.half_out = a.half_dtype == DType::none ? nullptr : as_ptr(half_out);
    a.stream_half = false;
    derive_constants(h, step, grad_scale, a);
    a8.m_codes = static_cast<uint8_t*>(as_ptr(m_codes));
    a8.v_codes = static_cast<uint8_t*>(as_ptr(v_codes));
    a8.m_absmax = static_cast<float*>(as_ptr(m_absmax));
    a8.v_absmax = static_cast<float*>(as_ptr(v_absmax));
    QuantMap* maps[2] = {&a8.m_map, &a8.v_map};
    for (int k = 0; k < 2; ++k) {
        maps[k]->qmap = static_cast<const float*>(as_ptr(tables[4 * k]));
        maps[k]->codes = static_cast<const uint8_t*>(as_ptr(tables[4 * k + 1]));
    }
    alignas(64) uint8_t planes[2][4 * 256];  // byte b of each map value, for the VBMI lookup
    alignas(64) uint8_t mirror[4 * 128];      // the signed map's magnitudes (lookup_mirror)
    if (uses_vbmi(simd)) {
        for (int k = 0; k < 2; ++k) {
            for (int c = 0; c < 256; ++c) {
                uint32_t bits;
                std::memcpy(&bits, maps[k]->qmap + c, 4);
                for (int b = 0; b < 4; ++b) planes[k][256 * b + c] = (bits >> (8 * b)) & 0xff;
            }
            maps[k]->planes = planes[k];
            if (k == 0 && mirror_planes(maps[k]->qmap, mirror)) maps[k]->mirror = mirror;
            maps[k]->index = static_cast<const uint8_t*>(as_ptr(tables[4 * k + 3]));
        }
    }

#if defined(__x86_64__) || defined(_M_X64)
    if (kernel == adam8_avx512 || kernel == adam8_avx512vbmi ||
        kernel == adam8_avx512bf16)  // the paths with the tree
        for (int k = 0; k < 2; ++k)
            maps[k]->tree = static_cast<const int16_t*>(as_ptr(tables[4 * k + 2]));
#endif

    py::gil_scoped_release no_gil;
    const size_t ntiles = (numel + tile_numel - 1) / tile_numel;
    pool_parallel_for(ntiles, [&](size_t t) {
        const size_t begin = t * tile_numel;
        kernel(a8, begin, std::min(numel, begin + tile_numel));
    });
}

// STREAM-like copy over the same pool, to measure the bandwidth the kernel is held against.
void copy_bytes(uintptr_t dst, uintptr_t src, size_t nbytes, size_t tile_bytes) {
    if (tile_bytes == 0) throw std::invalid_argument("tile_bytes must be > 0");
    if (nbytes == 0) return;
    if (!dst || !src) throw std::invalid_argument("null buffer address with nbytes > 0");
    py::gil_scoped_release no_gil;
    auto* d = static_cast<char*>(as_ptr(dst));
    const auto* s = static_cast<const char*>(as_ptr(src));
    pool_parallel_for((nbytes + tile_bytes - 1) / tile_bytes, [&](size_t t) {
        const size_t begin = t * tile_bytes;
        std::memcpy(d + begin, s + begin, std::min(nbytes, begin + tile_bytes) - begin);
    });
}

}  // namespace

PYBIND11_MODULE(_cpu_adam, m) {
    m.doc() = "Fused SIMD Adam/AdamW step over flat CPU buffers (raw addresses; see "
              "infinity.optim.native_adam for the checked Python entry point).";
    m.def("adam_step", &adam_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"), py::arg("numel"), py::arg("grad_dtype"), py::arg("half_out"),
          py::arg("half_dtype"), py::arg("step"), py::arg("hyper"), py::arg("grad_scale"),
          py::arg("simd") = "auto", py::arg("tile_numel") = 1 << 16,
          py::arg("stream_half") = true,
          "One Adam/AdamW step in place over numel elements with the hyperparameters of "
          "`hyper` (an infinity.optim.AdamHyper); writes the new parameter to half_out "
          "(fp16/bf16, round to nearest-even) when half_dtype is not ''.");
    m.def("adam8_step", &adam8_step, py::arg("param"), py::arg("grad"), py::arg("m_codes"),
          py::arg("v_codes"), py::arg("m_absmax"), py::arg("v_absmax"), py::arg("numel"),
          py::arg("grad_dtype"), py::arg("half_out"), py::arg("half_dtype"), py::arg("step"),
          py::arg("hyper"), py::arg("grad_scale"), py::arg("tables"), py::arg("simd") = "auto",
          py::arg("tile_numel") = 1 << 16,
          "One Adam/AdamW step with 8-bit blockwise moments (uint8 codes, one fp32 absmax per "
          "256 elements) in place over numel elements; see infinity.optim.adam8.");
    // The fields adam_step reads from `hyper`; its presence marks a build that takes the record.
    m.attr("HYPER_FIELDS") = py::make_tuple("lr", "beta1", "beta2", "eps", "weight_decay",
                                            "adamw_mode", "bias_correction");
    m.def("copy_bytes", &copy_bytes, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
          py::arg("tile_bytes") = 1 << 20, "Parallel memcpy over the kernel's thread pool.");
    m.def("simd_levels", &simd_levels, "SIMD levels this CPU can run, fastest first.");
    m.def("num_threads", &pool_num_threads, "Threads used per step (workers + caller).");
    m.def(
        "set_num_threads",
        [](int n) {
            if (n < 1)
                throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
            pool_set_num_threads(n);
        },
        py::arg("n"));
}
