// Worker loop and request bookkeeping of the I/O engine (see engine.h).
// Short reads and writes are resubmitted for the remainder; EINTR and EAGAIN results are
// resubmitted up to kMaxRetries times; a read that returns 0 bytes before the end of its
// range is an error (ENODATA), never silently short data. After a failure, ops past it are
// dropped and ops before it run to the end, so the error names the first failed byte.
#include "engine.h"

#include <algorithm>
#include <cerrno>
#include <string>
#include <stdexcept>
#include <system_error>

namespace infinity_aio {
namespace {
constexpr unsigned kMaxRetries = 1000;
}

Worker::Worker(const std::string& backend, unsigned depth, size_t block_size,
               bool single_submit, bool overlap_events)
    : ring_(make_ring(backend, depth)),
      block_size_(block_size),
      single_submit_(single_submit),
      overlap_events_(overlap_events),
      ops_(depth) {
    for (auto& op : ops_) free_ops_.push_back(&op);
    thread_ = std::thread([this] { run(); });
}

Worker::~Worker() { stop(); }

void Worker::push(Slice* slice) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        incoming_.push_back(slice);
    }
    cv_.notify_one();
}

void Worker::stop() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
}

void Worker::add_stats(Stats& into) const {
    into.submit_calls += ring_->submit_calls();
    into.ops += ops_prepared_.load(std::memory_order_relaxed);
    into.max_in_flight_at_refill = std::max<uint64_t>(
        into.max_in_flight_at_refill, max_refill_in_flight_.load(std::memory_order_relaxed));
}

void Worker::run() {
    std::vector<Completion> done;
    for (;;) {
        {
            std::unique_lock<std::mutex> lk(mu_);
            if (in_flight_ == 0 && retry_.empty() && active_.empty())
                cv_.wait(lk, [&] { return stopping_ || !incoming_.empty(); });
            for (Slice* s : incoming_) active_.push_back(s);
            incoming_.clear();
            if (stopping_ && in_flight_ == 0 && retry_.empty() && active_.empty()) return;
        }
        done.clear();
        try {
            fill(done);
            // Completions reaped while filling are still counted in in_flight_.
            ring_->submit_and_wait(in_flight_ > done.size() ? 1 : 0, done);
        } catch (const std::exception& e) {
            abandon(e);
            continue;
        }
        for (const Completion& c : done) complete(c);
    }
}

// Tops the ring up to its depth: remainders first, then new block_size ops from the slices.
// Without overlap_events, new ops wait until the batch in flight is done, remainders and all.
// With single_submit, each op is submitted as soon as it is prepared; completions reaped on
// the way land in `out`.
void Worker::fill(std::vector<Completion>& out) {
    const unsigned busy = in_flight_;
    const bool take_new = overlap_events_ || (in_flight_ == 0 && retry_.empty());
    bool added_new = false;
    while (in_flight_ < ops_.size()) {
        Op* op = nullptr;
        if (!retry_.empty()) {
            op = retry_.front();
            retry_.pop_front();
            if (past_failure(op)) {
                finish_op(op);
                continue;
            }
        } else {
            if (!take_new || active_.empty() || free_ops_.empty()) break;
            Slice* s = active_.front();
            if (s->failed || broken_ || s->cut == s->len) {
                if (broken_ && !s->failed) fail(s, EIO, s->offset, broken_what_.c_str());
                active_.pop_front();
                s->in_active = false;
                if (s->in_flight == 0) finish_slice(s);
                continue;
            }
            op = free_ops_.back();
            free_ops_.pop_back();
            const size_t n = std::min(block_size_, s->len - s->cut);
            op->slice = s;
            op->fd = s->fd;
            op->write = s->write;
            op->buf = s->buf + s->cut;
            op->len = n;
            op->offset = s->offset + static_cast<off_t>(s->cut);
            op->retries = 0;
            s->cut += n;
            s->in_flight++;
            added_new = true;
        }
        ring_->prepare(op);
        in_flight_++;
        ops_prepared_.fetch_add(1, std::memory_order_relaxed);
        if (single_submit_) ring_->submit(out);
    }
    if (added_new && busy > max_refill_in_flight_.load(std::memory_order_relaxed))
        max_refill_in_flight_.store(busy, std::memory_order_relaxed);
}

void Worker::complete(const Completion& c) {
    Op* op = c.op;
    Slice* s = op->slice;
    in_flight_--;
    if (c.res < 0) {
        const int code = static_cast<int>(-c.res);
        if ((code == EINTR || code == EAGAIN) && !past_failure(op) &&
            ++op->retries <= kMaxRetries) {
            retry_.push_back(op);
            return;
        }
        fail(s, code, op->offset, op->write ? "write" : "read");
    } else if (static_cast<size_t>(c.res) < op->len) {
        if (c.res == 0) {
            // A read at the end of the file, or a write the file system took nothing of.
            fail(s, op->write ? EIO : ENODATA, op->offset,
                 op->write ? "write (0 bytes written)" : "read (end of file)");
        } else {
            op->buf += c.res;
            op->offset += c.res;
            op->len -= static_cast<size_t>(c.res);
            if (!past_failure(op)) {  // bytes before a failure still count: finish them
                retry_.push_back(op);
                return;
            }
        }
    }
    finish_op(op);
}

void Worker::finish_op(Op* op) {
    Slice* s = op->slice;
    op->slice = nullptr;
    free_ops_.push_back(op);
    s->in_flight--;
    if (s->in_flight == 0 && !s->in_active) finish_slice(s);
}

void Worker::finish_slice(Slice* s) {
    std::shared_ptr<Ticket> t = std::move(s->ticket);
    delete s;
    bool last;
    {
        std::lock_guard<std::mutex> lk(t->mu);
        last = --t->open_slices == 0;
    }
    if (last) t->cv.notify_all();
}

void Worker::fail(Slice* s, int code, off_t offset, const char* what) {
    if (!s->failed || offset < s->fail_offset) s->fail_offset = offset;
    s->failed = true;
    std::lock_guard<std::mutex> lk(s->ticket->mu);
    // Ops complete out of order: keep the failure nearest the start of the request.
    IoError& e = s->ticket->error;
    if (e.code == 0 || offset < e.offset) e = IoError{code, offset, what};
}

// The ring itself failed (not one op): report it on every request this worker holds, and on
// every later one, rather than hang. Ops still in the kernel are not waited for.
void Worker::abandon(const std::exception& e) {
    broken_ = true;
    broken_what_ = std::string("I/O ring failure: ") + e.what();
    int code = EIO;
    if (auto* se = dynamic_cast<const std::system_error*>(&e)) code = se->code().value();
    std::vector<Slice*> open(active_.begin(), active_.end());
    for (Op& op : ops_)
        if (op.slice) open.push_back(op.slice);
    std::sort(open.begin(), open.end());
    open.erase(std::unique(open.begin(), open.end()), open.end());
    active_.clear();
    retry_.clear();
    in_flight_ = 0;
    free_ops_.clear();
    for (Op& op : ops_) {
        op.slice = nullptr;
        free_ops_.push_back(&op);
    }
    for (Slice* s : open) {
        if (!s->failed) fail(s, code, s->offset, broken_what_.c_str());
        finish_slice(s);
    }
}

Engine::Engine(const std::string& backend_, size_t block_size_, unsigned queue_depth_,
               unsigned threads_, bool single_submit_, bool overlap_events_)
    : backend(backend_),
      block_size(block_size_),
      queue_depth(queue_depth_),
      threads(threads_),
      single_submit(single_submit_),
      overlap_events(overlap_events_) {
    if (block_size == 0 || queue_depth == 0 || threads == 0)
        throw std::invalid_argument("block_size, queue_depth and threads must all be > 0");
    for (unsigned i = 0; i < threads; ++i)
        workers_.push_back(std::make_unique<Worker>(backend, queue_depth, block_size,
                                                    single_submit, overlap_events));
}

Engine::~Engine() { close(); }

void Engine::close() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        closed_ = true;
    }
    for (auto& w : workers_) w->stop();
}

uint64_t Engine::submit(bool write, int fd, uintptr_t buf, size_t len, off_t offset) {
    auto ticket = std::make_shared<Ticket>();
    // One slice per worker, cut at block_size boundaries so every op keeps the alignment.
    size_t per = (len + threads - 1) / threads;
    per = (per + block_size - 1) / block_size * block_size;
    std::vector<Slice*> slices;
    for (size_t start = 0; start < len; start += per) {
        auto* s = new Slice;
        s->ticket = ticket;
        s->fd = fd;
        s->write = write;
        s->buf = reinterpret_cast<char*>(buf) + start;
        s->len = std::min(per, len - start);
        s->offset = offset + static_cast<off_t>(start);
        slices.push_back(s);
    }
    ticket->open_slices = static_cast<unsigned>(slices.size());
    uint64_t id;
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (closed_) {
            for (Slice* s : slices) delete s;
            throw std::runtime_error("the I/O engine is closed; create a new handle");
        }
        id = next_id_++;
        tickets_.emplace(id, ticket);
    }
    for (size_t i = 0; i < slices.size(); ++i) workers_[i]->push(slices[i]);
    return id;
}

std::shared_ptr<Ticket> Engine::find(uint64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = tickets_.find(id);
    if (it == tickets_.end())
        throw std::invalid_argument("unknown or already waited I/O ticket " + std::to_string(id));
    return it->second;
}

IoError Engine::wait(uint64_t id) {
    std::shared_ptr<Ticket> t = find(id);
    IoError err;
    {
        std::unique_lock<std::mutex> lk(t->mu);
        t->cv.wait(lk, [&] { return t->open_slices == 0; });
        err = t->error;
    }
    std::lock_guard<std::mutex> lk(mu_);
    tickets_.erase(id);
    return err;
}

Stats Engine::stats() const {
    Stats s;
    for (const auto& w : workers_) w->add_stats(s);
    return s;
}

bool Engine::done(uint64_t id) {
    std::shared_ptr<Ticket> t = find(id);
    std::lock_guard<std::mutex> lk(t->mu);
    return t->open_slices == 0;
}

}  // namespace infinity_aio
