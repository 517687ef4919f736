// FP8 E4M3 for the tensorwise-scaled FP8 linear (Device::linear_fp8_tensorwise): a tensor's
// amax, its scale, and its cast to E4M3 codes, which cuBLASLt's FP8 GEMM then multiplies.
//
// The conversion is bit for bit runtime/src/quant/fp8.rs's `to_e4m3` (OCP E4M3 "fn": bias 7,
// round to nearest even, SATURATING at ±448, NaN → 0x7f with its sign), written with integer
// operations only, so it needs no cuda_fp8.h on NVRTC's include path.
//
// `stats` holds one tensor's [amax, scale, 1 / scale] as floats (the host gives each tensor 4
// slots). amax is accumulated by atomicMax on the bit pattern of max |x| (non-negative floats
// order as their bits), so the slot must start at 0. The codes are packed four to a u32 word,
// little-endian: byte i of the tensor is byte i of the buffer, which is what cuBLASLt reads as
// CUDA_R_8F_E4M3.

// v >> s rounded to nearest, ties to even (0 < s < 32).
__device__ __forceinline__ unsigned int fp8_shift_rne(unsigned int v, unsigned int s) {
    const unsigned int q = v >> s;
    const unsigned int rem = v & ((1u << s) - 1u);
    const unsigned int half = 1u << (s - 1u);
    return (rem > half || (rem == half && (q & 1u))) ? q + 1u : q;
}

// The E4M3 code of x (in the low byte).
__device__ __forceinline__ unsigned int to_e4m3(float x) {
    const unsigned int bits = __float_as_uint(x);
    const unsigned int sign = (bits >> 24) & 0x80u;
    const unsigned int a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7fu;  // NaN
    }
    if (a >= 0x43e00000u) {
        return sign | 0x7eu;  // |x| >= 448, ±inf included: saturate
    }
    if (a >= (121u << 23)) {
        // Normal: keep 3 mantissa bits (a carry moves into the exponent), rebias 127 → 7.
        return sign | (fp8_shift_rne(a, 20u) - (120u << 3));
    }
    if (a <= (117u << 23)) {
        return sign;  // |x| <= 2^-10: zero (2^-10 itself is a tie that rounds to the even 0)
    }
    // Subnormal m · 2^-9 (m = 8 is the smallest normal, code 0x08).
    const unsigned int e = a >> 23;
    const unsigned int mant = (a & 0x7fffffu) | 0x800000u;
    return sign | fp8_shift_rne(mant, 141u - e);
}

// An element of x as a float (the f32 and bf16 kernels below share one body).
__device__ __forceinline__ float fp8_load(const float* x, long long i) { return x[i]; }
__device__ __forceinline__ float fp8_load(const bf16* x, long long i) { return bf2f(x[i]); }

// stats[0] = max(stats[0], max |x|) over n elements (grid-stride; one atomic per warp).
template <typename T>
__device__ __forceinline__ void fp8_amax(float* stats, const T* x, long long n) {
    float m = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        m = fmaxf(m, fabsf(fp8_load(x, i)));
    }
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) {
        atomicMax((unsigned int*)stats, __float_as_uint(m));
    }
}

extern "C" __global__ void fp8_amax_f32(float* __restrict__ stats, const float* __restrict__ x,
                                        long long n) {
    fp8_amax(stats, x, n);
}

extern "C" __global__ void fp8_amax_bf16(float* __restrict__ stats, const bf16* __restrict__ x,
                                         long long n) {
    fp8_amax(stats, x, n);
}

// stats[1] = 448 / stats[0] (1 when amax is 0, FLT_MAX when the quotient overflows), stats[2] =
// 1 / stats[1]; IEEE-rounded divisions, as the CPU reference's. One thread does it.
extern "C" __global__ void fp8_scale(float* __restrict__ stats) {
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    const float amax = stats[0];
    float s = amax == 0.0f ? 1.0f : __fdiv_rn(448.0f, amax);
    if (__float_as_uint(s) == 0x7f800000u) {
        s = __uint_as_float(0x7f7fffffu);
    }
    stats[1] = s;
    stats[2] = __fdiv_rn(1.0f, s);
}

// out[i] = the codes of x[4i .. 4i + 4] · stats[1], packed little-endian; `words` = n / 4.
template <typename T>
__device__ __forceinline__ void fp8_cast(unsigned int* out, const T* x, const float* stats,
                                         long long words) {
    const float s = stats[1];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned int w = 0u;
        for (int b = 0; b < 4; b++) {
            w |= to_e4m3(__fmul_rn(fp8_load(x, 4 * i + b), s)) << (8 * b);
        }
        out[i] = w;
    }
}

extern "C" __global__ void fp8_cast_f32(unsigned int* __restrict__ out,
                                        const float* __restrict__ x,
                                        const float* __restrict__ stats, long long words) {
    fp8_cast(out, x, stats, words);
}

extern "C" __global__ void fp8_cast_bf16(unsigned int* __restrict__ out,
                                         const bf16* __restrict__ x,
                                         const float* __restrict__ stats, long long words) {
    fp8_cast(out, x, stats, words);
}
