// sgd.cu: one SGD step over every tensor of a table (momentum, dampening, Nesterov, weight
// decay), in place. The launch is built by `sgd_launch` in optim/src/multi_tensor/plans.rs;
// the arithmetic is the CPU kernel's (optim/src/sgd/cpu.rs) operation for operation, every
// product rounded on its own (tandem_mul_rn) because the CPU never fuses a multiply-add, so the
// two agree bit for bit.
//
// Per element, with d the gradient:
//   d = d + weight_decay * p                         (when decay)
//   b = first ? d : momentum * b + keep * d          (when momentum; keep = 1 - dampening)
//   d = nesterov ? d + momentum * b : b              (when momentum)
//   p = p - lr * d

#include "tandem.cuh"
#include "multi_tensor.cuh"

template <typename T>
TANDEM_FN void sgd_step_impl(const optim_tensor* table, tandem_u32 tensors, tandem_u64 chunks,
                             tandem_u64 chunk_size, T lr, T momentum, T keep, T weight_decay,
                             int decay, int has_momentum, int first, int nesterov) {
    OPTIM_FOR_EACH_CHUNK(c, chunks) {
        optim_chunk chunk = optim_chunk_at(table, tensors, chunk_size, c);
        T* p = optim_ptr<T>(chunk.tensor->param);
        const T* g = optim_ptr<T>(chunk.tensor->grad);
        T* buffer = optim_ptr<T>(chunk.tensor->state[0]);
        OPTIM_FOR_EACH_ELEMENT(i, chunk) {
            T pi = p[i];
            T d = g[i];
            if (decay) {
                d = d + tandem_mul_rn(weight_decay, pi);
            }
            if (has_momentum) {
                T b = first ? d : tandem_mul_rn(momentum, buffer[i]) + tandem_mul_rn(keep, d);
                buffer[i] = b;
                d = nesterov ? d + tandem_mul_rn(momentum, b) : b;
            }
            p[i] = pi - tandem_mul_rn(lr, d);
        }
    }
}

#define OPTIM_SGD(NAME, T)                                                                     \
    extern "C" __global__ void sgd_step_##NAME(                                                \
        const optim_tensor* table, tandem_u32 tensors, tandem_u64 chunks,                      \
        tandem_u64 chunk_size, T lr, T momentum, T keep, T weight_decay, int decay,            \
        int has_momentum, int first, int nesterov) {                                           \
        sgd_step_impl<T>(table, tensors, chunks, chunk_size, lr, momentum, keep, weight_decay, \
                         decay, has_momentum, first, nesterov);                                \
    }                                                                                          \
    TANDEM_HOST_EXPORT(sgd_step_##NAME)

OPTIM_SGD(f32, float)
OPTIM_SGD(f64, double)
