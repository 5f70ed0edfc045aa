// softmax.cu: softmax and log_softmax along one dim, and their backward. Launches are built in
// ops/src/softmax/cuda.rs; the semantics are the CPU's in ops/src/softmax/cpu.rs.
//
// Inputs are dense `[outer, len, inner]`, `len` being the softmax dim. When `inner == 1` (the
// softmax over the last dim, the usual case) each row is contiguous and is normalised by one
// warp (rows up to 1024 long) or one block, in three passes over the row (maximum, sum of
// exponentials, output) that hit L1/L2 after the first. Otherwise each thread normalises one
// column (one `(outer, inner)` pair), its loads coalesced across the warp's neighbouring
// columns. Every group subtracts its maximum before exponentiating; log_softmax is computed as
// `(x - max) - ln sum e^(x - max)`, never as the log of a softmax.

#include "tandem.cuh"

template <typename T>
TANDEM_FN void softmax_rows_impl(const T* x, T* y, tandem_u64 rows, tandem_u64 len, int log_out,
                                 int warp_per_row) {
    typedef typename tandem_compute<T>::type C;
    __shared__ C scratch[32];
    tandem_row_group g = tandem_row_group_of(warp_per_row);
    for (tandem_u64 row = g.first; row < rows; row += g.step) {
        if (len == 0) {
            break;  // uniform over the grid: nothing to normalise
        }
        const T* xr = x + row * len;
        T* yr = y + row * len;
        // x[0] starts every thread's maximum: no infinity constant is needed, and a row of
        // -inf gives the CPU's NaNs.
        C m = tandem_load(xr[0]);
        for (tandem_u64 k = g.rank; k < len; k += g.size) {
            m = tandem_max_nan_op()(m, tandem_load(xr[k]));
        }
        m = tandem_row_group_reduce(m, tandem_max_nan_op(), m, scratch, warp_per_row);
        C s = (C)0;
        for (tandem_u64 k = g.rank; k < len; k += g.size) {
            s += tandem_exp(tandem_load(xr[k]) - m);
        }
        s = tandem_row_group_reduce(s, tandem_sum_op(), (C)0, scratch, warp_per_row);
        if (log_out) {
            C ls = tandem_log(s);
            for (tandem_u64 k = g.rank; k < len; k += g.size) {
                yr[k] = tandem_store<T>((tandem_load(xr[k]) - m) - ls);
            }
        } else {
            C inv = (C)1 / s;
            for (tandem_u64 k = g.rank; k < len; k += g.size) {
                yr[k] = tandem_store<T>(tandem_exp(tandem_load(xr[k]) - m) * inv);
            }
        }
    }
}

template <typename T>
TANDEM_FN void softmax_columns_impl(const T* x, T* y, tandem_u64 outer, tandem_u64 len,
                                    tandem_u64 inner, int log_out) {
    typedef typename tandem_compute<T>::type C;
    if (len == 0) {
        return;
    }
    TANDEM_GRID_STRIDE_LOOP(column, outer * inner) {
        tandem_u64 o = column / inner;
        tandem_u64 i = column - o * inner;
        const T* xc = x + o * len * inner + i;
        T* yc = y + o * len * inner + i;
        C m = tandem_load(xc[0]);
        for (tandem_u64 k = 1; k < len; ++k) {
            m = tandem_max_nan_op()(m, tandem_load(xc[k * inner]));
        }
        C s = (C)0;
        for (tandem_u64 k = 0; k < len; ++k) {
            s += tandem_exp(tandem_load(xc[k * inner]) - m);
        }
        if (log_out) {
            C ls = tandem_log(s);
            for (tandem_u64 k = 0; k < len; ++k) {
                yc[k * inner] = tandem_store<T>((tandem_load(xc[k * inner]) - m) - ls);
            }
        } else {
            C inv = (C)1 / s;
            for (tandem_u64 k = 0; k < len; ++k) {
                yc[k * inner] = tandem_store<T>(tandem_exp(tandem_load(xc[k * inner]) - m) * inv);
            }
        }
    }
}

// softmax: dx = y * (g - sum g*y); log_softmax: dx = g - exp(y) * sum g.
template <typename T>
TANDEM_FN void softmax_backward_rows_impl(const T* g, const T* y, T* dx, tandem_u64 rows,
                                          tandem_u64 len, int log_out, int warp_per_row) {
    typedef typename tandem_compute<T>::type C;
    __shared__ C scratch[32];
    tandem_row_group grp = tandem_row_group_of(warp_per_row);
    for (tandem_u64 row = grp.first; row < rows; row += grp.step) {
        const T* gr = g + row * len;
        const T* yr = y + row * len;
        T* dr = dx + row * len;
        C acc = (C)0;
        for (tandem_u64 k = grp.rank; k < len; k += grp.size) {
            C gv = tandem_load(gr[k]);
            acc += log_out ? gv : gv * tandem_load(yr[k]);
        }
        acc = tandem_row_group_reduce(acc, tandem_sum_op(), (C)0, scratch, warp_per_row);
        for (tandem_u64 k = grp.rank; k < len; k += grp.size) {
            C gv = tandem_load(gr[k]);
            C yv = tandem_load(yr[k]);
            dr[k] = tandem_store<T>(log_out ? gv - tandem_exp(yv) * acc : yv * (gv - acc));
        }
    }
}

template <typename T>
TANDEM_FN void softmax_backward_columns_impl(const T* g, const T* y, T* dx, tandem_u64 outer,
                                             tandem_u64 len, tandem_u64 inner, int log_out) {
    typedef typename tandem_compute<T>::type C;
    TANDEM_GRID_STRIDE_LOOP(column, outer * inner) {
        tandem_u64 o = column / inner;
        tandem_u64 i = column - o * inner;
        tandem_u64 start = o * len * inner + i;
        C acc = (C)0;
        for (tandem_u64 k = 0; k < len; ++k) {
            C gv = tandem_load(g[start + k * inner]);
            acc += log_out ? gv : gv * tandem_load(y[start + k * inner]);
        }
        for (tandem_u64 k = 0; k < len; ++k) {
            tandem_u64 at = start + k * inner;
            C gv = tandem_load(g[at]);
            C yv = tandem_load(y[at]);
            dx[at] = tandem_store<T>(log_out ? gv - tandem_exp(yv) * acc : yv * (gv - acc));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Instantiations: <op>_<dtype>.
// ---------------------------------------------------------------------------------------------

#define SOFTMAX_DTYPE(NAME, T)                                                                 \
    extern "C" __global__ void softmax_rows_##NAME(const T* x, T* y, tandem_u64 rows,          \
                                                   tandem_u64 len, int log_out,                \
                                                   int warp_per_row) {                         \
        softmax_rows_impl<T>(x, y, rows, len, log_out, warp_per_row);                          \
    }                                                                                          \
    TANDEM_HOST_EXPORT(softmax_rows_##NAME)                                                    \
    extern "C" __global__ void softmax_columns_##NAME(const T* x, T* y, tandem_u64 outer,      \
                                                      tandem_u64 len, tandem_u64 inner,        \
                                                      int log_out) {                           \
        softmax_columns_impl<T>(x, y, outer, len, inner, log_out);                             \
    }                                                                                          \
    TANDEM_HOST_EXPORT(softmax_columns_##NAME)                                                 \
    extern "C" __global__ void softmax_backward_rows_##NAME(                                   \
        const T* g, const T* y, T* dx, tandem_u64 rows, tandem_u64 len, int log_out,           \
        int warp_per_row) {                                                                    \
        softmax_backward_rows_impl<T>(g, y, dx, rows, len, log_out, warp_per_row);             \
    }                                                                                          \
    TANDEM_HOST_EXPORT(softmax_backward_rows_##NAME)                                           \
    extern "C" __global__ void softmax_backward_columns_##NAME(                                \
        const T* g, const T* y, T* dx, tandem_u64 outer, tandem_u64 len, tandem_u64 inner,     \
        int log_out) {                                                                         \
        softmax_backward_columns_impl<T>(g, y, dx, outer, len, inner, log_out);                \
    }                                                                                          \
    TANDEM_HOST_EXPORT(softmax_backward_columns_##NAME)

SOFTMAX_DTYPE(f32, float)
SOFTMAX_DTYPE(f64, double)
