// conv2d.cu: the kernels of conv2d's im2col + cuBLAS path (used where cuDNN does not load, or
// when forced with `set_cuda_conv_backend`), and the bias kernels both CUDA paths share. Their
// launches are built in ops/src/conv2d/cuda/launch.rs; the semantics are the CPU's
// (ops/src/conv2d/cpu/im2col.rs: row `(c·kh + ki)·kw + kj` of a sample's column matrix holds,
// for every output pixel, the input element kernel tap (c, ki, kj) reads there, zero in the
// padding).
//
// - conv2d_im2col: the column matrices of `samples` samples, in one of two layouts chosen by
//   the builder through `row_step` and `sample_step` (element (s, k, p) at
//   s·sample_step + k·row_step + p): one K×P matrix per sample (the forward, the input gradient)
//   or one K×(samples·P) matrix (the weight gradient, one product over the whole chunk). One
//   thread per (sample, channel, output pixel) writes that pixel's kh·kw taps: consecutive
//   threads write consecutive pixels of a row (coalesced) and read neighbouring inputs.
// - conv2d_col2im: the adjoint, as a gather: one thread per input element sums the column
//   entries of every tap that read it, so each element is written once, without atomics and in
//   a fixed order.
// - conv2d_bias_add: out[s, o, p] += bias[o].
// - conv2d_bias_grad_partial / _finish: grad_bias[o] = Σ_{s,p} gy[s, o, p] in two passes: one
//   block per (channel, slice of the sample·pixel range) reduces its slice into `partials`, then
//   one thread per channel sums its slices in order. Deterministic for a given launch.
//
// The bias kernels also exist for f16 and bf16 (autocast's convolutions): they compute in f32
// (`tandem_compute`), the partial sums are f32 and only the result is rounded to the low dtype.
// A channels-last (NHWC) tensor is the NCHW case with samples·pixels "samples" and one pixel
// each, so the same kernels serve it. im2col and col2im exist for f32 and f64 only: the
// low-precision fallback runs them in f32 on converted copies (cuda/mod.rs).
//
// 32-bit arithmetic: the builders check with `index_u32` that the padded input height and width,
// the kernel spans, one sample's input (C·H·W), one sample's columns per channel
// (kh·kw·OH·OW) and the output pixels (OH·OW) fit; indices over several samples stay 64-bit.

#include "tandem.cuh"

// `ConvShape` in cuda/launch.rs.
struct conv2d_shape {
    tandem_u32 channels;
    tandem_u32 in_h;
    tandem_u32 in_w;
    tandem_u32 kernel_h;
    tandem_u32 kernel_w;
    tandem_u32 stride_h;
    tandem_u32 stride_w;
    tandem_u32 pad_h;
    tandem_u32 pad_w;
    tandem_u32 dilation_h;
    tandem_u32 dilation_w;
    tandem_u32 out_h;
    tandem_u32 out_w;
    tandem_u32 padding_;
};

template <typename T>
TANDEM_FN void im2col_impl(const T* x, T* cols, const conv2d_shape& g, tandem_u64 samples,
                           tandem_u64 row_step, tandem_u64 sample_step) {
    const tandem_u32 pixels = g.out_h * g.out_w;
    const tandem_u64 per_sample = (tandem_u64)g.channels * pixels;
    const tandem_u64 in_plane = (tandem_u64)g.in_h * g.in_w;
    const tandem_u32 taps = g.kernel_h * g.kernel_w;
    TANDEM_GRID_STRIDE_LOOP(i, samples * per_sample) {
        tandem_u64 s = tandem_div_u64(i, per_sample);
        tandem_u32 r = (tandem_u32)(i - s * per_sample);
        tandem_u32 c = r / pixels;
        tandem_u32 p = r - c * pixels;
        tandem_u32 oh = p / g.out_w;
        tandem_u32 ow = p - oh * g.out_w;
        const T* plane = x + (s * g.channels + c) * in_plane;
        T* out = cols + s * sample_step + (tandem_u64)c * taps * row_step + p;
        // Within the padded input (checked to fit an int by the builder).
        int h0 = (int)(oh * g.stride_h) - (int)g.pad_h;
        int w0 = (int)(ow * g.stride_w) - (int)g.pad_w;
        for (tandem_u32 ki = 0; ki < g.kernel_h; ++ki) {
            int h = h0 + (int)(ki * g.dilation_h);
            bool row_inside = h >= 0 && h < (int)g.in_h;
            for (tandem_u32 kj = 0; kj < g.kernel_w; ++kj) {
                int w = w0 + (int)(kj * g.dilation_w);
                T value = (T)0;
                if (row_inside && w >= 0 && w < (int)g.in_w) {
                    value = plane[(tandem_u64)h * g.in_w + w];
                }
                *out = value;
                out += row_step;
            }
        }
    }
}

template <typename T>
TANDEM_FN void col2im_impl(const T* cols, T* dx, const conv2d_shape& g, tandem_u64 samples,
                           tandem_u64 row_step, tandem_u64 sample_step) {
    const tandem_u32 in_plane = g.in_h * g.in_w;
    const tandem_u64 per_sample = (tandem_u64)g.channels * in_plane;
    const tandem_u32 taps = g.kernel_h * g.kernel_w;
    TANDEM_GRID_STRIDE_LOOP(i, samples * per_sample) {
        tandem_u64 s = tandem_div_u64(i, per_sample);
        tandem_u32 r = (tandem_u32)(i - s * per_sample);
        tandem_u32 c = r / in_plane;
        tandem_u32 q = r - c * in_plane;
        int h = (int)(q / g.in_w);
        int w = (int)(q - (tandem_u32)h * g.in_w);
        const T* channel_rows = cols + s * sample_step + (tandem_u64)c * taps * row_step;
        T acc = (T)0;
        for (tandem_u32 ki = 0; ki < g.kernel_h; ++ki) {
            // Output row oh reads input row h through tap ki when oh·sh + ki·dh − ph = h.
            int along_h = h + (int)g.pad_h - (int)(ki * g.dilation_h);
            if (along_h < 0) {
                break;  // only decreases with ki
            }
            if ((tandem_u32)along_h % g.stride_h != 0) {
                continue;
            }
            tandem_u32 oh = (tandem_u32)along_h / g.stride_h;
            if (oh >= g.out_h) {
                continue;
            }
            for (tandem_u32 kj = 0; kj < g.kernel_w; ++kj) {
                int along_w = w + (int)g.pad_w - (int)(kj * g.dilation_w);
                if (along_w < 0) {
                    break;
                }
                if ((tandem_u32)along_w % g.stride_w != 0) {
                    continue;
                }
                tandem_u32 ow = (tandem_u32)along_w / g.stride_w;
                if (ow >= g.out_w) {
                    continue;
                }
                tandem_u64 row = (tandem_u64)(ki * g.kernel_w + kj);
                acc += channel_rows[row * row_step + oh * g.out_w + ow];
            }
        }
        dx[i] = acc;
    }
}

// out[s, o, p] += bias[o] over n = samples·channels·pixels elements.
template <typename T>
TANDEM_FN void bias_add_impl(T* out, const T* bias, tandem_u64 n, tandem_u64 channels,
                             tandem_u64 pixels) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        tandem_u64 row = tandem_div_u64(i, pixels);
        tandem_u64 o = row - tandem_div_u64(row, channels) * channels;
        out[i] = tandem_store<T>(tandem_load(out[i]) + tandem_load(bias[o]));
    }
}

// partials[o·splits + t] = Σ gy[s, o, p] over the t-th slice (of `span` entries) of the
// flattened (s, p) range. Blocks loop over the (o, t) pairs; the loop bound is the same for
// every thread of a block, so all reach the block reduction's barriers.
template <typename T, typename A>
TANDEM_FN void bias_grad_partial_impl(const T* gy, A* partials, tandem_u64 samples,
                                      tandem_u64 channels, tandem_u64 pixels, tandem_u64 splits,
                                      tandem_u64 span) {
    __shared__ A scratch[32];
    const tandem_u64 total = samples * pixels;
    for (tandem_u64 b = blockIdx.x; b < channels * splits; b += gridDim.x) {
        tandem_u64 o = tandem_div_u64(b, splits);
        tandem_u64 t = b - o * splits;
        tandem_u64 first = t * span;
        tandem_u64 end = first + span < total ? first + span : total;
        A acc = (A)0;
        for (tandem_u64 j = first + threadIdx.x; j < end; j += blockDim.x) {
            tandem_u64 s = tandem_div_u64(j, pixels);
            tandem_u64 p = j - s * pixels;
            acc += tandem_load(gy[(s * channels + o) * pixels + p]);
        }
        A sum = tandem_block_reduce(acc, tandem_sum_op(), (A)0, scratch);
        if (threadIdx.x == 0) {
            partials[b] = sum;
        }
    }
}

// grad[o] = Σ_t partials[o·splits + t], in order of t.
template <typename T, typename A>
TANDEM_FN void bias_grad_finish_impl(const A* partials, T* grad, tandem_u64 channels,
                                     tandem_u64 splits) {
    TANDEM_GRID_STRIDE_LOOP(o, channels) {
        A acc = (A)0;
        for (tandem_u64 t = 0; t < splits; ++t) {
            acc += partials[o * splits + t];
        }
        grad[o] = tandem_store<T>(acc);
    }
}

// ---------------------------------------------------------------------------------------------
// Instantiations: conv2d_<kernel>_<dtype>: im2col/col2im for f32 and f64, the bias kernels
// also for f16 and bf16 (computing in f32).
// ---------------------------------------------------------------------------------------------

#define TANDEM_CONV2D_KERNELS(NAME, T)                                                         \
    extern "C" __global__ void conv2d_im2col_##NAME(const T* x, T* cols, conv2d_shape g,       \
                                                    tandem_u64 samples, tandem_u64 row_step,   \
                                                    tandem_u64 sample_step) {                  \
        im2col_impl<T>(x, cols, g, samples, row_step, sample_step);                            \
    }                                                                                          \
    TANDEM_HOST_EXPORT(conv2d_im2col_##NAME)                                                   \
    extern "C" __global__ void conv2d_col2im_##NAME(const T* cols, T* dx, conv2d_shape g,      \
                                                    tandem_u64 samples, tandem_u64 row_step,   \
                                                    tandem_u64 sample_step) {                  \
        col2im_impl<T>(cols, dx, g, samples, row_step, sample_step);                           \
    }                                                                                          \
    TANDEM_HOST_EXPORT(conv2d_col2im_##NAME)

#define TANDEM_CONV2D_BIAS_KERNELS(NAME, T, A)                                                 \
    extern "C" __global__ void conv2d_bias_add_##NAME(T* out, const T* bias, tandem_u64 n,     \
                                                      tandem_u64 channels,                     \
                                                      tandem_u64 pixels) {                     \
        bias_add_impl<T>(out, bias, n, channels, pixels);                                      \
    }                                                                                          \
    TANDEM_HOST_EXPORT(conv2d_bias_add_##NAME)                                                 \
    extern "C" __global__ void conv2d_bias_grad_partial_##NAME(                                \
        const T* gy, A* partials, tandem_u64 samples, tandem_u64 channels, tandem_u64 pixels,  \
        tandem_u64 splits, tandem_u64 span) {                                                  \
        bias_grad_partial_impl<T, A>(gy, partials, samples, channels, pixels, splits, span);   \
    }                                                                                          \
    TANDEM_HOST_EXPORT(conv2d_bias_grad_partial_##NAME)                                        \
    extern "C" __global__ void conv2d_bias_grad_finish_##NAME(                                 \
        const A* partials, T* grad, tandem_u64 channels, tandem_u64 splits) {                  \
        bias_grad_finish_impl<T, A>(partials, grad, channels, splits);                         \
    }                                                                                          \
    TANDEM_HOST_EXPORT(conv2d_bias_grad_finish_##NAME)

TANDEM_CONV2D_KERNELS(f32, float)
TANDEM_CONV2D_KERNELS(f64, double)
TANDEM_CONV2D_BIAS_KERNELS(f32, float, float)
TANDEM_CONV2D_BIAS_KERNELS(f64, double, double)
TANDEM_CONV2D_BIAS_KERNELS(f16, tandem_f16, float)
TANDEM_CONV2D_BIAS_KERNELS(bf16, tandem_bf16, float)
