// Python binding of the I/O engine. Buffers arrive as raw addresses with a byte count and
// file descriptors as ints; infinity/io/aio.py checks buffers, opens files, splits off the
// unaligned head and tail, and turns the (errno, offset, what) results into exceptions with
// the path and a hint. The GIL is released on everything that can block.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "crc32c.h"
#include "engine.h"

namespace py = pybind11;
using infinity_aio::Engine;
using infinity_aio::IoError;
using infinity_aio::Stats;

namespace {

using infinity_aio::CrcKernel;
const std::pair<const char*, CrcKernel> kCrcKernels[] = {
    {"table", CrcKernel::kTable},
    {"instruction", CrcKernel::kInstruction},
    {"fold", CrcKernel::kFold},
};

// A kernel by name: "auto" is the fastest this CPU runs; one it does not run is an error.
CrcKernel crc_kernel(const std::string& name) {
    if (name == "auto") return infinity_aio::crc32c_best();
    for (const auto& [known, k] : kCrcKernels)
        if (name == known) {
            if (!infinity_aio::crc32c_runs(k))
                throw std::invalid_argument("crc32c kernel '" + name +
                                            "' does not run on this CPU; see crc32c_kernels()");
            return k;
        }
    throw std::invalid_argument("crc32c kernel '" + name +
                                "' is unknown: 'auto', 'table', 'instruction' or 'fold'");
}

std::unique_ptr<Engine> make_engine(const std::string& backend, size_t block_size,
                                    unsigned queue_depth, unsigned threads, bool single_submit,
                                    bool overlap_events) {
    if (backend != "io_uring" && backend != "aio")
        throw std::invalid_argument("backend='" + backend +
                                    "' is not native; infinity._aio implements 'io_uring' "
                                    "and 'aio' ('posix' is the Python twin)");
    if (block_size == 0 || block_size % 4096 != 0)
        throw std::invalid_argument("block_size must be a positive multiple of 4096, got " +
                                    std::to_string(block_size));
    if (queue_depth == 0 || queue_depth > 4096)
        throw std::invalid_argument("queue_depth must be in 1..4096, got " +
                                    std::to_string(queue_depth));
    if (threads == 0 || threads > 256)
        throw std::invalid_argument("threads must be in 1..256, got " + std::to_string(threads));
    return std::make_unique<Engine>(backend, block_size, queue_depth, threads, single_submit,
                                    overlap_events);
}

// "" if the kernel sets up a ring of this backend, else why not.
std::string probe(const std::string& backend, unsigned queue_depth) {
    try {
        infinity_aio::make_ring(backend, queue_depth);
        return "";
    } catch (const std::exception& e) {
        return e.what();
    }
}

py::object wait(Engine& engine, uint64_t ticket) {
    IoError err;
    {
        py::gil_scoped_release no_gil;
        err = engine.wait(ticket);
    }
    if (err.code == 0) return py::none();
    return py::make_tuple(err.code, static_cast<long long>(err.offset), err.what);
}

py::dict stats(const Engine& engine) {
    const Stats s = engine.stats();
    py::dict d;
    d["submit_calls"] = s.submit_calls;
    d["ops"] = s.ops;
    d["max_in_flight_at_refill"] = s.max_in_flight_at_refill;
    return d;
}

}  // namespace

PYBIND11_MODULE(_aio, m) {
    m.doc() = "Asynchronous file I/O with kernel AIO or io_uring through raw syscalls (raw "
              "addresses; see infinity.io.aio for the checked Python entry point).";
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const std::system_error& e) {
            PyErr_SetObject(PyExc_OSError,
                            py::make_tuple(e.code().value(), std::string(e.what())).ptr());
        }
    });
    py::class_<Engine>(m, "Engine")
        .def(py::init(&make_engine), py::arg("backend"), py::arg("block_size"),
             py::arg("queue_depth"), py::arg("threads"), py::arg("single_submit") = false,
             py::arg("overlap_events") = true,
             "Starts `threads` workers, each with its own ring of `queue_depth` ops. "
             "single_submit: one submission call per op instead of one per batch. "
             "overlap_events=False: submit a batch, wait for all of it, then the next.")
        .def("submit", &Engine::submit, py::arg("write"), py::arg("fd"), py::arg("address"),
             py::arg("nbytes"), py::arg("offset"),
             "Queues one request; returns its ticket. The buffer and fd must stay valid "
             "until the ticket is waited.")
        .def("wait", &wait, py::arg("ticket"),
             "Blocks (GIL released) until the request is done; returns None or "
             "(errno, file offset, what failed). Each ticket is waited once.")
        .def("done", &Engine::done, py::arg("ticket"), "True when the request has finished.")
        .def("stats", &stats,
             "{'submit_calls', 'ops', 'max_in_flight_at_refill'} over all workers since "
             "the start: submission system calls, ops handed to the kernel (resubmissions "
             "included), the most ops in flight when new ones were added.")
        .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>(),
             "Finishes queued requests and stops the workers.")
        .def_readonly("backend", &Engine::backend)
        .def_readonly("block_size", &Engine::block_size)
        .def_readonly("queue_depth", &Engine::queue_depth)
        .def_readonly("threads", &Engine::threads)
        .def_readonly("single_submit", &Engine::single_submit)
        .def_readonly("overlap_events", &Engine::overlap_events);
    m.def(
        "crc32c",
        [](uintptr_t address, size_t nbytes, uint32_t crc, const std::string& kernel) {
            const auto k = crc_kernel(kernel);
            py::gil_scoped_release no_gil;
            return infinity_aio::crc32c(reinterpret_cast<const uint8_t*>(address), nbytes, crc,
                                        k);
        },
        py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0, py::arg("kernel") = "auto",
        "CRC-32C of nbytes at address, continuing from crc (GIL released), by `kernel`: "
        "'auto' (the fastest this CPU runs) or one of crc32c_kernels().");
    m.def(
        "crc32c_chunks",
        [](uintptr_t address, size_t nbytes, size_t chunk, uintptr_t out,
           const std::string& kernel, size_t sample, size_t stride) {
            if (chunk == 0) throw std::invalid_argument("chunk must be > 0");
            const auto k = crc_kernel(kernel);
            py::gil_scoped_release no_gil;
            infinity_aio::crc32c_chunks(reinterpret_cast<const uint8_t*>(address), nbytes, chunk,
                                        reinterpret_cast<uint32_t*>(out), k, sample, stride);
        },
        py::arg("address"), py::arg("nbytes"), py::arg("chunk"), py::arg("out"),
        py::arg("kernel") = "auto", py::arg("sample") = 0, py::arg("stride") = 0,
        "CRC-32C of each chunk bytes of [address, address + nbytes) into the uint32 array at "
        "out (ceil(nbytes / chunk) entries; GIL released). With 0 < sample < stride, of the "
        "first sample bytes of every stride bytes of each chunk only.");
    m.def(
        "crc32c_kernels",
        [] {
            std::vector<std::string> names;
            for (const auto& [name, k] : kCrcKernels)
                if (infinity_aio::crc32c_runs(k)) names.push_back(name);
            return names;
        },
        "The CRC-32C kernels this CPU runs, slowest first ('table', 'instruction', 'fold').");
    m.def("probe", &probe, py::arg("backend"), py::arg("queue_depth") = 8,
          "'' if the kernel allows a ring of this backend, else the reason it does not.");
}
