// A persistent pool of worker threads for memory-bound loops (no OpenMP: torch's wheel ships
// its own runtime, and a second one in the process fights it for the cores).
#pragma once

#include <cstddef>
#include <functional>

namespace infinity_adam {

// Number of threads that take part in a parallel loop (workers plus the calling thread).
int pool_num_threads();
// Sets it (>= 1); extra workers are started on demand and kept for the life of the process.
void pool_set_num_threads(int n);
// Runs fn(tile) for tile in [0, ntiles), spread over the pool; returns when all are done.
// Calls are serialized: the pool runs one loop at a time.
void pool_parallel_for(size_t ntiles, const std::function<void(size_t)>& fn);

}  // namespace infinity_adam
