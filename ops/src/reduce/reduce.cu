// reduce.cu: the reductions over dims (sum, and with a scale the mean; the maximum with the
// position of each group's first maximum), the partial sums of a whole-tensor sum, and the
// backward kernels (the output gradient broadcast back over the reduced dims, times a scale;
// the gradient of `max` written at each group's first maximum). Launches are built in
// ops/src/reduce/cuda.rs; the semantics are the CPU's in ops/src/reduce/cpu.rs.
//
// A reduction sees its input as `rows` groups of `len` elements: element k of row r is at
// `layout(r * len + k)`, `layout` being the input viewed with the kept dims first and the
// reduced dims last (for a contiguous input reduced over trailing dims that view is dense and
// the index is `offset + r * len + k`). Short rows get one warp each, long rows one block.
// A contiguous input reduced over a middle block of dims, `[outer, len, inner]` with
// `inner > 1`, is reduced by `sum_columns`: 32 neighbouring columns per block, so that every
// load of a warp is one coalesced line.
//
// Sums accumulate in the dtype's compute type (float for f32, double for f64), per thread in
// order, then across threads in a fixed tree: the result is deterministic for a given launch.

#include "tandem.cuh"

// out[r] = scale * sum of row r. The row loop is uniform over the group (a warp or a block),
// so every thread of the group reaches each shuffle and barrier.
template <typename T>
TANDEM_FN void sum_rows_impl(const T* x, const tandem_layout& layout, T* out, tandem_u64 rows,
                             tandem_u64 len, int warp_per_row,
                             typename tandem_compute<T>::type scale) {
    typedef typename tandem_compute<T>::type C;
    __shared__ C scratch[32];
    tandem_row_group g = tandem_row_group_of(warp_per_row);
    for (tandem_u64 row = g.first; row < rows; row += g.step) {
        C acc = (C)0;
        tandem_u64 base = row * len;
        for (tandem_u64 k = g.rank; k < len; k += g.size) {
            acc += tandem_load(x[tandem_layout_index(layout, base + k)]);
        }
        C total = warp_per_row ? tandem_warp_reduce(acc, tandem_sum_op())
                               : tandem_block_reduce(acc, tandem_sum_op(), (C)0, scratch);
        if (g.rank == 0) {
            out[row] = tandem_store<T>(total * scale);
        }
    }
}

// Dense [outer, len, inner] reduced over `len`: out[o * inner + i] = scale * sum over k of
// x[(o * len + k) * inner + i]. A block is 32 columns wide and blockDim.x / 32 slices deep:
// lane j of warp s sums rows s, s + slices, ... of column j, and the slices are added in
// shared memory in order. Tiles (outer index, 32-column group) are walked in a grid-stride loop.
template <typename T>
TANDEM_FN void sum_columns_impl(const T* x, T* out, tandem_u64 outer, tandem_u64 len,
                                tandem_u64 inner, typename tandem_compute<T>::type scale) {
    typedef typename tandem_compute<T>::type C;
    __shared__ C slices_sum[1024];
    tandem_u32 lane = threadIdx.x % 32u;
    tandem_u32 slice = threadIdx.x / 32u;
    tandem_u32 slices = blockDim.x / 32u;
    tandem_u64 tiles_per_outer = (inner + 31u) / 32u;
    tandem_u64 tiles = outer * tiles_per_outer;
    for (tandem_u64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        tandem_u64 o = tile / tiles_per_outer;
        tandem_u64 column = (tile - o * tiles_per_outer) * 32u + lane;
        C acc = (C)0;
        if (column < inner) {
            const T* base = x + o * len * inner + column;
            for (tandem_u64 k = slice; k < len; k += slices) {
                acc += tandem_load(base[k * inner]);
            }
        }
        slices_sum[threadIdx.x] = acc;
        __syncthreads();
        if (slice == 0) {
            C total = (C)0;
            for (tandem_u32 s = 0; s < slices; ++s) {
                total += slices_sum[s * 32u + lane];
            }
            if (column < inner) {
                out[o * inner + column] = tandem_store<T>(total * scale);
            }
        }
        // Everyone waits until slice 0 has read the tile before the next tile overwrites it.
        __syncthreads();
    }
}

// partials[blockIdx.x] = the sum of this block's share of the dense x[0..n) in the compute type
// (stored as T). A fixed share per block and a fixed order: deterministic for a given grid.
template <typename T>
TANDEM_FN void sum_partial_impl(const T* x, tandem_u64 n, T* partials) {
    typedef typename tandem_compute<T>::type C;
    __shared__ C scratch[32];
    C acc = (C)0;
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        acc += tandem_load(x[i]);
    }
    C total = tandem_block_reduce(acc, tandem_sum_op(), (C)0, scratch);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = tandem_store<T>(total);
    }
}

// Whether (value, index) comes before (best, best_index) as the group's maximum: a NaN beats
// every number, a larger value beats a smaller one, and among equals the first index wins.
template <typename C>
TANDEM_FN bool max_beats(C value, tandem_u64 index, C best, tandem_u64 best_index) {
    bool value_nan = value != value;
    bool best_nan = best != best;
    if (value_nan || best_nan) {
        return value_nan && best_nan ? index < best_index : value_nan;
    }
    if (value != best) {
        return value > best;
    }
    return index < best_index;
}

template <typename C>
TANDEM_FN void max_warp_reduce(C& value, tandem_u64& index) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        C other = __shfl_xor_sync(0xffffffffu, value, offset);
        tandem_u64 other_index = __shfl_xor_sync(0xffffffffu, index, offset);
        if (max_beats(other, other_index, value, index)) {
            value = other;
            index = other_index;
        }
    }
}

// values[r], positions[r] = the first maximum of row r and its position in the row (rows are
// not empty: the op refuses a maximum over no elements). The identity (-inf, no index) loses
// to every element, -inf included.
template <typename T>
TANDEM_FN void max_rows_impl(const T* x, const tandem_layout& layout, T* values,
                             tandem_i64* positions, tandem_u64 rows, tandem_u64 len,
                             int warp_per_row) {
    typedef typename tandem_compute<T>::type C;
    __shared__ C scratch_values[32];
    __shared__ tandem_u64 scratch_indices[32];
    const tandem_u64 none = ~0ull;
    tandem_row_group g = tandem_row_group_of(warp_per_row);
    for (tandem_u64 row = g.first; row < rows; row += g.step) {
        C best = tandem_negative_infinity((C)0);
        tandem_u64 at = none;
        tandem_u64 base = row * len;
        for (tandem_u64 k = g.rank; k < len; k += g.size) {
            C v = tandem_load(x[tandem_layout_index(layout, base + k)]);
            if (max_beats(v, k, best, at)) {
                best = v;
                at = k;
            }
        }
        max_warp_reduce(best, at);
        if (!warp_per_row) {
            tandem_u32 lane = threadIdx.x % 32u;
            tandem_u32 warp = threadIdx.x / 32u;
            if (lane == 0) {
                scratch_values[warp] = best;
                scratch_indices[warp] = at;
            }
            __syncthreads();
            bool present = lane < blockDim.x / 32u;
            best = present ? scratch_values[lane] : tandem_negative_infinity((C)0);
            at = present ? scratch_indices[lane] : none;
            max_warp_reduce(best, at);
            __syncthreads();
        }
        if (g.rank == 0) {
            values[row] = tandem_store<T>(best);
            positions[row] = (tandem_i64)at;
        }
    }
}

// out[i] = scale * g[g_layout(i)] for the dense output of n elements: g_layout is the output
// gradient expanded over the reduced dims (stride 0 there).
template <typename T>
TANDEM_FN void broadcast_scaled_impl(T* out, tandem_u64 n, const T* g,
                                     const tandem_layout& g_layout,
                                     typename tandem_compute<T>::type scale) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        out[i] = tandem_store<T>(tandem_load(g[tandem_layout_index(g_layout, i)]) * scale);
    }
}

// The backward of max: grad (dense, zeroed beforehand) gets g[r] at row r's first maximum, at
// kept(r) + reduced(positions[r]), the two layouts being the kept and the reduced dims of the
// dense input with its strides. A position outside 0..len is skipped (positions come from
// max_rows, so none is).
template <typename T>
TANDEM_FN void max_scatter_impl(T* grad, const T* g, const tandem_layout& g_layout,
                                const tandem_i64* positions, const tandem_layout& kept,
                                const tandem_layout& reduced, tandem_u64 rows, tandem_u64 len) {
    TANDEM_GRID_STRIDE_LOOP(r, rows) {
        tandem_i64 p = positions[r];
        if (p >= 0 && (tandem_u64)p < len) {
            grad[tandem_layout_index(kept, r) + tandem_layout_index(reduced, (tandem_u64)p)] =
                g[tandem_layout_index(g_layout, r)];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Instantiations: <op>_<dtype>.
// ---------------------------------------------------------------------------------------------

#define REDUCE_DTYPE(NAME, T)                                                                  \
    extern "C" __global__ void sum_rows_##NAME(const T* x, tandem_layout layout, T* out,       \
                                               tandem_u64 rows, tandem_u64 len,                \
                                               int warp_per_row,                               \
                                               tandem_compute<T>::type scale) {                \
        sum_rows_impl<T>(x, layout, out, rows, len, warp_per_row, scale);                      \
    }                                                                                          \
    TANDEM_HOST_EXPORT(sum_rows_##NAME)                                                        \
    extern "C" __global__ void sum_columns_##NAME(const T* x, T* out, tandem_u64 outer,        \
                                                  tandem_u64 len, tandem_u64 inner,            \
                                                  tandem_compute<T>::type scale) {             \
        sum_columns_impl<T>(x, out, outer, len, inner, scale);                                 \
    }                                                                                          \
    TANDEM_HOST_EXPORT(sum_columns_##NAME)                                                     \
    extern "C" __global__ void sum_partial_##NAME(const T* x, tandem_u64 n, T* partials) {     \
        sum_partial_impl<T>(x, n, partials);                                                   \
    }                                                                                          \
    TANDEM_HOST_EXPORT(sum_partial_##NAME)                                                     \
    extern "C" __global__ void max_rows_##NAME(const T* x, tandem_layout layout, T* values,    \
                                               tandem_i64* positions, tandem_u64 rows,         \
                                               tandem_u64 len, int warp_per_row) {             \
        max_rows_impl<T>(x, layout, values, positions, rows, len, warp_per_row);               \
    }                                                                                          \
    TANDEM_HOST_EXPORT(max_rows_##NAME)                                                        \
    extern "C" __global__ void broadcast_scaled_##NAME(T* out, tandem_u64 n, const T* g,       \
                                                       tandem_layout g_layout,                 \
                                                       tandem_compute<T>::type scale) {        \
        broadcast_scaled_impl<T>(out, n, g, g_layout, scale);                                  \
    }                                                                                          \
    TANDEM_HOST_EXPORT(broadcast_scaled_##NAME)                                                \
    extern "C" __global__ void max_scatter_##NAME(                                             \
        T* grad, const T* g, tandem_layout g_layout, const tandem_i64* positions,              \
        tandem_layout kept, tandem_layout reduced, tandem_u64 rows, tandem_u64 len) {          \
        max_scatter_impl<T>(grad, g, g_layout, positions, kept, reduced, rows, len);           \
    }                                                                                          \
    TANDEM_HOST_EXPORT(max_scatter_##NAME)

REDUCE_DTYPE(f32, float)
REDUCE_DTYPE(f64, double)
