// io_uring through raw syscalls: io_uring_setup, two mmap'd rings and the SQE array, and
// io_uring_enter to submit and wait in one call (or to submit alone). Only the owning worker touches the ring, so
// the only ordering that matters is with the kernel (acquire/release on head and tail).
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "ring.h"

namespace infinity_aio {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
    return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return static_cast<int>(
        syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

template <typename T>
T load_acquire(const T* p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

template <typename T>
void store_release(T* p, T v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

class URing final : public Ring {
public:
    explicit URing(unsigned depth) {
        io_uring_params p;
        std::memset(&p, 0, sizeof(p));
        fd_ = sys_setup(depth, &p);
        if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "io_uring_setup");
        sq_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
        cq_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
        single_mmap_ = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
        if (single_mmap_) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
        sq_ptr_ = map(sq_bytes_, IORING_OFF_SQ_RING);
        cq_ptr_ = single_mmap_ ? sq_ptr_ : map(cq_bytes_, IORING_OFF_CQ_RING);
        sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
        sqes_ = static_cast<io_uring_sqe*>(map(sqes_bytes_, IORING_OFF_SQES));

        char* sq = static_cast<char*>(sq_ptr_);
        sq_head_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
        sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
        sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
        sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
        char* cq = static_cast<char*>(cq_ptr_);
        cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
        cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
        cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
        cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
        // The index array maps ring slots to SQEs one to one; set it once.
        for (unsigned i = 0; i <= sq_mask_; ++i) sq_array_[i] = i;
    }

    ~URing() override { release(); }

    void prepare(Op* op) override {
        const unsigned tail = *sq_tail_;  // only this thread writes the tail
        io_uring_sqe* sqe = &sqes_[tail & sq_mask_];
        std::memset(sqe, 0, sizeof(*sqe));
        sqe->opcode = op->write ? IORING_OP_WRITE : IORING_OP_READ;
        sqe->fd = op->fd;
        sqe->addr = reinterpret_cast<uint64_t>(op->buf);
        sqe->len = static_cast<uint32_t>(op->len);
        sqe->off = static_cast<uint64_t>(op->offset);
        sqe->user_data = reinterpret_cast<uint64_t>(op);
        store_release(sq_tail_, tail + 1);
    }

    void submit(std::vector<Completion>& out) override { submit_and_wait(0, out); }

    void submit_and_wait(unsigned min_complete, std::vector<Completion>& out) override {
        const size_t start = out.size();
        for (;;) {
            // What the kernel has not consumed yet, read from the ring itself, so a call
            // interrupted after a partial submission resumes exactly where it stopped.
            const unsigned pending = *sq_tail_ - load_acquire(sq_head_);
            const unsigned reaped = static_cast<unsigned>(out.size() - start);
            const unsigned need = reaped >= min_complete ? 0 : min_complete - reaped;
            const unsigned ready = load_acquire(cq_tail_) - *cq_head_;
            const unsigned wait = ready >= need ? 0 : need;  // the kernel counts the whole CQ
            if (pending == 0 && wait == 0) break;
            if (pending > 0) count_submit_call();
            const int r = sys_enter(fd_, pending, wait, wait ? IORING_ENTER_GETEVENTS : 0);
            if (r >= 0 || errno == EINTR) continue;
            if (errno == EAGAIN || errno == EBUSY) {
                // The kernel is short of resources until completions are consumed.
                if (reap(out) == 0) sched_yield();
                continue;
            }
            throw std::system_error(errno, std::generic_category(), "io_uring_enter");
        }
        reap(out);
    }

private:
    void release() {
        if (sqes_) munmap(sqes_, sqes_bytes_);
        if (cq_ptr_ && !single_mmap_) munmap(cq_ptr_, cq_bytes_);
        if (sq_ptr_) munmap(sq_ptr_, sq_bytes_);
        if (fd_ >= 0) close(fd_);
        sqes_ = nullptr;
        sq_ptr_ = cq_ptr_ = nullptr;
        fd_ = -1;
    }

    void* map(size_t bytes, off_t where) {
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                       where);
        if (p == MAP_FAILED) {
            const int e = errno;
            release();
            throw std::system_error(e, std::generic_category(), "mmap of the io_uring rings");
        }
        return p;
    }

    unsigned reap(std::vector<Completion>& out) {
        unsigned head = *cq_head_;
        const unsigned tail = load_acquire(cq_tail_);
        const unsigned n = tail - head;
        for (; head != tail; ++head) {
            const io_uring_cqe& c = cqes_[head & cq_mask_];
            out.push_back({reinterpret_cast<Op*>(c.user_data), static_cast<long>(c.res)});
        }
        store_release(cq_head_, tail);
        return n;
    }

    int fd_ = -1;
    bool single_mmap_ = false;
    size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
    void* sq_ptr_ = nullptr;
    void* cq_ptr_ = nullptr;
    io_uring_sqe* sqes_ = nullptr;
    unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
    unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
    unsigned sq_mask_ = 0, cq_mask_ = 0;
    io_uring_cqe* cqes_ = nullptr;
};

}  // namespace

std::unique_ptr<Ring> make_uring(unsigned depth) { return std::make_unique<URing>(depth); }

}  // namespace infinity_aio
