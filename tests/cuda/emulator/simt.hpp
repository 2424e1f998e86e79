// A host SIMT emulator for kvq's CUDA kernels: compiles the kernel headers with the
// plain C++ compiler and runs every CUDA thread of a CTA as a std::thread, with warp
// shuffles, ballots, __syncwarp and __syncthreads implemented by barriers. CTAs run one
// after another, so static "__shared__" arrays are simply shared by the CTA's threads.
//
// It checks the kernels' index arithmetic, data flow and numerics (kvq's host-device
// math is the same code on both sides) on machines without a GPU. It does not model
// the memory system (cp.async takes its synchronous fallback path), timing or
// occupancy. Include this before any kvq/cuda header.
#pragma once

#define KVQ_CUDA_HOST_EMULATION 1

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <math.h>

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

namespace kvq_emu {
struct Warp {
  std::barrier<> bar{32};
  std::uint64_t slot[32] = {};
  unsigned mma_a[32][4] = {}, mma_b[32][2] = {};  // fragments of an emulated mma.sync
};
struct Cta {
  explicit Cta(int threads) : bar(threads), warps(new Warp[(threads + 31) / 32]) {}
  std::barrier<> bar;
  std::unique_ptr<Warp[]> warps;
};
inline thread_local Cta* cta = nullptr;
inline thread_local Warp* warp = nullptr;
}  // namespace kvq_emu

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

inline unsigned kvq_emu_lane() { return threadIdx.x & 31u; }

template <class T>
T kvq_emu_exchange(T v, int src) {
  static_assert(sizeof(T) <= 8, "emulated shuffles move at most 8 bytes");
  kvq_emu::Warp& w = *kvq_emu::warp;
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  w.slot[kvq_emu_lane()] = bits;
  w.bar.arrive_and_wait();
  const std::uint64_t r = w.slot[src & 31];
  w.bar.arrive_and_wait();
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}
template <class T>
T __shfl_sync(unsigned, T v, int src, int = 32) {
  return kvq_emu_exchange(v, src);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return kvq_emu_exchange(v, static_cast<int>(kvq_emu_lane()) ^ mask);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  kvq_emu::Warp& w = *kvq_emu::warp;
  w.slot[kvq_emu_lane()] = pred ? 1u : 0u;
  w.bar.arrive_and_wait();
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= static_cast<unsigned>(w.slot[i] != 0) << i;
  w.bar.arrive_and_wait();
  return m;
}
inline void __syncwarp(unsigned = 0xffffffffu) { kvq_emu::warp->bar.arrive_and_wait(); }
inline void __syncthreads() { kvq_emu::cta->bar.arrive_and_wait(); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_or(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int atomicMax(int* p, int v) {
  std::atomic_ref<int> r(*p);
  int cur = r.load();
  while (cur < v && !r.compare_exchange_weak(cur, v)) {
  }
  return cur;
}
template <class T>
T __ldg(const T* p) {
  return *p;
}
template <class T>
T __ldcg(const T* p) {
  return *p;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} for the calling warp: every lane
// publishes its A/B fragments, then computes its own four C elements from the whole
// tiles (PTX ISA fragment layouts; products summed in double, then added in fp32).
inline void kvq_emu_mma_16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], bool bf16) {
  kvq_emu::Warp& w = *kvq_emu::warp;
  const unsigned lane = kvq_emu_lane();
  for (int i = 0; i < 4; ++i) w.mma_a[lane][i] = a[i];
  for (int i = 0; i < 2; ++i) w.mma_b[lane][i] = b[i];
  w.bar.arrive_and_wait();
  auto half = [bf16](unsigned reg, int hi) {
    const unsigned bits = hi ? reg >> 16 : reg & 0xffffu;
    if (bf16) return static_cast<double>(__uint_as_float(bits << 16));
    return static_cast<double>(__half2float(__ushort_as_half(static_cast<unsigned short>(bits))));
  };
  auto A = [&](int row, int col) {  // lane 4·(row % 8) + (col % 8) / 2, register by the row and column halves
    const unsigned l = 4 * (row % 8) + (col % 8) / 2;
    return half(w.mma_a[l][(row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0)], col & 1);
  };
  auto B = [&](int k, int n) {  // lane 4·n + (k % 8) / 2
    const unsigned l = 4 * n + (k % 8) / 2;
    return half(w.mma_b[l][k >= 8 ? 1 : 0], k & 1);
  };
  const int g = static_cast<int>(lane / 4), t = static_cast<int>(lane % 4);
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    double sum = 0;
    for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
    c[i] = static_cast<float>(static_cast<double>(c[i]) + sum);
  }
  w.bar.arrive_and_wait();
}

// Dynamic shared memory of the decode kernels: the test points it at a buffer of exactly
// the launch's size (CTAs run one after another), so that ASan catches a kernel that
// overruns it.
namespace kvq::cuda::kernel {
inline uint4* kvq_decode_smem = nullptr;
}

namespace kvq_emu {
// Runs body() as every thread of every CTA of the grid (CTAs one after another), and
// before_cta() before each CTA (to poison its shared memory, undefined on a GPU).
template <class F, class G>
void launch_ctas(dim3 grid, dim3 block, F&& body, G&& before_cta) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        before_cta();
        Cta c(n);
        std::vector<std::thread> threads;
        threads.reserve(n);
        for (int t = 0; t < n; ++t)
          threads.emplace_back([&, t] {
            threadIdx = make_uint3(static_cast<unsigned>(t), 0, 0);
            blockIdx = make_uint3(x, y, z);
            blockDim = block;
            gridDim = grid;
            cta = &c;
            warp = &c.warps[t / 32];
            body();
            // A returned thread no longer takes part in barriers.
            warp->bar.arrive_and_drop();
            cta->bar.arrive_and_drop();
          });
        for (auto& th : threads) th.join();
      }
}
template <class F>
void launch(dim3 grid, dim3 block, F&& body) {
  launch_ctas(grid, block, body, [] {});
}
}  // namespace kvq_emu
