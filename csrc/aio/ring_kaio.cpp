// Kernel native AIO through raw syscalls (io_setup, io_submit, io_getevents, io_destroy) and
// <linux/aio_abi.h>, so neither libaio nor its headers are needed to build or run.
// Prepared iocbs are batched and handed to one io_submit call (one each with single_submit).
#include <sys/syscall.h>
#include <unistd.h>

#include <sched.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "ring.h"

namespace infinity_aio {
namespace {

class KernelAio final : public Ring {
public:
    explicit KernelAio(unsigned depth) : events_(depth) {
        if (syscall(__NR_io_setup, depth, &ctx_) < 0)
            throw std::system_error(errno, std::generic_category(), "io_setup");
        batch_.reserve(depth);
    }

    ~KernelAio() override { syscall(__NR_io_destroy, ctx_); }

    void prepare(Op* op) override {
        iocb& cb = op->cb;
        std::memset(&cb, 0, sizeof(cb));
        cb.aio_lio_opcode = op->write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
        cb.aio_fildes = static_cast<uint32_t>(op->fd);
        cb.aio_buf = reinterpret_cast<uint64_t>(op->buf);
        cb.aio_nbytes = op->len;
        cb.aio_offset = op->offset;
        cb.aio_data = reinterpret_cast<uint64_t>(op);
        batch_.push_back(&cb);
    }

    void submit(std::vector<Completion>& out) override {
        size_t sent = 0;
        while (sent < batch_.size()) {
            count_submit_call();
            const long r = syscall(__NR_io_submit, ctx_, batch_.size() - sent, &batch_[sent]);
            if (r > 0) {
                sent += static_cast<size_t>(r);
            } else if (r < 0 && errno == EAGAIN) {
                // The context is full until completions are consumed.
                if (get(0, out) == 0) sched_yield();
            } else if (r < 0 && errno != EINTR) {
                // io_submit fails only for the first iocb it could not queue (a bad fd, a
                // misaligned O_DIRECT request...): that op completes with the error.
                out.push_back({reinterpret_cast<Op*>(batch_[sent]->aio_data), -errno});
                ++sent;
            }
        }
        batch_.clear();
    }

    void submit_and_wait(unsigned min_complete, std::vector<Completion>& out) override {
        const size_t start = out.size();
        submit(out);
        if (min_complete == 0) {
            get(0, out);
            return;
        }
        while (out.size() - start < min_complete)
            get(static_cast<long>(min_complete - (out.size() - start)), out);
    }

private:
    // Reaps what has completed, waiting for at least `min_nr`; returns the number reaped.
    long get(long min_nr, std::vector<Completion>& out) {
        long r;
        do {
            r = syscall(__NR_io_getevents, ctx_, min_nr, static_cast<long>(events_.size()),
                        events_.data(), nullptr);
        } while (r < 0 && errno == EINTR);
        if (r < 0) throw std::system_error(errno, std::generic_category(), "io_getevents");
        for (long i = 0; i < r; ++i)
            out.push_back({reinterpret_cast<Op*>(events_[i].data),
                           static_cast<long>(events_[i].res)});
        return r;
    }

    aio_context_t ctx_ = 0;
    std::vector<io_event> events_;
    std::vector<iocb*> batch_;
};

}  // namespace

std::unique_ptr<Ring> make_kaio(unsigned depth) { return std::make_unique<KernelAio>(depth); }

std::unique_ptr<Ring> make_ring(const std::string& backend, unsigned depth) {
    if (backend == "io_uring") return make_uring(depth);
    if (backend == "aio") return make_kaio(depth);
    throw std::invalid_argument("unknown native backend '" + backend +
                                "'; the extension implements 'io_uring' and 'aio'");
}

}  // namespace infinity_aio
