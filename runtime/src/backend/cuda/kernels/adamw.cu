// AdamW with decoupled weight decay on fp32 master weights and fp32 moments (runtime/src/optim.rs
// is the reference; the bias corrections bc1, bc2 are computed on the host exactly as there).
// Also refreshes the bf16 working copy of the weights when `params_bf16` is not null.
// One launch per run of tensors with the same weight decay.

extern "C" __global__ void adamw_step(float* __restrict__ master, bf16* __restrict__ params_bf16,
                                      const float* __restrict__ grads, float* __restrict__ m,
                                      float* __restrict__ v, long long n, float lr,
                                      float beta1, float beta2, float eps, float weight_decay,
                                      float bc1, float bc2, float grad_scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = grads[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        const float mh = mi / bc1;
        const float vh = vi / bc2;
        float p = master[i];
        p -= lr * (mh / (sqrtf(vh) + eps) + weight_decay * p);
        master[i] = p;
        if (params_bf16 != 0) {
            params_bf16[i] = f2bf(p);
        }
    }
}
