// Softmax cross-entropy over (a shard of) the vocabulary; runtime/src/backend/cpu/kernels/crossentropy.rs is
// the reference. logits: (N, V) bf16 (V = this shard's width); targets: (N) u32 global ids;
// max, sumexp, losses, dlosses: (N) fp32. One block per row (grid.x = N).
//
// Vocab-parallel use: `crossentropy_row_max`, `crossentropy_partials` and `crossentropy_losses`
// around the group's all-reduces (below), then `crossentropy_backward` with the GLOBAL max and
// sumexp. Single shard: `crossentropy_forward`,
// or `crossentropy_fused`, which writes the loss and the gradient in one launch.

// Online softmax statistics of one row, block-wide: every thread gets (max, sumexp).
__device__ void row_stats(const bf16* l, int v, float* scratch, float* out_max,
                          float* out_sumexp) {
    float m = TS_NEG_INF;
    float s = 0.0f;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        const float x = bf2f(l[i]);
        if (x > m) {
            s = s * expf(m - x) + 1.0f;
            m = x;
        } else {
            s += expf(x - m);
        }
    }
    const float gm = block_max(m, scratch);
    const float mine = m == TS_NEG_INF ? 0.0f : s * expf(m - gm);
    *out_sumexp = block_sum(mine, scratch);
    *out_max = gm;
}

__device__ float target_logit(const bf16* l, unsigned int target, long long vocab_start,
                              int v) {
    const long long t = (long long)target - vocab_start;
    return (t >= 0 && t < v) ? bf2f(l[t]) : 0.0f;
}

// The vocab-parallel forward as the executor runs it (`layers/loss.rs`), in three launches
// around two all-reduces: `crossentropy_row_max` (this shard's row maxima; all-reduced as a
// max), `crossentropy_partials` (sum exp(l - M) against the GLOBAL max M, and the target logit,
// as [sumexp (N) | target (N)]; all-reduced as a sum), then `crossentropy_losses`.
extern "C" __global__ void crossentropy_row_max(float* __restrict__ max,
                                                const bf16* __restrict__ logits,
                                                long long n_rows, int v) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    const bf16* l = logits + row * v;
    float m = TS_NEG_INF;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        m = fmaxf(m, bf2f(l[i]));
    }
    const float gm = block_max(m, scratch);
    if (threadIdx.x == 0) {
        max[row] = gm;
    }
}

extern "C" __global__ void crossentropy_partials(float* __restrict__ both,
                                                 const bf16* __restrict__ logits,
                                                 const float* __restrict__ max,
                                                 const unsigned int* __restrict__ targets,
                                                 long long n_rows, int v,
                                                 long long vocab_start) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    const bf16* l = logits + row * v;
    const float m = max[row];
    float s = 0.0f;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        s += expf(bf2f(l[i]) - m);
    }
    const float total = block_sum(s, scratch);
    if (threadIdx.x == 0) {
        both[row] = total;
        both[n_rows + row] = target_logit(l, targets[row], vocab_start, v);
    }
}

// losses[n] = ln(sumexp) + max - target, sumexp saved, from the group-summed [sumexp | target].
extern "C" __global__ void crossentropy_losses(float* __restrict__ losses,
                                               float* __restrict__ sumexp,
                                               const float* __restrict__ max,
                                               const float* __restrict__ both, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        sumexp[i] = both[i];
        losses[i] = logf(both[i]) + max[i] - both[n + i];
    }
}

// losses[n] = ln(sumexp) + max - logit[target] (single shard), saving max and sumexp.
extern "C" __global__ void crossentropy_forward(float* __restrict__ losses,
                                                float* __restrict__ max,
                                                float* __restrict__ sumexp,
                                                const bf16* __restrict__ logits,
                                                const unsigned int* __restrict__ targets,
                                                long long n_rows, int v) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    const bf16* l = logits + row * v;
    float m;
    float s;
    row_stats(l, v, scratch, &m, &s);
    if (threadIdx.x == 0) {
        max[row] = m;
        sumexp[row] = s;
        losses[row] = logf(s) + m - target_logit(l, targets[row], 0, v);
    }
}

// In place allowed (dlogits == logits): dlogits = (softmax - onehot(target)) * dloss.
extern "C" __global__ void crossentropy_backward(bf16* dlogits, const bf16* logits,
                                                 const float* __restrict__ max,
                                                 const float* __restrict__ sumexp,
                                                 const unsigned int* __restrict__ targets,
                                                 const float* __restrict__ dlosses,
                                                 long long n_rows, int v,
                                                 long long vocab_start) {
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    const float m = max[row];
    const float inv = 1.0f / sumexp[row];
    const float dl = dlosses[row];
    const long long t = (long long)targets[row] - vocab_start;
    const bf16* l = logits + row * v;
    bf16* d = dlogits + row * v;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        const float p = expf(bf2f(l[i]) - m) * inv;
        d[i] = f2bf((p - (i == t ? 1.0f : 0.0f)) * dl);
    }
}

// Single shard, one launch: losses[n] and, in place, the gradient over the logits.
extern "C" __global__ void crossentropy_fused(float* __restrict__ losses, bf16* logits,
                                              const unsigned int* __restrict__ targets,
                                              const float* __restrict__ dlosses,
                                              long long n_rows, int v) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    bf16* l = logits + row * v;
    float m;
    float s;
    row_stats(l, v, scratch, &m, &s);
    const unsigned int t = targets[row];
    // Every thread reads the target logit before any thread overwrites the row.
    const float tl = target_logit(l, t, 0, v);
    __syncthreads();
    if (threadIdx.x == 0) {
        losses[row] = logf(s) + m - tl;
    }
    const float inv = 1.0f / s;
    const float dl = dlosses[row];
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        const float p = expf(bf2f(l[i]) - m) * inv;
        l[i] = f2bf((p - (i == (long long)t ? 1.0f : 0.0f)) * dl);
    }
}
