// adam.cu: one Adam or AdamW step over every tensor of a table, in place, for tensors that all
// take their `t`-th update (the host groups tensors by their step count, so the bias
// corrections are launch arguments computed on the host exactly as the CPU computes them). The
// launch is built by `adam_launch` in optim/src/multi_tensor/plans.rs; the arithmetic is the CPU
// kernel's (optim/src/adam/cpu.rs) operation for operation, every product rounded on its own
// (tandem_mul_rn), so the two agree bit for bit.
//
// Per element, with g the gradient, m, v, v_max the state:
//   g = g + l2 * p                                   (Adam's weight decay, when decay)
//   p = p * shrink                                   (AdamW's decoupled weight decay, when shrinks)
//   m = m + (1 - beta1) * (g - m)
//   v = beta2 * v + ((1 - beta2) * g) * g
//   v_max = max(v_max, v), used instead of v         (when amsgrad)
//   p = p - step_size * (m / (sqrt(v) / bias_correction2_sqrt + eps))

#include "tandem.cuh"
#include "multi_tensor.cuh"

template <typename T>
TANDEM_FN void adam_step_impl(const optim_tensor* table, tandem_u32 tensors, tandem_u64 chunks,
                              tandem_u64 chunk_size, T one_minus_beta1, T beta2,
                              T one_minus_beta2, T l2, T shrink, T eps, T step_size,
                              T bias_correction2_sqrt, int decay, int shrinks, int amsgrad) {
    OPTIM_FOR_EACH_CHUNK(c, chunks) {
        optim_chunk chunk = optim_chunk_at(table, tensors, chunk_size, c);
        T* p = optim_ptr<T>(chunk.tensor->param);
        const T* g = optim_ptr<T>(chunk.tensor->grad);
        T* m = optim_ptr<T>(chunk.tensor->state[0]);
        T* v = optim_ptr<T>(chunk.tensor->state[1]);
        T* v_max = optim_ptr<T>(chunk.tensor->state[2]);
        OPTIM_FOR_EACH_ELEMENT(i, chunk) {
            T pi = p[i];
            T gi = g[i];
            if (decay) {
                gi = gi + tandem_mul_rn(l2, pi);
            }
            if (shrinks) {
                pi = tandem_mul_rn(pi, shrink);
            }
            T mi = m[i];
            mi = mi + tandem_mul_rn(one_minus_beta1, gi - mi);
            m[i] = mi;
            T vi = tandem_mul_rn(beta2, v[i]) + tandem_mul_rn(tandem_mul_rn(one_minus_beta2, gi), gi);
            v[i] = vi;
            T second = vi;
            if (amsgrad) {
                T largest = v_max[i];
                if (vi > largest) {
                    largest = vi;
                    v_max[i] = largest;
                }
                second = largest;
            }
            T denom = optim_sqrt(second) / bias_correction2_sqrt + eps;
            p[i] = pi - tandem_mul_rn(step_size, mi / denom);
        }
    }
}

#define OPTIM_ADAM(NAME, T)                                                                    \
    extern "C" __global__ void adam_step_##NAME(                                               \
        const optim_tensor* table, tandem_u32 tensors, tandem_u64 chunks,                      \
        tandem_u64 chunk_size, T one_minus_beta1, T beta2, T one_minus_beta2, T l2, T shrink,  \
        T eps, T step_size, T bias_correction2_sqrt, int decay, int shrinks, int amsgrad) {    \
        adam_step_impl<T>(table, tensors, chunks, chunk_size, one_minus_beta1, beta2,          \
                          one_minus_beta2, l2, shrink, eps, step_size, bias_correction2_sqrt,  \
                          decay, shrinks, amsgrad);                                            \
    }                                                                                          \
    TANDEM_HOST_EXPORT(adam_step_##NAME)

OPTIM_ADAM(f32, float)
OPTIM_ADAM(f64, double)
