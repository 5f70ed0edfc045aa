// pool.cu: the 2-D pools on CUDA: max pooling (with the index of each window's maximum, for the
// backward), average pooling over sliding windows (padding counted in the divisor) and adaptive
// average pooling, forward and backward. Launches are built in ops/src/pool/launch.rs; the
// semantics are the CPU's in ops/src/pool/cpu/mod.rs, and every result is the CPU's bit for bit:
// each value is computed by the same operations in the same order.
//
// Inputs and outputs are dense `[planes, H, W, channels]` / `[planes, OH, OW, channels]` arrays:
// row-major NCHW tensors are `channels` = 1 with one plane per sample and channel, channels-last
// (NHWC) ones are one plane per sample with the channel innermost (`channels` = C), so a window
// gathers the values of one channel C apart and consecutive threads take consecutive channels.
// Max indices are positions within the H × W plane (r·W + c) in both cases. Forward kernels run one thread per output element; backward kernels one thread
// per INPUT element, which gathers the gradients of the windows covering it in row-major window
// order. No two threads write the same element and no atomics are used, so the backward is
// deterministic even where windows overlap, and it needs no zero-filled buffer first.

#include "tandem.cuh"

// `PoolGeometry` in launch.rs. Sliding windows: output o along a dim covers the input range
// [o * stride - pad, o * stride - pad + kernel), clipped to the input. Adaptive windows (when
// `adaptive` is 1): [floor(o * in / out), ceil((o + 1) * in / out)). The launch builder checks
// that no product below overflows 64 bits.
struct pool_geometry {
    tandem_u64 planes;
    tandem_u64 in_h;
    tandem_u64 in_w;
    tandem_u64 out_h;
    tandem_u64 out_w;
    tandem_u64 kernel_h;
    tandem_u64 kernel_w;
    tandem_u64 stride_h;
    tandem_u64 stride_w;
    tandem_u64 pad_h;
    tandem_u64 pad_w;
    // What a sliding average divides every window by (kernel_h * kernel_w: padding counts);
    // unused by max pooling and by adaptive windows, which divide by their own size.
    tandem_u64 divisor;
    tandem_u64 adaptive;
    // Values per pixel, interleaved (1: NCHW planes; C: channels-last samples).
    tandem_u64 channels;
};

// A half-open range [begin, end), empty when end <= begin.
struct pool_range {
    tandem_u64 begin;
    tandem_u64 end;
};

// The input range that output `o` covers along one dim (as `shape.rs` computes it).
TANDEM_FN pool_range pool_window(tandem_u64 o, tandem_u64 in, tandem_u64 out, tandem_u64 kernel,
                                 tandem_u64 stride, tandem_u64 pad, bool adaptive) {
    pool_range r;
    if (adaptive) {
        r.begin = tandem_div_u64(o * in, out);
        r.end = tandem_div_u64((o + 1) * in + out - 1, out);
    } else {
        tandem_u64 start = o * stride;
        r.begin = start > pad ? start - pad : 0;
        // start + kernel >= pad: the builder checked pad <= kernel / 2.
        r.end = tandem_min_u64(start + kernel - pad, in);
    }
    return r;
}

// The outputs whose windows cover input position `x` along one dim: a range, since window
// starts and ends both grow with the output index. Sliding: o * stride <= x + pad <
// o * stride + kernel. Adaptive: end(o) > x  <=>  o >= floor(x * out / in), and begin(o) <= x
// <=>  o < ceil((x + 1) * out / in).
TANDEM_FN pool_range pool_covering(tandem_u64 x, tandem_u64 in, tandem_u64 out, tandem_u64 kernel,
                                   tandem_u64 stride, tandem_u64 pad, bool adaptive) {
    pool_range r;
    if (adaptive) {
        r.begin = tandem_div_u64(x * out, in);
        r.end = tandem_min_u64(tandem_div_u64((x + 1) * out + in - 1, in), out);
    } else {
        tandem_u64 padded = x + pad;
        r.begin = padded < kernel ? 0 : tandem_div_u64(padded - kernel, stride) + 1;
        r.end = tandem_min_u64(tandem_div_u64(padded, stride) + 1, out);
    }
    return r;
}

// The row and column ranges of output `(i, j)`.
TANDEM_FN pool_range pool_rows(const pool_geometry& g, tandem_u64 i) {
    return pool_window(i, g.in_h, g.out_h, g.kernel_h, g.stride_h, g.pad_h, g.adaptive != 0);
}
TANDEM_FN pool_range pool_cols(const pool_geometry& g, tandem_u64 j) {
    return pool_window(j, g.in_w, g.out_w, g.kernel_w, g.stride_w, g.pad_w, g.adaptive != 0);
}

// What the average over window rows x cols divides by, in T (through double, as the CPU's
// `T::from_f64(divisor as f64)`).
template <typename T>
TANDEM_FN T pool_divisor(const pool_geometry& g, pool_range rows, pool_range cols) {
    tandem_u64 d = g.adaptive != 0 ? (rows.end - rows.begin) * (cols.end - cols.begin) : g.divisor;
    return (T)(double)d;
}

// Splits a flat index over [planes, rows, cols, channels] into (plane, row, col, channel).
TANDEM_FN void pool_unravel(tandem_u64 flat, tandem_u64 rows, tandem_u64 cols,
                            tandem_u64 channels, tandem_u64* plane, tandem_u64* row,
                            tandem_u64* col, tandem_u64* channel) {
    tandem_u64 pixel = channels == 1 ? flat : tandem_div_u64(flat, channels);
    *channel = flat - pixel * channels;
    flat = pixel;
    tandem_u64 q = tandem_div_u64(flat, cols);
    *col = flat - q * cols;
    *plane = tandem_div_u64(q, rows);
    *row = q - *plane * rows;
}

// out[o] = the maximum of output o's window: the first maximal element in row-major window
// order, or the first NaN (which ends the search), as the CPU's `window_max`; indices[o] (unless
// `indices` is null) = its index within the plane. Plane sizes are checked against 32 bits by
// the launch builder (index_u32), so the index fits.
template <typename T>
TANDEM_FN void max_pool2d_impl(const T* x, T* out, tandem_u32* indices, const pool_geometry& g) {
    tandem_u64 n = g.planes * g.out_h * g.out_w * g.channels;
    TANDEM_GRID_STRIDE_LOOP(o, n) {
        tandem_u64 p, i, j, ch;
        pool_unravel(o, g.out_h, g.out_w, g.channels, &p, &i, &j, &ch);
        pool_range rows = pool_rows(g, i);
        pool_range cols = pool_cols(g, j);
        const T* plane = x + p * g.in_h * g.in_w * g.channels + ch;
        T best = tandem_negative_infinity(T());
        tandem_u64 at = rows.begin * g.in_w + cols.begin;
        bool found_nan = false;
        for (tandem_u64 r = rows.begin; r < rows.end && !found_nan; ++r) {
            for (tandem_u64 c = cols.begin; c < cols.end; ++c) {
                T v = plane[(r * g.in_w + c) * g.channels];
                if (v > best || v != v) {
                    best = v;
                    at = r * g.in_w + c;
                    if (v != v) {
                        found_nan = true;
                        break;
                    }
                }
            }
        }
        out[o] = best;
        if (indices != 0) {
            indices[o] = (tandem_u32)at;
        }
    }
}

// grad_x[e] = the sum, over the windows covering input e in row-major window order, of the
// output gradients of those whose maximum came from e (the CPU adds them in the same order).
template <typename T>
TANDEM_FN void max_pool2d_backward_impl(const T* grad_out, const tandem_u32* indices, T* grad_x,
                                        const pool_geometry& g) {
    tandem_u64 n = g.planes * g.in_h * g.in_w * g.channels;
    TANDEM_GRID_STRIDE_LOOP(e, n) {
        tandem_u64 p, r, c, ch;
        pool_unravel(e, g.in_h, g.in_w, g.channels, &p, &r, &c, &ch);
        pool_range rows = pool_covering(r, g.in_h, g.out_h, g.kernel_h, g.stride_h, g.pad_h, false);
        pool_range cols = pool_covering(c, g.in_w, g.out_w, g.kernel_w, g.stride_w, g.pad_w, false);
        tandem_u32 self = (tandem_u32)(r * g.in_w + c);
        tandem_u64 base = p * g.out_h * g.out_w * g.channels + ch;
        T acc = 0;
        for (tandem_u64 i = rows.begin; i < rows.end; ++i) {
            for (tandem_u64 j = cols.begin; j < cols.end; ++j) {
                tandem_u64 o = base + (i * g.out_w + j) * g.channels;
                if (indices[o] == self) {
                    acc = acc + grad_out[o];
                }
            }
        }
        grad_x[e] = acc;
    }
}

// out[o] = the sum of output o's window (row by row, left to right) divided by its divisor.
template <typename T>
TANDEM_FN void avg_pool2d_impl(const T* x, T* out, const pool_geometry& g) {
    tandem_u64 n = g.planes * g.out_h * g.out_w * g.channels;
    TANDEM_GRID_STRIDE_LOOP(o, n) {
        tandem_u64 p, i, j, ch;
        pool_unravel(o, g.out_h, g.out_w, g.channels, &p, &i, &j, &ch);
        pool_range rows = pool_rows(g, i);
        pool_range cols = pool_cols(g, j);
        const T* plane = x + p * g.in_h * g.in_w * g.channels + ch;
        T acc = 0;
        for (tandem_u64 r = rows.begin; r < rows.end; ++r) {
            for (tandem_u64 c = cols.begin; c < cols.end; ++c) {
                acc = acc + plane[(r * g.in_w + c) * g.channels];
            }
        }
        out[o] = acc / pool_divisor<T>(g, rows, cols);
    }
}

// grad_x[e] = the sum, over the windows covering input e in row-major window order, of each
// window's output gradient divided by its divisor.
template <typename T>
TANDEM_FN void avg_pool2d_backward_impl(const T* grad_out, T* grad_x, const pool_geometry& g) {
    tandem_u64 n = g.planes * g.in_h * g.in_w * g.channels;
    bool adaptive = g.adaptive != 0;
    TANDEM_GRID_STRIDE_LOOP(e, n) {
        tandem_u64 p, r, c, ch;
        pool_unravel(e, g.in_h, g.in_w, g.channels, &p, &r, &c, &ch);
        pool_range rows =
            pool_covering(r, g.in_h, g.out_h, g.kernel_h, g.stride_h, g.pad_h, adaptive);
        pool_range cols =
            pool_covering(c, g.in_w, g.out_w, g.kernel_w, g.stride_w, g.pad_w, adaptive);
        tandem_u64 base = p * g.out_h * g.out_w * g.channels + ch;
        T acc = 0;
        for (tandem_u64 i = rows.begin; i < rows.end; ++i) {
            pool_range window_rows = pool_rows(g, i);
            for (tandem_u64 j = cols.begin; j < cols.end; ++j) {
                T share = grad_out[base + (i * g.out_w + j) * g.channels] /
                          pool_divisor<T>(g, window_rows, pool_cols(g, j));
                acc = acc + share;
            }
        }
        grad_x[e] = acc;
    }
}

// ---------------------------------------------------------------------------------------------
// Instantiations: <op>_<dtype>.
// ---------------------------------------------------------------------------------------------

#define POOL_KERNELS(NAME, T)                                                                  \
    extern "C" __global__ void max_pool2d_##NAME(const T* x, T* out, tandem_u32* indices,      \
                                                 pool_geometry g) {                            \
        max_pool2d_impl<T>(x, out, indices, g);                                                \
    }                                                                                          \
    TANDEM_HOST_EXPORT(max_pool2d_##NAME)                                                      \
    extern "C" __global__ void max_pool2d_backward_##NAME(                                     \
        const T* grad_out, const tandem_u32* indices, T* grad_x, pool_geometry g) {            \
        max_pool2d_backward_impl<T>(grad_out, indices, grad_x, g);                             \
    }                                                                                          \
    TANDEM_HOST_EXPORT(max_pool2d_backward_##NAME)                                             \
    extern "C" __global__ void avg_pool2d_##NAME(const T* x, T* out, pool_geometry g) {        \
        avg_pool2d_impl<T>(x, out, g);                                                         \
    }                                                                                          \
    TANDEM_HOST_EXPORT(avg_pool2d_##NAME)                                                      \
    extern "C" __global__ void avg_pool2d_backward_##NAME(const T* grad_out, T* grad_x,        \
                                                          pool_geometry g) {                   \
        avg_pool2d_backward_impl<T>(grad_out, grad_x, g);                                      \
    }                                                                                          \
    TANDEM_HOST_EXPORT(avg_pool2d_backward_##NAME)

POOL_KERNELS(f32, float)
POOL_KERNELS(f64, double)
