// grads.cu: kernels over every gradient of a table: the partial sums of a p-norm (gradient
// clipping's first pass), scaling by the clip coefficient read from device memory (its last
// pass), zeroing (zero_grad), and the gradient scaler's fused unscale and inf/NaN check.
// Launches are built in optim/src/multi_tensor/plans.rs.
//
// Clipping runs without the host: grad_norm_partial writes one partial per chunk, the runtime's
// norm_finish (core/src/cuda/kernels/runtime.cu) reduces them into one value in device memory,
// and grad_clip_scale reads that value, finishes the norm and scales when needed. Partials are
// per chunk, not per block, so the norm does not depend on the grid, and each chunk is reduced
// in a fixed order: the result is deterministic.

#include "tandem.cuh"
#include "multi_tensor.cuh"

// The kinds of norm (`NormKind` in core/src/cuda/runtime_kernels.rs, numbered as runtime.cu
// numbers them, since norm_finish reduces these partials).
#define OPTIM_NORM_SUM_SQUARES 0
#define OPTIM_NORM_SUM_ABS 1
#define OPTIM_NORM_MAX_ABS 2
#define OPTIM_NORM_SUM_POW 3

// partials[c] = chunk c's share of sum |x|^p (or max |x|, a NaN winning), in double.
template <typename T>
TANDEM_FN void grad_norm_partial_impl(const optim_tensor* table, tandem_u32 tensors,
                                      tandem_u64 chunks, tandem_u64 chunk_size, int kind,
                                      double p, double* partials) {
    __shared__ double scratch[32];
    OPTIM_FOR_EACH_CHUNK(c, chunks) {
        optim_chunk chunk = optim_chunk_at(table, tensors, chunk_size, c);
        const T* g = optim_ptr<T>(chunk.tensor->grad);
        double acc = 0.0;
        OPTIM_FOR_EACH_ELEMENT(i, chunk) {
            double x = fabs(tandem_to_f64(g[i]));
            if (kind == OPTIM_NORM_SUM_SQUARES) {
                acc += tandem_mul_rn(x, x);
            } else if (kind == OPTIM_NORM_SUM_ABS) {
                acc += x;
            } else if (kind == OPTIM_NORM_MAX_ABS) {
                acc = tandem_max_nan_op()(acc, x);
            } else {
                acc += pow(x, p);
            }
        }
        double total = kind == OPTIM_NORM_MAX_ABS
                           ? tandem_block_reduce(acc, tandem_max_nan_op(), 0.0, scratch)
                           : tandem_block_reduce(acc, tandem_sum_op(), 0.0, scratch);
        if (threadIdx.x == 0) {
            partials[c] = total;
        }
    }
}

// Whether x is neither infinite nor NaN (by its exponent bits: exact on every compiler).
TANDEM_FN bool optim_is_finite(double x) {
    return ((tandem_u64)__double_as_longlong(x) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// The norm from the reduced value.
TANDEM_FN double optim_norm_finish(int kind, double p, double reduced) {
    if (kind == OPTIM_NORM_SUM_SQUARES) {
        return sqrt(reduced);
    }
    if (kind == OPTIM_NORM_SUM_POW) {
        return pow(reduced, 1.0 / p);
    }
    return reduced;
}

// Reads the reduced value at `reduced`, finishes the norm (block 0's thread 0 stores it at
// `norm_out` unless that is null), and, when it is finite and max_norm / (norm + 1e-6) < 1,
// multiplies every gradient by that coefficient converted to T (as the CPU's scale_ does).
// A non-finite norm leaves every gradient untouched: the host reports it as an error.
template <typename T>
TANDEM_FN void grad_clip_scale_impl(const optim_tensor* table, tandem_u32 tensors,
                                    tandem_u64 chunks, tandem_u64 chunk_size,
                                    const double* reduced, int kind, double p, double max_norm,
                                    double* norm_out) {
    double total = optim_norm_finish(kind, p, *reduced);
    if (norm_out != 0 && blockIdx.x == 0 && threadIdx.x == 0) {
        *norm_out = total;
    }
    if (!optim_is_finite(total)) {
        return;
    }
    double coefficient = max_norm / (total + 1e-6);
    if (!(coefficient < 1.0)) {
        return;
    }
    T factor = tandem_from_f64<T>(coefficient);
    OPTIM_FOR_EACH_CHUNK(c, chunks) {
        optim_chunk chunk = optim_chunk_at(table, tensors, chunk_size, c);
        T* g = optim_ptr<T>(chunk.tensor->grad);
        OPTIM_FOR_EACH_ELEMENT(i, chunk) {
            g[i] = g[i] * factor;
        }
    }
}

template <typename T>
TANDEM_FN void grad_zero_impl(const optim_tensor* table, tandem_u32 tensors, tandem_u64 chunks,
                              tandem_u64 chunk_size) {
    OPTIM_FOR_EACH_CHUNK(c, chunks) {
        optim_chunk chunk = optim_chunk_at(table, tensors, chunk_size, c);
        T* g = optim_ptr<T>(chunk.tensor->grad);
        OPTIM_FOR_EACH_ELEMENT(i, chunk) {
            g[i] = (T)0;
        }
    }
}

// The gradient scaler's unscale (optim/src/scaler): every gradient multiplied by `inv_scale`
// (1 / scale, converted to T on the host as the CPU converts it), and `*found_inf` raised to 1
// when any gradient holds an infinity or a NaN, checked on the value before the multiplication
// (as PyTorch's _amp_foreach_non_finite_check_and_unscale_). Every element is unscaled even
// after one is found non-finite: the step will be skipped and the gradients zeroed anyway. Each
// thread remembers what it saw and raises the flag once, atomically, at the end, so the flag
// is the only value the host reads back per step, and only the caller zeroes it.
template <typename T>
TANDEM_FN void grad_unscale_impl(const optim_tensor* table, tandem_u32 tensors,
                                 tandem_u64 chunks, tandem_u64 chunk_size, T inv_scale,
                                 tandem_i64* found_inf) {
    bool found = false;
    OPTIM_FOR_EACH_CHUNK(c, chunks) {
        optim_chunk chunk = optim_chunk_at(table, tensors, chunk_size, c);
        T* g = optim_ptr<T>(chunk.tensor->grad);
        OPTIM_FOR_EACH_ELEMENT(i, chunk) {
            T x = g[i];
            if (!optim_is_finite(tandem_to_f64(x))) {
                found = true;
            }
            g[i] = x * inv_scale;
        }
    }
    if (found) {
        atomicMax(found_inf, (tandem_i64)1);
    }
}

#define OPTIM_GRADS(NAME, T)                                                                   \
    extern "C" __global__ void grad_norm_partial_##NAME(                                       \
        const optim_tensor* table, tandem_u32 tensors, tandem_u64 chunks,                      \
        tandem_u64 chunk_size, int kind, double p, double* partials) {                         \
        grad_norm_partial_impl<T>(table, tensors, chunks, chunk_size, kind, p, partials);      \
    }                                                                                          \
    TANDEM_HOST_EXPORT(grad_norm_partial_##NAME)                                               \
    extern "C" __global__ void grad_clip_scale_##NAME(                                         \
        const optim_tensor* table, tandem_u32 tensors, tandem_u64 chunks,                      \
        tandem_u64 chunk_size, const double* reduced, int kind, double p, double max_norm,     \
        double* norm_out) {                                                                    \
        grad_clip_scale_impl<T>(table, tensors, chunks, chunk_size, reduced, kind, p,          \
                                max_norm, norm_out);                                           \
    }                                                                                          \
    TANDEM_HOST_EXPORT(grad_clip_scale_##NAME)                                                 \
    extern "C" __global__ void grad_zero_##NAME(const optim_tensor* table, tandem_u32 tensors, \
                                                tandem_u64 chunks, tandem_u64 chunk_size) {    \
        grad_zero_impl<T>(table, tensors, chunks, chunk_size);                                 \
    }                                                                                          \
    TANDEM_HOST_EXPORT(grad_zero_##NAME)                                                       \
    extern "C" __global__ void grad_unscale_##NAME(                                            \
        const optim_tensor* table, tandem_u32 tensors, tandem_u64 chunks,                      \
        tandem_u64 chunk_size, T inv_scale, tandem_i64* found_inf) {                           \
        grad_unscale_impl<T>(table, tensors, chunks, chunk_size, inv_scale, found_inf);        \
    }                                                                                          \
    TANDEM_HOST_EXPORT(grad_unscale_##NAME)

OPTIM_GRADS(f32, float)
OPTIM_GRADS(f64, double)
