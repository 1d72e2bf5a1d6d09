// One submission/completion queue owned by one worker thread: kernel native AIO or io_uring,
// both through raw syscalls and the kernel's UAPI headers (no libaio, no liburing).
// A ring knows nothing of requests or tickets: it moves Ops in and Completions out.
#pragma once

#include <linux/aio_abi.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace infinity_aio {

struct Slice;

// One contiguous read or write of at most block_size bytes, in flight at most once.
struct Op {
    Slice* slice = nullptr;
    int fd = -1;
    bool write = false;
    char* buf = nullptr;
    size_t len = 0;
    off_t offset = 0;
    unsigned retries = 0;  // resubmissions after EINTR/EAGAIN
    struct iocb cb {};     // storage for the native AIO backend
};

struct Completion {
    Op* op;
    long res;  // bytes moved, or -errno
};

class Ring {
public:
    virtual ~Ring() = default;
    // Queues one op; at most `depth` ops are prepared or in flight at once (the caller's duty).
    virtual void prepare(Op* op) = 0;
    // Submits everything prepared without waiting for any of it; completions reaped on the
    // way (the kernel may need room first) are appended to `out`.
    virtual void submit(std::vector<Completion>& out) = 0;
    // Submits everything prepared, waits until at least `min_complete` ops have completed,
    // and appends every completion available to `out`. Both throw std::system_error on a
    // failure of the ring itself (not of an op: those come back as negative results).
    virtual void submit_and_wait(unsigned min_complete, std::vector<Completion>& out) = 0;
    // System calls that handed ops to the kernel (io_submit, io_uring_enter with ops to
    // submit). Written by the owning worker, readable from any thread.
    uint64_t submit_calls() const { return submit_calls_.load(std::memory_order_relaxed); }

protected:
    void count_submit_call() { submit_calls_.fetch_add(1, std::memory_order_relaxed); }

private:
    std::atomic<uint64_t> submit_calls_{0};
};

// "io_uring" or "aio"; throws std::system_error when the kernel refuses to set it up.
std::unique_ptr<Ring> make_ring(const std::string& backend, unsigned depth);
std::unique_ptr<Ring> make_uring(unsigned depth);
std::unique_ptr<Ring> make_kaio(unsigned depth);

}  // namespace infinity_aio
