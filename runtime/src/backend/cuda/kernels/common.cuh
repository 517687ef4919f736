// Shared helpers prepended to every kernel module before NVRTC compiles it (no #include: NVRTC
// needs no CUDA headers this way, and the CPU emulator in runtime/tests/emu compiles the same
// text with a C++ compiler).
//
// Storage: bf16 as raw 16-bit patterns (`bf16`), converted by bit operations below; every
// reduction and every statistic is fp32. Block sizes are multiples of 32 (whole warps), and
// every shuffle is executed by all 32 lanes of a warp (the code never returns early from a
// warp that still has to shuffle).

typedef unsigned short bf16;

// -inf without <math.h> (NVRTC compiles with no headers).
#define TS_NEG_INF __uint_as_float(0xff800000u)

#ifndef TESSERA_DYNAMIC_SHARED
#define TESSERA_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

__device__ __forceinline__ float bf2f(bf16 x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

// Round to nearest, ties to even (what half::bf16::from_f32 and PyTorch do); NaN stays NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch`: 32 floats of shared
// memory, free to reuse after the call returns (the trailing barrier guarantees it).
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    v = warp_sum(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float r = lane < warps ? scratch[lane] : 0.0f;
    r = warp_sum(r);
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    v = warp_max(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float r = lane < warps ? scratch[lane] : TS_NEG_INF;
    r = warp_max(r);
    __syncthreads();
    return r;
}
