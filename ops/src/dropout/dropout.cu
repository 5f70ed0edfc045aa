// dropout.cu: inverted dropout on CUDA, forward (drawing the keep-mask) and backward (applying
// it). Launches are built in dropout/cuda/launch.rs.
//
// The mask comes from a counter-based generator: element i is kept when the (i mod 2)-th 32-bit
// half of dropout_hash(seed, i / 2) is at least `threshold`. dropout_hash is the function the
// CPU kernel uses (`mask_hash` in dropout/cpu.rs), so both devices draw the same mask for the
// same seed, and each thread draws its elements independently of every other. Each thread of the
// grid-stride loop handles one pair of elements (one hash), reading the input through its
// layout (a dense input arrives as rank 1, stride 1) and writing the dense output and the u8
// mask (1 = keep). The kept value is `x · scale` in the dtype, as on the CPU, bit for bit.

#include "tandem.cuh"

// SplitMix64's output function of `seed + (counter + 1) · golden ratio`.
TANDEM_FN tandem_u64 dropout_hash(tandem_u64 seed, tandem_u64 counter) {
    tandem_u64 z = seed + (counter + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <typename T>
TANDEM_FN void dropout_forward(T* out, tandem_u8* mask, const T* x, const tandem_layout& x_layout,
                               tandem_u64 n, tandem_u64 seed, tandem_u32 threshold, T scale) {
    const tandem_u64 pairs = (n + 1) / 2;
    TANDEM_GRID_STRIDE_LOOP(k, pairs) {
        const tandem_u64 h = dropout_hash(seed, k);
        const tandem_u64 i = 2 * k;
        const bool keep0 = (tandem_u32)h >= threshold;
        mask[i] = keep0 ? 1 : 0;
        out[i] = keep0 ? x[tandem_layout_index(x_layout, i)] * scale : (T)0;
        if (i + 1 < n) {
            const bool keep1 = (tandem_u32)(h >> 32) >= threshold;
            mask[i + 1] = keep1 ? 1 : 0;
            out[i + 1] = keep1 ? x[tandem_layout_index(x_layout, i + 1)] * scale : (T)0;
        }
    }
}

// The forward of a dense channels-last x ([N, C, H, W] stored as NHWC), in storage order: thread
// s handles storage position s (n, h, w, c) and draws the mask of its logical row-major index
// i = ((n·C + c)·H + h)·W + w, the (i mod 2)-th half of dropout_hash(seed, i / 2), so the mask and
// the output are those of the row-major forward, laid out channels-last (the CPU's choice). Each
// hash serves one element here (a pair's two elements lie apart in NHWC order); reads and writes
// are in storage order.
template <typename T>
TANDEM_FN void dropout_forward_channels_last(T* out, tandem_u8* mask, const T* x, tandem_u64 n,
                                             tandem_u64 channels, tandem_u64 height,
                                             tandem_u64 width, tandem_u64 seed,
                                             tandem_u32 threshold, T scale) {
    TANDEM_GRID_STRIDE_LOOP(s, n) {
        tandem_u64 pixel = tandem_div_u64(s, channels);
        tandem_u64 c = s - pixel * channels;
        tandem_u64 row = tandem_div_u64(pixel, width);
        tandem_u64 w = pixel - row * width;
        tandem_u64 sample = tandem_div_u64(row, height);
        tandem_u64 h = row - sample * height;
        tandem_u64 i = ((sample * channels + c) * height + h) * width + w;
        const tandem_u64 hash = dropout_hash(seed, i / 2);
        const tandem_u32 draw = (i & 1) == 0 ? (tandem_u32)hash : (tandem_u32)(hash >> 32);
        const bool keep = draw >= threshold;
        mask[s] = keep ? 1 : 0;
        out[s] = keep ? x[s] * scale : (T)0;
    }
}

// out = g · scale where the mask keeps an element, 0 where it drops it.
template <typename T>
TANDEM_FN void dropout_backward(T* out, const T* g, const tandem_layout& g_layout,
                                const tandem_u8* mask, tandem_u64 n, T scale) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        out[i] = mask[i] != 0 ? g[tandem_layout_index(g_layout, i)] * scale : (T)0;
    }
}

#define DROPOUT_DTYPE(DT, T)                                                                   \
    extern "C" __global__ void dropout_forward_##DT(T* out, tandem_u8* mask, const T* x,       \
                                                    tandem_layout x_layout, tandem_u64 n,      \
                                                    tandem_u64 seed, tandem_u32 threshold,     \
                                                    T scale) {                                 \
        dropout_forward(out, mask, x, x_layout, n, seed, threshold, scale);                    \
    }                                                                                          \
    TANDEM_HOST_EXPORT(dropout_forward_##DT)                                                   \
    extern "C" __global__ void dropout_forward_channels_last_##DT(                             \
        T* out, tandem_u8* mask, const T* x, tandem_u64 n, tandem_u64 channels,                \
        tandem_u64 height, tandem_u64 width, tandem_u64 seed, tandem_u32 threshold, T scale) { \
        dropout_forward_channels_last(out, mask, x, n, channels, height, width, seed,          \
                                      threshold, scale);                                       \
    }                                                                                          \
    TANDEM_HOST_EXPORT(dropout_forward_channels_last_##DT)                                     \
    extern "C" __global__ void dropout_backward_##DT(T* out, const T* g,                       \
                                                     tandem_layout g_layout,                   \
                                                     const tandem_u8* mask, tandem_u64 n,      \
                                                     T scale) {                                \
        dropout_backward(out, g, g_layout, mask, n, scale);                                    \
    }                                                                                          \
    TANDEM_HOST_EXPORT(dropout_backward_##DT)

DROPOUT_DTYPE(f32, float)
DROPOUT_DTYPE(f64, double)
