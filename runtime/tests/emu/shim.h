// A CPU emulator of the CUDA execution model, just enough to run runtime/src/cuda/kernels/*.cu
// with a C++ compiler: one std::thread per CUDA thread of a block, blocks one after another,
// __syncthreads as a block barrier, warp shuffles as a per-warp exchange between barriers.
// Test-only (runtime/tests/ops.rs). It checks the kernels' arithmetic, indexing, masking and
// barrier placement; it says nothing about speed, memory coalescing or the real memory model.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <math.h>
#include <memory>
#include <thread>
#include <vector>

#define TESSERA_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct emu_uint3 {
    unsigned int x, y, z;
};

namespace emu {
inline thread_local emu_uint3 tid;
inline thread_local emu_uint3 bid;
inline emu_uint3 bdim;
inline emu_uint3 gdim;
inline std::vector<unsigned char> dyn_shared;
inline std::unique_ptr<std::barrier<>> block_bar;
struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    uint64_t slots[32];
};
inline std::vector<Warp> warps;

inline void* dynamic_shared() { return dyn_shared.data(); }

template <class T>
T shfl(T v, int src) {
    const unsigned int lin = tid.x + bdim.x * (tid.y + bdim.y * tid.z);
    Warp& w = warps[lin / 32];
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slots[lin % 32] = bits;
    w.bar->arrive_and_wait();
    uint64_t got = w.slots[src & 31];
    w.bar->arrive_and_wait();
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}

// Runs `kernel` over the grid: all threads of a block concurrently, blocks in order.
inline void run(emu_uint3 grid, emu_uint3 block, unsigned int shared_bytes,
                const std::function<void()>& kernel) {
    gdim = grid;
    bdim = block;
    const unsigned int n = block.x * block.y * block.z;
    dyn_shared.assign(shared_bytes + 16, 0xAB);  // poisoned, as device memory is not zeroed
    block_bar = std::make_unique<std::barrier<>>(n);
    warps.clear();
    warps.resize(n / 32);
    for (auto& w : warps) {
        w.bar = std::make_unique<std::barrier<>>(32);
    }
    std::vector<std::thread> threads;
    for (unsigned int t = 0; t < n; t++) {
        threads.emplace_back([&, t] {
            tid = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned int z = 0; z < grid.z; z++) {
                for (unsigned int y = 0; y < grid.y; y++) {
                    for (unsigned int x = 0; x < grid.x; x++) {
                        bid = {x, y, z};
                        kernel();
                        block_bar->arrive_and_wait();
                    }
                }
            }
        });
    }
    for (auto& th : threads) {
        th.join();
    }
}
}  // namespace emu

#define threadIdx emu::tid
#define blockIdx emu::bid
#define blockDim emu::bdim
#define gridDim emu::gdim
#define TESSERA_DYNAMIC_SHARED(T, name) T* name = (T*)emu::dynamic_shared()

inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }
template <class T>
inline T __shfl_sync(unsigned int, T v, int src) { return emu::shfl(v, src); }
template <class T>
inline T __shfl_xor_sync(unsigned int, T v, int mask) {
    const unsigned int lin = emu::tid.x + emu::bdim.x * (emu::tid.y + emu::bdim.y * emu::tid.z);
    return emu::shfl(v, (int)(lin % 32) ^ mask);
}
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
