// The I/O engine: `threads` workers, each owning one ring with `queue_depth` ops in flight.
// A request (fd, buffer, length, offset) is cut into one slice per worker at block_size
// boundaries; each worker cuts its slice into block_size ops and keeps its ring full across
// every slice it holds. A ticket counts the slices still open and keeps the error.
// single_submit hands each op to the kernel with its own system call instead of one call per
// batch; without overlap_events a worker submits a batch, waits for all of it (remainders of
// short transfers included), and only then submits the next, instead of topping its ring up
// as completions arrive.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ring.h"

namespace infinity_aio {

// How a request failed: errno, the file offset of the failed op and what failed (of several
// failed ops, the one at the lowest offset).
struct IoError {
    int code = 0;
    off_t offset = 0;
    std::string what;
};

struct Ticket {
    std::mutex mu;
    std::condition_variable cv;
    unsigned open_slices = 0;
    IoError error;
};

struct Slice {
    std::shared_ptr<Ticket> ticket;
    int fd = -1;
    bool write = false;
    char* buf = nullptr;
    size_t len = 0;
    off_t offset = 0;
    size_t cut = 0;          // bytes already handed out as ops
    unsigned in_flight = 0;  // ops of this slice out: in the ring or waiting for a retry
    bool in_active = true;   // still in the worker's queue of slices to cut
    bool failed = false;
    off_t fail_offset = 0;   // lowest failed offset; ops before it still run to completion
};

// What the engine's workers did, for tests and tuning: system calls that handed ops to the
// kernel, ops handed over (resubmissions included), and the most ops still in flight when a
// worker added new ones (0 without overlap_events).
struct Stats {
    uint64_t submit_calls = 0;
    uint64_t ops = 0;
    uint64_t max_in_flight_at_refill = 0;
};

class Worker {
public:
    Worker(const std::string& backend, unsigned depth, size_t block_size, bool single_submit,
           bool overlap_events);
    ~Worker();
    // Takes ownership of the slice; the worker deletes it when its last op completes.
    void push(Slice* slice);
    void stop();
    void add_stats(Stats& into) const;

private:
    void run();
    void fill(std::vector<Completion>& out);
    void complete(const Completion& c);
    void finish_op(Op* op);
    void finish_slice(Slice* s);
    void fail(Slice* s, int code, off_t offset, const char* what);
    static bool past_failure(const Op* op) {
        return op->slice->failed && op->offset >= op->slice->fail_offset;
    }
    void abandon(const std::exception& e);

    std::unique_ptr<Ring> ring_;
    size_t block_size_;
    bool single_submit_;
    bool overlap_events_;
    std::atomic<uint64_t> ops_prepared_{0};
    std::atomic<uint64_t> max_refill_in_flight_{0};
    std::vector<Op> ops_;
    std::vector<Op*> free_ops_;
    std::deque<Op*> retry_;       // remainders of short or EAGAIN'd ops
    std::deque<Slice*> active_;   // slices with bytes still to cut
    unsigned in_flight_ = 0;      // ops in the ring
    bool broken_ = false;         // the ring itself failed: every new slice fails at once
    std::string broken_what_;

    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Slice*> incoming_;
    bool stopping_ = false;
    std::thread thread_;
};

class Engine {
public:
    Engine(const std::string& backend, size_t block_size, unsigned queue_depth, unsigned threads,
           bool single_submit = false, bool overlap_events = true);
    ~Engine();
    // Queues a request; returns its ticket id. Never blocks on I/O.
    uint64_t submit(bool write, int fd, uintptr_t buf, size_t len, off_t offset);
    // Blocks until the request is complete and forgets it; returns its error (code 0
    // if none).
    IoError wait(uint64_t id);
    bool done(uint64_t id);
    void close();
    Stats stats() const;

    const std::string backend;
    const size_t block_size;
    const unsigned queue_depth;
    const unsigned threads;
    const bool single_submit;
    const bool overlap_events;

private:
    std::shared_ptr<Ticket> find(uint64_t id);

    std::vector<std::unique_ptr<Worker>> workers_;
    std::mutex mu_;
    std::unordered_map<uint64_t, std::shared_ptr<Ticket>> tickets_;
    uint64_t next_id_ = 1;
    bool closed_ = false;
};

}  // namespace infinity_aio
