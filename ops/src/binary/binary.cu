// binary.cu: the elementwise binary ops of ops/src/binary on CUDA: add, sub, mul and div with
// broadcasting, add_relu (the residual join of a ResNet block) and the scalar forms add_scalar
// and mul_scalar. Launches are built in binary/cuda.rs.
//
// Each op has two kernels per dtype: `<op>_<dtype>` for dense operands (16-byte packs when the
// pointers are aligned, see tandem_zip_dense), and `<op>_strided_<dtype>` for operands read
// through their layouts (transposed, narrowed, or broadcast with stride 0). The output is always
// a fresh dense tensor. Each result is the one IEEE operation the CPU kernel performs, so the
// two agree bit for bit; the scalar forms compute in double and round once, as the CPU does.

#include "tandem.cuh"

struct binary_add {
    template <typename T>
    TANDEM_FN T operator()(T a, T b) const {
        return a + b;
    }
};

struct binary_sub {
    template <typename T>
    TANDEM_FN T operator()(T a, T b) const {
        return a - b;
    }
};

struct binary_mul {
    template <typename T>
    TANDEM_FN T operator()(T a, T b) const {
        return a * b;
    }
};

struct binary_div {
    template <typename T>
    TANDEM_FN T operator()(T a, T b) const {
        return a / b;
    }
};

// max(0, a + b); `s < 0 ? 0 : s` keeps a NaN sum NaN, as relu does.
struct binary_add_relu {
    template <typename T>
    TANDEM_FN T operator()(T a, T b) const {
        T s = a + b;
        return s < (T)0 ? (T)0 : s;
    }
};

// x + c, in double, rounded once to T (the CPU's `T::from_f64(x.to_f64() + c)`).
struct binary_add_scalar {
    double c;
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return (T)((double)x + c);
    }
};

// x * c, in double, rounded once to T.
struct binary_mul_scalar {
    double c;
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return (T)((double)x * c);
    }
};

#define TANDEM_BINARY(NAME, OP, DT, T)                                                         \
    extern "C" __global__ void NAME##_##DT(T* out, const T* a, const T* b, tandem_u64 n) {     \
        tandem_zip_dense(out, a, b, n, OP());                                                  \
    }                                                                                          \
    TANDEM_HOST_EXPORT(NAME##_##DT)                                                            \
    extern "C" __global__ void NAME##_strided_##DT(T* out, const T* a, tandem_layout a_layout, \
                                                   const T* b, tandem_layout b_layout,         \
                                                   tandem_u64 n) {                             \
        tandem_zip_strided(out, a, a_layout, b, b_layout, n, OP());                            \
    }                                                                                          \
    TANDEM_HOST_EXPORT(NAME##_strided_##DT)

#define TANDEM_BINARY_SCALAR(NAME, OP, DT, T)                                                  \
    extern "C" __global__ void NAME##_##DT(T* out, const T* x, tandem_u64 n, double c) {       \
        OP f;                                                                                  \
        f.c = c;                                                                               \
        tandem_map_dense(out, x, n, f);                                                        \
    }                                                                                          \
    TANDEM_HOST_EXPORT(NAME##_##DT)                                                            \
    extern "C" __global__ void NAME##_strided_##DT(T* out, const T* x, tandem_layout x_layout, \
                                                   tandem_u64 n, double c) {                   \
        OP f;                                                                                  \
        f.c = c;                                                                               \
        tandem_map_strided(out, x, x_layout, n, f);                                            \
    }                                                                                          \
    TANDEM_HOST_EXPORT(NAME##_strided_##DT)

#define TANDEM_BINARY_DTYPE(DT, T)                                                             \
    TANDEM_BINARY(add, binary_add, DT, T)                                                      \
    TANDEM_BINARY(sub, binary_sub, DT, T)                                                      \
    TANDEM_BINARY(mul, binary_mul, DT, T)                                                      \
    TANDEM_BINARY(div, binary_div, DT, T)                                                      \
    TANDEM_BINARY(add_relu, binary_add_relu, DT, T)                                            \
    TANDEM_BINARY_SCALAR(add_scalar, binary_add_scalar, DT, T)                                 \
    TANDEM_BINARY_SCALAR(mul_scalar, binary_mul_scalar, DT, T)

TANDEM_BINARY_DTYPE(f32, float)
TANDEM_BINARY_DTYPE(f64, double)
