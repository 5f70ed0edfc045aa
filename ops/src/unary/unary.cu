// unary.cu: the elementwise unary ops of ops/src/unary on CUDA, forward and backward. Launches
// are built in unary/cuda.rs.
//
// Forward kernels `<op>_<dtype>(out, x, n)` map a dense input (16-byte packs when aligned, see
// tandem_map_dense); `<op>_strided_<dtype>(out, x, x_layout, n)` read any layout. Backward
// kernels `<op>_backward_<dtype>(out, g, saved, n)` (and `_strided_`) combine the output
// gradient with what the forward saved: the output for exp, sqrt, relu, sigmoid and tanh, the
// input for log and pow_scalar. neg's backward is neg.
//
// The backward formulas and the forward of neg, sqrt, relu and integer powers are the CPU's
// operations in the CPU's order, with products that must not fuse into a following addition
// written with tandem_mul_rn, so they agree with the CPU bit for bit. exp, log, tanh, sigmoid
// and fractional powers use CUDA's math library, within a few ulp of the CPU's.

#include "tandem.cuh"

TANDEM_FN float unary_sqrt(float x) { return sqrtf(x); }
TANDEM_FN double unary_sqrt(double x) { return sqrt(x); }
TANDEM_FN float unary_tanh(float x) { return tanhf(x); }
TANDEM_FN double unary_tanh(double x) { return tanh(x); }
TANDEM_FN float unary_pow(float x, float p) { return powf(x, p); }
TANDEM_FN double unary_pow(double x, double p) { return pow(x, p); }

// x^k by repeated squaring, then the reciprocal for a negative k: the algorithm of the
// `powi` the CPU kernels call (LLVM's __powisf2 / __powidf2), so the results match.
template <typename T>
TANDEM_FN T unary_powi(T x, int k) {
    bool reciprocal = k < 0;
    unsigned int e = reciprocal ? 0u - (unsigned int)k : (unsigned int)k;
    T r = (T)1;
    while (true) {
        if (e & 1u) {
            r *= x;
        }
        e >>= 1;
        if (e == 0) {
            break;
        }
        x *= x;
    }
    return reciprocal ? (T)1 / r : r;
}

// ---- forward --------------------------------------------------------------------------------

struct unary_neg {
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return -x;
    }
};

struct unary_exp_op {
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return tandem_exp(x);
    }
};

struct unary_log_op {
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return tandem_log(x);
    }
};

struct unary_sqrt_op {
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return unary_sqrt(x);
    }
};

// `x < 0 ? 0 : x`: NaN stays NaN, as on the CPU and in PyTorch.
struct unary_relu {
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return x < (T)0 ? (T)0 : x;
    }
};

struct unary_sigmoid {
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return (T)1 / ((T)1 + tandem_exp(-x));
    }
};

struct unary_tanh_op {
    template <typename T>
    TANDEM_FN T operator()(T x) const {
        return unary_tanh(x);
    }
};

// The ways pow_scalar computes x^p (`PowMode` in unary/cuda.rs), chosen on the host as the CPU
// kernel chooses them.
#define UNARY_POW_SQUARE 0
#define UNARY_POW_SQRT 1
#define UNARY_POW_INTEGER 2
#define UNARY_POW_GENERAL 3
#define UNARY_POW_ZERO 4
#define UNARY_POW_ONE 5

template <typename T>
struct unary_pow_op {
    int mode;
    int k;
    T p;
    TANDEM_FN T operator()(T x) const {
        if (mode == UNARY_POW_SQUARE) {
            return x * x;
        }
        if (mode == UNARY_POW_SQRT) {
            return unary_sqrt(x);
        }
        if (mode == UNARY_POW_INTEGER) {
            return unary_powi(x, k);
        }
        return unary_pow(x, p);
    }
};

// ---- backward: f(g, saved) ------------------------------------------------------------------

// exp: g · y
struct unary_exp_backward {
    template <typename T>
    TANDEM_FN T operator()(T g, T y) const {
        return g * y;
    }
};

// log: g / x
struct unary_log_backward {
    template <typename T>
    TANDEM_FN T operator()(T g, T x) const {
        return g / x;
    }
};

// sqrt: (½ · g) / y
struct unary_sqrt_backward {
    template <typename T>
    TANDEM_FN T operator()(T g, T y) const {
        return ((T)0.5 * g) / y;
    }
};

// relu: g where y > 0, else 0 (the gradient at exactly 0 is 0)
struct unary_relu_backward {
    template <typename T>
    TANDEM_FN T operator()(T g, T y) const {
        return y > (T)0 ? g : (T)0;
    }
};

// sigmoid: (g · y) · (1 − y)
struct unary_sigmoid_backward {
    template <typename T>
    TANDEM_FN T operator()(T g, T y) const {
        return (g * y) * ((T)1 - y);
    }
};

// tanh: g · (1 − y²), y² rounded before the subtraction as on the CPU
struct unary_tanh_backward {
    template <typename T>
    TANDEM_FN T operator()(T g, T y) const {
        return g * ((T)1 - tandem_mul_rn(y, y));
    }
};

// pow_scalar: g · p · x^(p−1), in the CPU's order; `mode` says how: UNARY_POW_ZERO for p = 0
// (0, whatever g is), UNARY_POW_ONE for p = 1 (g), UNARY_POW_SQUARE for p = 2 ((g + g) · x),
// UNARY_POW_INTEGER when p − 1 = k is a small integer, UNARY_POW_GENERAL otherwise.
template <typename T>
struct unary_pow_backward {
    int mode;
    int k;
    T p;
    T q;
    TANDEM_FN T operator()(T g, T x) const {
        if (mode == UNARY_POW_ZERO) {
            return (T)0;
        }
        if (mode == UNARY_POW_ONE) {
            return g;
        }
        if (mode == UNARY_POW_SQUARE) {
            return (g + g) * x;
        }
        if (mode == UNARY_POW_INTEGER) {
            return (g * p) * unary_powi(x, k);
        }
        return (g * p) * unary_pow(x, q);
    }
};

// ---- instantiations ---------------------------------------------------------------------------

#define UNARY_FORWARD(NAME, OP, DT, T)                                                         \
    extern "C" __global__ void NAME##_##DT(T* out, const T* x, tandem_u64 n) {                 \
        tandem_map_dense(out, x, n, OP());                                                     \
    }                                                                                          \
    TANDEM_HOST_EXPORT(NAME##_##DT)                                                            \
    extern "C" __global__ void NAME##_strided_##DT(T* out, const T* x, tandem_layout x_layout, \
                                                   tandem_u64 n) {                             \
        tandem_map_strided(out, x, x_layout, n, OP());                                         \
    }                                                                                          \
    TANDEM_HOST_EXPORT(NAME##_strided_##DT)

#define UNARY_BACKWARD(NAME, OP, DT, T)                                                        \
    extern "C" __global__ void NAME##_backward_##DT(T* out, const T* g, const T* saved,        \
                                                    tandem_u64 n) {                            \
        tandem_zip_dense(out, g, saved, n, OP());                                              \
    }                                                                                          \
    TANDEM_HOST_EXPORT(NAME##_backward_##DT)                                                   \
    extern "C" __global__ void NAME##_backward_strided_##DT(                                   \
        T* out, const T* g, tandem_layout g_layout, const T* saved,                            \
        tandem_layout saved_layout, tandem_u64 n) {                                            \
        tandem_zip_strided(out, g, g_layout, saved, saved_layout, n, OP());                    \
    }                                                                                          \
    TANDEM_HOST_EXPORT(NAME##_backward_strided_##DT)

#define UNARY_DTYPE(DT, T)                                                                     \
    UNARY_FORWARD(neg, unary_neg, DT, T)                                                       \
    UNARY_FORWARD(exp, unary_exp_op, DT, T)                                                    \
    UNARY_FORWARD(log, unary_log_op, DT, T)                                                    \
    UNARY_FORWARD(sqrt, unary_sqrt_op, DT, T)                                                  \
    UNARY_FORWARD(relu, unary_relu, DT, T)                                                     \
    UNARY_FORWARD(sigmoid, unary_sigmoid, DT, T)                                               \
    UNARY_FORWARD(tanh, unary_tanh_op, DT, T)                                                  \
    UNARY_BACKWARD(exp, unary_exp_backward, DT, T)                                             \
    UNARY_BACKWARD(log, unary_log_backward, DT, T)                                             \
    UNARY_BACKWARD(sqrt, unary_sqrt_backward, DT, T)                                           \
    UNARY_BACKWARD(relu, unary_relu_backward, DT, T)                                           \
    UNARY_BACKWARD(sigmoid, unary_sigmoid_backward, DT, T)                                     \
    UNARY_BACKWARD(tanh, unary_tanh_backward, DT, T)                                           \
    extern "C" __global__ void pow_scalar_##DT(T* out, const T* x, tandem_u64 n, int mode,     \
                                               int k, T p) {                                   \
        unary_pow_op<T> f = {mode, k, p};                                                      \
        tandem_map_dense(out, x, n, f);                                                        \
    }                                                                                          \
    TANDEM_HOST_EXPORT(pow_scalar_##DT)                                                        \
    extern "C" __global__ void pow_scalar_strided_##DT(T* out, const T* x,                     \
                                                       tandem_layout x_layout, tandem_u64 n,   \
                                                       int mode, int k, T p) {                 \
        unary_pow_op<T> f = {mode, k, p};                                                      \
        tandem_map_strided(out, x, x_layout, n, f);                                            \
    }                                                                                          \
    TANDEM_HOST_EXPORT(pow_scalar_strided_##DT)                                                \
    extern "C" __global__ void pow_scalar_backward_##DT(T* out, const T* g, const T* x,        \
                                                        tandem_u64 n, int mode, int k, T p,    \
                                                        T q) {                                 \
        unary_pow_backward<T> f = {mode, k, p, q};                                             \
        tandem_zip_dense(out, g, x, n, f);                                                     \
    }                                                                                          \
    TANDEM_HOST_EXPORT(pow_scalar_backward_##DT)                                               \
    extern "C" __global__ void pow_scalar_backward_strided_##DT(                               \
        T* out, const T* g, tandem_layout g_layout, const T* x, tandem_layout x_layout,        \
        tandem_u64 n, int mode, int k, T p, T q) {                                             \
        unary_pow_backward<T> f = {mode, k, p, q};                                             \
        tandem_zip_strided(out, g, g_layout, x, x_layout, n, f);                               \
    }                                                                                          \
    TANDEM_HOST_EXPORT(pow_scalar_backward_strided_##DT)

UNARY_DTYPE(f32, float)
UNARY_DTYPE(f64, double)
