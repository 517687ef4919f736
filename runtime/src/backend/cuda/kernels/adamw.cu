// AdamW with decoupled weight decay on fp32 master weights and fp32 moments (runtime/src/optim.rs
// is the reference; the bias corrections bc1, bc2 are computed on the host exactly as there).
// Also refreshes the bf16 working copy of the weights when `params_bf16` is not null.
// One launch per run of tensors with the same weight decay.
// The products are __fmul_rn and their sums __fadd_rn, which the compiler never fuses into an
// FMA (NVRTC runs with --fmad=true): each operation rounds as the host's AdamW rounds it, so a
// step offloaded to the host (runtime/src/exec/offload.rs) gives the same f32 bits as this one.

extern "C" __global__ void adamw_step(float* __restrict__ master, bf16* __restrict__ params_bf16,
                                      const float* __restrict__ grads, float* __restrict__ m,
                                      float* __restrict__ v, long long n, float lr,
                                      float beta1, float beta2, float eps, float weight_decay,
                                      float bc1, float bc2, float grad_scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = grads[i] * grad_scale;
        const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(1.0f - beta1, g));
        const float vi =
            __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(1.0f - beta2, g), g));
        m[i] = mi;
        v[i] = vi;
        const float mh = mi / bc1;
        const float vh = vi / bc2;
        float p = master[i];
        p -= __fmul_rn(lr, __fadd_rn(mh / (sqrtf(vh) + eps), __fmul_rn(weight_decay, p)));
        master[i] = p;
        if (params_bf16 != 0) {
            params_bf16[i] = f2bf(p);
        }
    }
}
