// kvq/cpu/executor.hpp — how kvq's threaded CPU calls run their tasks: on the engine's
// own thread pool, or OpenMP, or serially. kvq never starts threads itself.
//
// An executor is a callable  ex(count, task)  that runs task(i) once for every i in
// [0, count), in any order and on any threads, and returns when all have finished.
// Tasks write disjoint memory and never allocate. Wrapping an engine's pool:
//
//   auto on_pool = [&](int count, auto&& task) { pool.parallel_for(0, count, task); };
//   kvq::decode_attention_split<P>(cache, table, params, rot, {}, split, workspace, on_pool);
#pragma once

#include <concepts>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kvq::cpu {

template <class E>
concept Executor = requires(E& ex, void (*task)(int)) { ex(1, task); };

// Runs the tasks in order on the calling thread.
struct SerialExecutor {
  template <class Task>
  void operator()(int count, Task&& task) const {
    for (int i = 0; i < count; ++i) task(i);
  }
};

#if defined(_OPENMP)
// Runs the tasks on OpenMP threads (defined when the engine compiles with -fopenmp).
// threads = 0 uses OpenMP's default team size.
struct OpenMPExecutor {
  int threads = 0;
  template <class Task>
  void operator()(int count, Task&& task) const {
    const int team = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (int i = 0; i < count; ++i) task(i);
  }
};
#endif

}  // namespace kvq::cpu
