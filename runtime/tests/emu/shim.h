// A CPU emulator of the CUDA execution model, just enough to run runtime/src/cuda/kernels/*.cu
// with a C++ compiler: one fiber per CUDA thread of a block, blocks one after another,
// __syncthreads as a block barrier, warp shuffles as a per-warp exchange between barriers.
// Test-only (runtime/tests/ops.rs). It checks the kernels' arithmetic, indexing, masking and
// barrier placement; it says nothing about speed, memory coalescing or the real memory model.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <math.h>
#include <memory>
#include <csetjmp>
#include <setjmp.h>
#include <ucontext.h>
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
// One OS thread runs every CUDA thread of a block as a fiber (ucontext): a barrier is a yield
// to the scheduler, so a block of 256 threads costs 256 small stacks, not 256 OS threads.
// Kernels without barriers, shuffles or shared memory run serially instead (`run_serial`).
inline emu_uint3 tid;
inline emu_uint3 bid;
inline emu_uint3 bdim;
inline emu_uint3 gdim;
inline std::vector<unsigned char> dyn_shared;

struct Barrier {
    unsigned count = 0, arrived = 0, generation = 0;
};
struct Fiber {
    ucontext_t ctx;  // to enter the fiber the first time (its own stack)
    jmp_buf jb;      // where it yielded
    emu_uint3 tid;
    bool started = false;
    bool done = false;
    std::vector<char> stack;
};
inline std::vector<Fiber> fibers;
// Switches use _setjmp/_longjmp (no signal-mask system call, unlike swapcontext); makecontext
// and setcontext only start each fiber.
inline jmp_buf scheduler;
inline unsigned current = 0;
inline Barrier block_bar;
inline std::vector<Barrier> warp_bars;
inline std::vector<uint64_t> warp_slots;
inline const std::function<void()>* body = nullptr;
constexpr size_t STACK = 128 * 1024;

inline void* dynamic_shared() { return dyn_shared.data(); }

inline void yield() {
    if (!_setjmp(fibers[current].jb)) {
        _longjmp(scheduler, 1);
    }
}

inline void arrive_and_wait(Barrier& b) {
    const unsigned gen = b.generation;
    if (++b.arrived == b.count) {
        b.arrived = 0;
        b.generation++;
        return;
    }
    while (b.generation == gen) {
        yield();
    }
}

inline void fiber_main() {
    (*body)();
    fibers[current].done = true;
    _longjmp(scheduler, 1);
}

inline unsigned lane_index() { return tid.x + bdim.x * (tid.y + bdim.y * tid.z); }

template <class T>
T shfl(T v, int src) {
    const unsigned int lin = lane_index();
    const unsigned w = lin / 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    warp_slots[w * 32 + lin % 32] = bits;
    arrive_and_wait(warp_bars[w]);
    uint64_t got = warp_slots[w * 32 + (src & 31)];
    arrive_and_wait(warp_bars[w]);
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}

// The fragments of one warp-wide mma.sync (per lane: 4 A registers, 2 B registers, 4 C values).
inline std::vector<uint32_t> mma_a, mma_b;

inline float bf16_bits_to_float(uint32_t bits) {
    const uint32_t u = bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a * b over one warp: every lane
// posts its fragments, then each computes its own four outputs (products summed in f32 in k
// order, then added to d). Layout as in the PTX ISA (attention.cu states it).
inline void mma_m16n8k16(float* d, const unsigned* a, const unsigned* b) {
    const unsigned lin = lane_index();
    const unsigned w = lin / 32, l = lin % 32;
    for (int i = 0; i < 4; i++) mma_a[(w * 32 + l) * 4 + i] = a[i];
    for (int i = 0; i < 2; i++) mma_b[(w * 32 + l) * 2 + i] = b[i];
    arrive_and_wait(warp_bars[w]);
    const unsigned gid = l >> 2, tig = l & 3;
    float out[4];
    for (int e = 0; e < 4; e++) {
        const unsigned row = gid + (e >= 2 ? 8 : 0);
        const unsigned col = tig * 2 + (e & 1);
        float acc = 0.0f;
        for (unsigned k = 0; k < 16; k++) {
            const unsigned al = (row % 8) * 4 + (k % 8) / 2;
            const unsigned ar = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
            const unsigned bl = col * 4 + (k % 8) / 2;
            const unsigned br = k >= 8 ? 1 : 0;
            const uint32_t av = mma_a[(w * 32 + al) * 4 + ar] >> (16 * (k % 2));
            const uint32_t bv = mma_b[(w * 32 + bl) * 2 + br] >> (16 * (k % 2));
            acc += bf16_bits_to_float(av & 0xffffu) * bf16_bits_to_float(bv & 0xffffu);
        }
        out[e] = d[e] + acc;
    }
    arrive_and_wait(warp_bars[w]);
    for (int e = 0; e < 4; e++) d[e] = out[e];
}

inline void setup(emu_uint3 grid, emu_uint3 block, unsigned int shared_bytes) {
    gdim = grid;
    bdim = block;
    dyn_shared.assign(shared_bytes + 16, 0xAB);  // poisoned, as device memory is not zeroed
}

// Runs `kernel` over the grid: the threads of a block as fibers, blocks in order.
inline void run(emu_uint3 grid, emu_uint3 block, unsigned int shared_bytes,
                const std::function<void()>& kernel) {
    setup(grid, block, shared_bytes);
    const unsigned int n = block.x * block.y * block.z;
    if (fibers.size() < n) {
        fibers.resize(n);
    }
    body = &kernel;
    block_bar = Barrier{n, 0, 0};
    warp_bars.assign(n / 32, Barrier{32, 0, 0});
    warp_slots.assign((n / 32 + 1) * 32, 0);
    mma_a.assign((n / 32 + 1) * 32 * 4, 0);
    mma_b.assign((n / 32 + 1) * 32 * 2, 0);
    for (unsigned int z = 0; z < grid.z; z++) {
        for (unsigned int y = 0; y < grid.y; y++) {
            for (unsigned int x = 0; x < grid.x; x++) {
                bid = {x, y, z};
                for (unsigned int t = 0; t < n; t++) {
                    Fiber& f = fibers[t];
                    f.stack.resize(STACK);
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, fiber_main, 0);
                    f.tid = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                    f.started = false;
                    f.done = false;
                }
                unsigned int alive = n;
                while (alive > 0) {
                    for (unsigned int t = 0; t < n; t++) {
                        if (fibers[t].done) {
                            continue;
                        }
                        current = t;
                        tid = fibers[t].tid;
                        if (!_setjmp(scheduler)) {
                            if (!fibers[t].started) {
                                fibers[t].started = true;
                                setcontext(&fibers[t].ctx);
                            }
                            _longjmp(fibers[t].jb, 1);
                        }
                        if (fibers[t].done) {
                            alive--;
                        }
                    }
                }
            }
        }
    }
}

// A kernel with no barrier, shuffle or shared memory: every (block, thread) in order.
inline void run_serial(emu_uint3 grid, emu_uint3 block, unsigned int shared_bytes,
                       const std::function<void()>& kernel) {
    setup(grid, block, shared_bytes);
    for (unsigned int z = 0; z < grid.z; z++) {
        for (unsigned int y = 0; y < grid.y; y++) {
            for (unsigned int x = 0; x < grid.x; x++) {
                bid = {x, y, z};
                for (unsigned int t = 0; t < block.x * block.y * block.z; t++) {
                    tid = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                    kernel();
                }
            }
        }
    }
}
}  // namespace emu

#define threadIdx emu::tid
#define blockIdx emu::bid
#define blockDim emu::bdim
#define gridDim emu::gdim
#define TESSERA_DYNAMIC_SHARED(T, name) T* name = (T*)emu::dynamic_shared()

inline void __syncthreads() { emu::arrive_and_wait(emu::block_bar); }
template <class T>
inline T __shfl_sync(unsigned int, T v, int src) { return emu::shfl(v, src); }
template <class T>
inline T __shfl_xor_sync(unsigned int, T v, int mask) {
    return emu::shfl(v, (int)(emu::lane_index() % 32) ^ mask);
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
// Rounded f32 operations that CUDA never fuses into an FMA (nor does this build: no -mfma).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// One OS thread runs every CUDA thread: a read-modify-write is atomic.
inline unsigned int atomicMax(unsigned int* p, unsigned int v) {
    const unsigned int old = *p;
    if (v > old) *p = v;
    return old;
}
