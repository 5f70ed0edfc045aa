// runtime.cu: the raw kernels tandem's CUDA runtime itself needs: fill, strided copy (and with it
// `contiguous()`), casts between dtypes, scale, add_scaled (gradient accumulation, optimizer
// updates) and the partial sums of a p-norm (gradient clipping). Their launches are built in
// core/src/cuda/runtime_kernels.rs; the semantics are the CPU's in core/src/access.rs.
//
// Destinations are strided; the launch builders refuse destinations whose elements overlap, so
// each element is written by exactly one thread.

#include "tandem.cuh"

// dst[layout(i)] = value for every element i.
template <typename T>
TANDEM_FN void fill_impl(T* dst, const tandem_layout& dst_layout, tandem_u64 n, T value) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        dst[tandem_layout_index(dst_layout, i)] = value;
    }
}

// dst[dst_layout(i)] = convert(src[src_layout(i)]): copies when the types match.
template <typename D, typename S>
TANDEM_FN void cast_impl(D* dst, const tandem_layout& dst_layout, const S* src,
                         const tandem_layout& src_layout, tandem_u64 n) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        S value = src[tandem_layout_index(src_layout, i)];
        dst[tandem_layout_index(dst_layout, i)] = tandem_from_f64<D>(tandem_to_f64(value));
    }
}

template <typename T>
TANDEM_FN void copy_impl(T* dst, const tandem_layout& dst_layout, const T* src,
                         const tandem_layout& src_layout, tandem_u64 n) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        dst[tandem_layout_index(dst_layout, i)] = src[tandem_layout_index(src_layout, i)];
    }
}

// x *= factor, computed in the dtype's compute type.
template <typename T>
TANDEM_FN void scale_impl(T* dst, const tandem_layout& dst_layout, tandem_u64 n,
                          typename tandem_compute<T>::type factor) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        tandem_u64 at = tandem_layout_index(dst_layout, i);
        dst[at] = tandem_store<T>(tandem_load(dst[at]) * factor);
    }
}

// dst += alpha * src, rounding the product first as the CPU does (no fused multiply-add).
template <typename T>
TANDEM_FN void add_scaled_impl(T* dst, const tandem_layout& dst_layout, const T* src,
                               const tandem_layout& src_layout, tandem_u64 n,
                               typename tandem_compute<T>::type alpha) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        tandem_u64 at = tandem_layout_index(dst_layout, i);
        typename tandem_compute<T>::type s = tandem_load(src[tandem_layout_index(src_layout, i)]);
        dst[at] = tandem_store<T>(tandem_load(dst[at]) + tandem_mul_rn(alpha, s));
    }
}

// The kinds of norm_partial (`NormKind` in runtime_kernels.rs).
#define TANDEM_NORM_SUM_SQUARES 0
#define TANDEM_NORM_SUM_ABS 1
#define TANDEM_NORM_MAX_ABS 2
#define TANDEM_NORM_SUM_POW 3

// partials[blockIdx.x] = this block's share of sum |x|^p (or max |x|), in double. Each block
// reduces a fixed set of elements in a fixed order, so the result is deterministic for a given
// launch configuration.
template <typename T>
TANDEM_FN void norm_partial_impl(const T* src, const tandem_layout& src_layout, tandem_u64 n,
                                 int kind, double p, double* partials) {
    __shared__ double scratch[32];
    double acc = 0.0;
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        double x = fabs(tandem_to_f64(src[tandem_layout_index(src_layout, i)]));
        if (kind == TANDEM_NORM_SUM_SQUARES) {
            acc += tandem_mul_rn(x, x);
        } else if (kind == TANDEM_NORM_SUM_ABS) {
            acc += x;
        } else if (kind == TANDEM_NORM_MAX_ABS) {
            acc = tandem_max_nan_op()(acc, x);
        } else {
            acc += pow(x, p);
        }
    }
    double total = kind == TANDEM_NORM_MAX_ABS
                       ? tandem_block_reduce(acc, tandem_max_nan_op(), 0.0, scratch)
                       : tandem_block_reduce(acc, tandem_sum_op(), 0.0, scratch);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = total;
    }
}

// out[0] = the sum (or the maximum) of partials[0..count), by one block, in a fixed order.
// `count` is 32-bit: its launch builder checks it with index_u32.
extern "C" __global__ void norm_finish(const double* partials, tandem_u32 count, int kind,
                                       double* out) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (tandem_u32 i = threadIdx.x; i < count; i += blockDim.x) {
        acc = kind == TANDEM_NORM_MAX_ABS ? tandem_max_nan_op()(acc, partials[i]) : acc + partials[i];
    }
    double total = kind == TANDEM_NORM_MAX_ABS
                       ? tandem_block_reduce(acc, tandem_max_nan_op(), 0.0, scratch)
                       : tandem_block_reduce(acc, tandem_sum_op(), 0.0, scratch);
    if (threadIdx.x == 0) {
        out[0] = total;
    }
}
TANDEM_HOST_EXPORT(norm_finish)

// ---------------------------------------------------------------------------------------------
// Instantiations: <op>_<dtype>.
// ---------------------------------------------------------------------------------------------

#define TANDEM_RUNTIME_ANY_DTYPE(NAME, T)                                                      \
    extern "C" __global__ void fill_##NAME(T* dst, tandem_layout dst_layout, tandem_u64 n,     \
                                           T value) {                                          \
        fill_impl<T>(dst, dst_layout, n, value);                                               \
    }                                                                                          \
    TANDEM_HOST_EXPORT(fill_##NAME)                                                            \
    extern "C" __global__ void copy_##NAME(T* dst, tandem_layout dst_layout, const T* src,     \
                                           tandem_layout src_layout, tandem_u64 n) {           \
        copy_impl<T>(dst, dst_layout, src, src_layout, n);                                     \
    }                                                                                          \
    TANDEM_HOST_EXPORT(copy_##NAME)

TANDEM_RUNTIME_ANY_DTYPE(f32, float)
TANDEM_RUNTIME_ANY_DTYPE(f64, double)
TANDEM_RUNTIME_ANY_DTYPE(f16, tandem_f16)
TANDEM_RUNTIME_ANY_DTYPE(bf16, tandem_bf16)
TANDEM_RUNTIME_ANY_DTYPE(i64, tandem_i64)
TANDEM_RUNTIME_ANY_DTYPE(u8, tandem_u8)

#define TANDEM_RUNTIME_FLOAT_DTYPE(NAME, T)                                                    \
    extern "C" __global__ void scale_##NAME(T* dst, tandem_layout dst_layout, tandem_u64 n,    \
                                            tandem_compute<T>::type factor) {                  \
        scale_impl<T>(dst, dst_layout, n, factor);                                             \
    }                                                                                          \
    TANDEM_HOST_EXPORT(scale_##NAME)                                                           \
    extern "C" __global__ void add_scaled_##NAME(T* dst, tandem_layout dst_layout,             \
                                                 const T* src, tandem_layout src_layout,       \
                                                 tandem_u64 n,                                 \
                                                 tandem_compute<T>::type alpha) {              \
        add_scaled_impl<T>(dst, dst_layout, src, src_layout, n, alpha);                        \
    }                                                                                          \
    TANDEM_HOST_EXPORT(add_scaled_##NAME)                                                      \
    extern "C" __global__ void norm_partial_##NAME(const T* src, tandem_layout src_layout,     \
                                                   tandem_u64 n, int kind, double p,           \
                                                   double* partials) {                         \
        norm_partial_impl<T>(src, src_layout, n, kind, p, partials);                           \
    }                                                                                          \
    TANDEM_HOST_EXPORT(norm_partial_##NAME)

TANDEM_RUNTIME_FLOAT_DTYPE(f32, float)
TANDEM_RUNTIME_FLOAT_DTYPE(f64, double)
TANDEM_RUNTIME_FLOAT_DTYPE(f16, tandem_f16)
TANDEM_RUNTIME_FLOAT_DTYPE(bf16, tandem_bf16)

// cast_<from>_<to> for every pair of different dtypes.
#define TANDEM_CAST(FROM_NAME, FROM, TO_NAME, TO)                                              \
    extern "C" __global__ void cast_##FROM_NAME##_##TO_NAME(                                   \
        TO* dst, tandem_layout dst_layout, const FROM* src, tandem_layout src_layout,          \
        tandem_u64 n) {                                                                        \
        cast_impl<TO, FROM>(dst, dst_layout, src, src_layout, n);                              \
    }                                                                                          \
    TANDEM_HOST_EXPORT(cast_##FROM_NAME##_##TO_NAME)

// Every pair of different dtypes (a "cast" to the same dtype is copy_<dtype>).
TANDEM_CAST(f32, float, f64, double)
TANDEM_CAST(f32, float, f16, tandem_f16)
TANDEM_CAST(f32, float, bf16, tandem_bf16)
TANDEM_CAST(f32, float, i64, tandem_i64)
TANDEM_CAST(f32, float, u8, tandem_u8)
TANDEM_CAST(f64, double, f32, float)
TANDEM_CAST(f64, double, f16, tandem_f16)
TANDEM_CAST(f64, double, bf16, tandem_bf16)
TANDEM_CAST(f64, double, i64, tandem_i64)
TANDEM_CAST(f64, double, u8, tandem_u8)
TANDEM_CAST(f16, tandem_f16, f32, float)
TANDEM_CAST(f16, tandem_f16, f64, double)
TANDEM_CAST(f16, tandem_f16, bf16, tandem_bf16)
TANDEM_CAST(f16, tandem_f16, i64, tandem_i64)
TANDEM_CAST(f16, tandem_f16, u8, tandem_u8)
TANDEM_CAST(bf16, tandem_bf16, f32, float)
TANDEM_CAST(bf16, tandem_bf16, f64, double)
TANDEM_CAST(bf16, tandem_bf16, f16, tandem_f16)
TANDEM_CAST(bf16, tandem_bf16, i64, tandem_i64)
TANDEM_CAST(bf16, tandem_bf16, u8, tandem_u8)
TANDEM_CAST(i64, tandem_i64, f32, float)
TANDEM_CAST(i64, tandem_i64, f64, double)
TANDEM_CAST(i64, tandem_i64, f16, tandem_f16)
TANDEM_CAST(i64, tandem_i64, bf16, tandem_bf16)
TANDEM_CAST(i64, tandem_i64, u8, tandem_u8)
TANDEM_CAST(u8, tandem_u8, f32, float)
TANDEM_CAST(u8, tandem_u8, f64, double)
TANDEM_CAST(u8, tandem_u8, f16, tandem_f16)
TANDEM_CAST(u8, tandem_u8, bf16, tandem_bf16)
TANDEM_CAST(u8, tandem_u8, i64, tandem_i64)
