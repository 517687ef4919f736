// Token and position embeddings (runtime/src/backend/cpu/kernels/embedding.rs is the reference).
// out: (N, C) bf16; tokens: (N) u32; wte: (V_local, C) bf16 rows vocab_start.. of the vocab.
// Backward accumulates into fp32 gradient tables.

// out[n] = wte[tokens[n] - vocab_start], or zeros when the token is in another shard.
extern "C" __global__ void embedding_forward(bf16* __restrict__ out,
                                             const unsigned int* __restrict__ tokens,
                                             const bf16* __restrict__ wte, long long n_rows,
                                             int c, long long vocab_start, long long v_local) {
    const long long total = n_rows * c;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long n = i / c;
        const long long r = (long long)tokens[n] - vocab_start;
        out[i] = (r >= 0 && r < v_local) ? wte[r * c + (i % c)] : (bf16)0;
    }
}

// out[row] += wpe[(first + row) % t]; out: (rows, C), the rows `first..` of the B*T tokens
// (first = 0, or a sequence-parallel rank's first row).
extern "C" __global__ void pos_embedding_forward(bf16* __restrict__ out,
                                                 const bf16* __restrict__ wpe, long long n_rows,
                                                 int t, int c, long long first) {
    const long long total = n_rows * c;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long pos = (first + i / c) % t;
        out[i] = f2bf(bf2f(out[i]) + bf2f(wpe[pos * c + (i % c)]));
    }
}

// dwte[token - vocab_start] += dout[rows of that token] for tokens in this shard. The rows are
// grouped by token on the host (`order`: row indices sorted by token, rows ascending within a
// token; bucket b is order[starts[b] .. starts[b+1]] with token tokens[b]). One thread per
// (bucket, channel) adds its rows in ascending order: deterministic, no atomics, the same order
// as the CPU kernel, and parallel over distinct tokens × channels (not one thread per channel).
extern "C" __global__ void embedding_backward(float* __restrict__ dwte,
                                              const unsigned int* __restrict__ order,
                                              const unsigned int* __restrict__ starts,
                                              const unsigned int* __restrict__ tokens,
                                              const bf16* __restrict__ dout, long long n_buckets,
                                              int c, long long vocab_start, long long v_local) {
    const long long total = n_buckets * c;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long b = i / c;
        const int ch = (int)(i % c);
        const long long r = (long long)tokens[b] - vocab_start;
        if (r < 0 || r >= v_local) {
            continue;
        }
        float acc = dwte[r * c + ch];
        for (unsigned int k = starts[b]; k < starts[b + 1]; k++) {
            acc += bf2f(dout[(long long)order[k] * c + ch]);
        }
        dwte[r * c + ch] = acc;
    }
}

// dwpe[t] += sum_b dout[b, t], batches in order. One thread per (t, channel).
extern "C" __global__ void pos_embedding_backward(float* __restrict__ dwpe,
                                                  const bf16* __restrict__ dout,
                                                  long long n_rows, int t, int c) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)t * c) {
        return;
    }
    const long long pos = i / c;
    const long long ch = i % c;
    float acc = 0.0f;
    for (long long row = pos; row < n_rows; row += t) {
        acc += bf2f(dout[row * c + ch]);
    }
    dwpe[i] += acc;
}
