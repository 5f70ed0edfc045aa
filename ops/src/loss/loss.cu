// loss.cu: the losses' kernels — fused log-softmax + negative log-likelihood (cross entropy)
// per row, negative log-likelihood per row, their `[N, C]` gradients, and the squared
// differences of mse with their gradient. Launches are built in ops/src/loss/cuda.rs; the
// semantics are the CPU's in ops/src/loss/cpu.rs. Reductions over the samples (Sum, Mean) run
// afterwards through reduce.cu's deterministic sums.
//
// Class labels are checked here, on the device: a label outside 0..C is never used as an
// index. Its row's loss (or gradient) becomes NaN and the first such label is recorded in the
// launching thread's deferred-error record (core/src/cuda/deferred.rs), which the host reports
// as the CPU op's error at that thread's next read (`to_vec`, `item`, `synchronize`).
//
// Cross entropy keeps, per row, the maximum m and ls = ln sum e^(x - m): the loss is
// ls - (x_t - m) and the gradient e^((x - m) - ls) - onehot(t), free of overflow for any logits.

#include "tandem.cuh"

// Whether `label` is a class index in 0..classes.
TANDEM_FN bool loss_label_ok(tandem_i64 label, tandem_u64 classes) {
    return label >= 0 && (tandem_u64)label < classes;
}

// Records a bad label in the deferred-error record (see deferred.rs).
TANDEM_FN void loss_record_label(tandem_u32* claim, tandem_i64* record, tandem_u32 code,
                                 tandem_u64 position, tandem_i64 label, tandem_u64 classes) {
    tandem_deferred_record(claim, record, code, (tandem_i64)position, label, (tandem_i64)classes);
}

// Per row of the dense [rows, classes] logits: losses[r] = ls - (x[t] - m), row_max[r] = m,
// row_log_sum[r] = ls. One warp (short rows) or one block per row; the row loop is uniform over
// the group. `classes` is at least 1 (the launch builder skips an empty launch).
template <typename T>
TANDEM_FN void cross_entropy_rows_impl(const T* x, const tandem_i64* targets,
                                       tandem_u64 target_stride, T* losses, T* row_max,
                                       T* row_log_sum, tandem_u64 rows, tandem_u64 classes,
                                       int warp_per_row, tandem_u32* claim, tandem_i64* record,
                                       tandem_u32 code) {
    typedef typename tandem_compute<T>::type C;
    __shared__ C scratch[32];
    tandem_row_group g = tandem_row_group_of(warp_per_row);
    for (tandem_u64 row = g.first; row < rows; row += g.step) {
        const T* xr = x + row * classes;
        C m = tandem_load(xr[0]);
        for (tandem_u64 k = g.rank; k < classes; k += g.size) {
            m = tandem_max_nan_op()(m, tandem_load(xr[k]));
        }
        m = tandem_row_group_reduce(m, tandem_max_nan_op(), m, scratch, warp_per_row);
        C s = (C)0;
        for (tandem_u64 k = g.rank; k < classes; k += g.size) {
            s += tandem_exp(tandem_load(xr[k]) - m);
        }
        s = tandem_row_group_reduce(s, tandem_sum_op(), (C)0, scratch, warp_per_row);
        if (g.rank == 0) {
            C ls = tandem_log(s);
            tandem_i64 t = targets[row * target_stride];
            C loss;
            if (loss_label_ok(t, classes)) {
                loss = ls - (tandem_load(xr[t]) - m);
            } else {
                loss = tandem_nan(m);
                loss_record_label(claim, record, code, row, t, classes);
            }
            losses[row] = tandem_store<T>(loss);
            row_max[row] = tandem_store<T>(m);
            row_log_sum[row] = tandem_store<T>(ls);
        }
    }
}

// grad[r, k] = s_r * (e^((x - m_r) - ls_r) - [k == t_r]), s_r = scale * g[r * g_stride] (g_stride
// 0 for a reduced loss's scalar gradient). A bad label makes its row NaN.
template <typename T>
TANDEM_FN void cross_entropy_backward_impl(const T* x, const tandem_i64* targets,
                                           tandem_u64 target_stride, const T* row_max,
                                           const T* row_log_sum, const T* g, tandem_u64 g_stride,
                                           typename tandem_compute<T>::type scale, T* grad,
                                           tandem_u64 rows, tandem_u64 classes, tandem_u32* claim,
                                           tandem_i64* record, tandem_u32 code) {
    typedef typename tandem_compute<T>::type C;
    TANDEM_GRID_STRIDE_LOOP(i, rows * classes) {
        tandem_u64 row = i / classes;
        tandem_u64 k = i - row * classes;
        tandem_i64 t = targets[row * target_stride];
        C s = tandem_load(g[row * g_stride]) * scale;
        C v = s * tandem_exp((tandem_load(x[i]) - tandem_load(row_max[row])) -
                           tandem_load(row_log_sum[row]));
        if (!loss_label_ok(t, classes)) {
            v = tandem_nan(v);
            if (k == 0) {
                loss_record_label(claim, record, code, row, t, classes);
            }
        } else if ((tandem_u64)t == k) {
            v -= s;
        }
        grad[i] = tandem_store<T>(v);
    }
}

// losses[r] = -log_probs[r * s0 + t_r * s1] (log_probs at its first element, any strides).
template <typename T>
TANDEM_FN void nll_forward_impl(const T* log_probs, tandem_u64 s0, tandem_u64 s1,
                                const tandem_i64* targets, tandem_u64 target_stride, T* losses,
                                tandem_u64 rows, tandem_u64 classes, tandem_u32* claim,
                                tandem_i64* record, tandem_u32 code) {
    typedef typename tandem_compute<T>::type C;
    TANDEM_GRID_STRIDE_LOOP(row, rows) {
        tandem_i64 t = targets[row * target_stride];
        C loss;
        if (loss_label_ok(t, classes)) {
            loss = -tandem_load(log_probs[row * s0 + (tandem_u64)t * s1]);
        } else {
            loss = tandem_nan((C)0);
            loss_record_label(claim, record, code, row, t, classes);
        }
        losses[row] = tandem_store<T>(loss);
    }
}

// grad[r, k] = -scale * g[r * g_stride] where k == t_r, 0 elsewhere (NaN for a bad label).
template <typename T>
TANDEM_FN void nll_backward_impl(const tandem_i64* targets, tandem_u64 target_stride,
                                 const T* g, tandem_u64 g_stride,
                                 typename tandem_compute<T>::type scale, T* grad,
                                 tandem_u64 rows, tandem_u64 classes, tandem_u32* claim,
                                 tandem_i64* record, tandem_u32 code) {
    typedef typename tandem_compute<T>::type C;
    TANDEM_GRID_STRIDE_LOOP(i, rows * classes) {
        tandem_u64 row = i / classes;
        tandem_u64 k = i - row * classes;
        tandem_i64 t = targets[row * target_stride];
        C v = (C)0;
        if (!loss_label_ok(t, classes)) {
            v = tandem_nan(v);
            if (k == 0) {
                loss_record_label(claim, record, code, row, t, classes);
            }
        } else if ((tandem_u64)t == k) {
            v = -(tandem_load(g[row * g_stride]) * scale);
        }
        grad[i] = tandem_store<T>(v);
    }
}

// out[i] = (a - b)^2 for the dense out of n elements.
template <typename T>
TANDEM_FN void mse_forward_impl(const T* a, const tandem_layout& a_layout, const T* b,
                                const tandem_layout& b_layout, T* out, tandem_u64 n) {
    typedef typename tandem_compute<T>::type C;
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        C d = tandem_load(a[tandem_layout_index(a_layout, i)]) -
              tandem_load(b[tandem_layout_index(b_layout, i)]);
        out[i] = tandem_store<T>(d * d);
    }
}

// grad_pred[i] = 2 (a - b) * scale * g[g_layout(i)] (dense), and grad_target[i] = -grad_pred[i]
// when grad_target is not null. g_layout is the gradient expanded to the inputs' shape (all
// strides 0 for a reduced loss's scalar).
template <typename T>
TANDEM_FN void mse_backward_impl(const T* a, const tandem_layout& a_layout, const T* b,
                                 const tandem_layout& b_layout, const T* g,
                                 const tandem_layout& g_layout,
                                 typename tandem_compute<T>::type scale, T* grad_pred,
                                 T* grad_target, tandem_u64 n) {
    typedef typename tandem_compute<T>::type C;
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        C d = tandem_load(a[tandem_layout_index(a_layout, i)]) -
              tandem_load(b[tandem_layout_index(b_layout, i)]);
        C s = tandem_load(g[tandem_layout_index(g_layout, i)]) * scale;
        C v = (C)2 * d * s;
        grad_pred[i] = tandem_store<T>(v);
        if (grad_target != 0) {
            grad_target[i] = tandem_store<T>(-v);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Instantiations: <op>_<dtype>.
// ---------------------------------------------------------------------------------------------

#define LOSS_DTYPE(NAME, T)                                                                    \
    extern "C" __global__ void cross_entropy_rows_##NAME(                                      \
        const T* x, const tandem_i64* targets, tandem_u64 target_stride, T* losses,            \
        T* row_max, T* row_log_sum, tandem_u64 rows, tandem_u64 classes, int warp_per_row,     \
        tandem_u32* claim, tandem_i64* record, tandem_u32 code) {                              \
        cross_entropy_rows_impl<T>(x, targets, target_stride, losses, row_max, row_log_sum,    \
                                   rows, classes, warp_per_row, claim, record, code);          \
    }                                                                                          \
    TANDEM_HOST_EXPORT(cross_entropy_rows_##NAME)                                              \
    extern "C" __global__ void cross_entropy_backward_##NAME(                                  \
        const T* x, const tandem_i64* targets, tandem_u64 target_stride, const T* row_max,     \
        const T* row_log_sum, const T* g, tandem_u64 g_stride, tandem_compute<T>::type scale,  \
        T* grad, tandem_u64 rows, tandem_u64 classes, tandem_u32* claim, tandem_i64* record,   \
        tandem_u32 code) {                                                                     \
        cross_entropy_backward_impl<T>(x, targets, target_stride, row_max, row_log_sum, g,     \
                                       g_stride, scale, grad, rows, classes, claim, record,    \
                                       code);                                                  \
    }                                                                                          \
    TANDEM_HOST_EXPORT(cross_entropy_backward_##NAME)                                          \
    extern "C" __global__ void nll_forward_##NAME(                                             \
        const T* log_probs, tandem_u64 s0, tandem_u64 s1, const tandem_i64* targets,           \
        tandem_u64 target_stride, T* losses, tandem_u64 rows, tandem_u64 classes,              \
        tandem_u32* claim, tandem_i64* record, tandem_u32 code) {                              \
        nll_forward_impl<T>(log_probs, s0, s1, targets, target_stride, losses, rows, classes,  \
                            claim, record, code);                                              \
    }                                                                                          \
    TANDEM_HOST_EXPORT(nll_forward_##NAME)                                                     \
    extern "C" __global__ void nll_backward_##NAME(                                            \
        const tandem_i64* targets, tandem_u64 target_stride, const T* g, tandem_u64 g_stride,  \
        tandem_compute<T>::type scale, T* grad, tandem_u64 rows, tandem_u64 classes,           \
        tandem_u32* claim, tandem_i64* record, tandem_u32 code) {                              \
        nll_backward_impl<T>(targets, target_stride, g, g_stride, scale, grad, rows, classes,  \
                             claim, record, code);                                             \
    }                                                                                          \
    TANDEM_HOST_EXPORT(nll_backward_##NAME)                                                    \
    extern "C" __global__ void mse_forward_##NAME(const T* a, tandem_layout a_layout,          \
                                                  const T* b, tandem_layout b_layout, T* out,  \
                                                  tandem_u64 n) {                              \
        mse_forward_impl<T>(a, a_layout, b, b_layout, out, n);                                 \
    }                                                                                          \
    TANDEM_HOST_EXPORT(mse_forward_##NAME)                                                     \
    extern "C" __global__ void mse_backward_##NAME(                                            \
        const T* a, tandem_layout a_layout, const T* b, tandem_layout b_layout, const T* g,    \
        tandem_layout g_layout, tandem_compute<T>::type scale, T* grad_pred, T* grad_target,   \
        tandem_u64 n) {                                                                        \
        mse_backward_impl<T>(a, a_layout, b, b_layout, g, g_layout, scale, grad_pred,          \
                             grad_target, n);                                                  \
    }                                                                                          \
    TANDEM_HOST_EXPORT(mse_backward_##NAME)

LOSS_DTYPE(f32, float)
LOSS_DTYPE(f64, double)
