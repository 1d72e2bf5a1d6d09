// Persistent worker pool. Workers sleep on a condition variable between loops and pull tiles
// from a shared atomic counter, so a core that is busy with something else simply takes fewer
// tiles. Once the caller has run out of tiles the loop is closed: a worker that wakes up later
// (its core was busy) skips it instead of making the caller wait for it. The pool object is
// never destroyed (workers are detached): joining threads from a static destructor at
// interpreter exit can deadlock.
#include "thread_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace infinity_adam {
namespace {

int cores_available() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1u, std::thread::hardware_concurrency());
}

class Pool {
   public:
    Pool() : pid_(getpid()), wanted_(cores_available()) {}

    int num_threads() const { return wanted_.load(); }
    void set_num_threads(int n) { wanted_.store(std::max(1, n)); }

    void parallel_for(size_t ntiles, const std::function<void(size_t)>& fn) {
        std::lock_guard<std::mutex> serial(call_mutex_);
        const int helpers = std::min<long>(wanted_.load() - 1, static_cast<long>(ntiles) - 1);
        // After fork() the workers do not exist in the child: run on the calling thread.
        if (helpers <= 0 || getpid() != pid_) {
            for (size_t t = 0; t < ntiles; ++t) fn(t);
            return;
        }
        ensure_workers(helpers);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            fn_ = &fn;
            ntiles_ = ntiles;
            next_.store(0);
            participants_ = helpers;
            active_ = 0;
            closed_ = false;
            ++generation_;
        }
        wake_.notify_all();
        run_tiles();
        std::unique_lock<std::mutex> lock(mutex_);
        closed_ = true;  // tiles are all taken: late workers skip this loop
        done_.wait(lock, [&] { return active_ == 0; });
        fn_ = nullptr;
    }

   private:
    void ensure_workers(int n) {
        std::lock_guard<std::mutex> lock(mutex_);
        while (started_ < n) {
            const int index = started_++;
            // A new worker starts from the current generation: it waits for the next loop.
            const unsigned long seen = generation_;
            std::thread([this, index, seen] { worker(index, seen); }).detach();
        }
    }

    void run_tiles() {
        const std::function<void(size_t)>& fn = *fn_;
        for (size_t t = next_.fetch_add(1); t < ntiles_; t = next_.fetch_add(1)) fn(t);
    }

    void worker(int index, unsigned long seen) {
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return generation_ != seen; });
                seen = generation_;
                if (index >= participants_ || closed_) continue;  // not needed for this loop
                ++active_;
            }
            run_tiles();
            std::lock_guard<std::mutex> lock(mutex_);
            if (--active_ == 0) done_.notify_one();
        }
    }

    const pid_t pid_;
    std::atomic<int> wanted_;
    std::mutex call_mutex_;  // one loop at a time
    std::mutex mutex_;       // guards the fields of the current loop below
    std::condition_variable wake_, done_;
    const std::function<void(size_t)>* fn_ = nullptr;
    size_t ntiles_ = 0;
    std::atomic<size_t> next_{0};
    int participants_ = 0;
    int active_ = 0;       // workers inside the current loop
    bool closed_ = true;   // the current loop takes no more workers
    unsigned long generation_ = 0;
    int started_ = 0;
};

Pool& pool() {
    static Pool* instance = new Pool();  // intentionally leaked, see the file comment
    return *instance;
}

}  // namespace

int pool_num_threads() { return pool().num_threads(); }
void pool_set_num_threads(int n) { pool().set_num_threads(n); }
void pool_parallel_for(size_t ntiles, const std::function<void(size_t)>& fn) {
    pool().parallel_for(ntiles, fn);
}

}  // namespace infinity_adam
