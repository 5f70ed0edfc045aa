// batch_norm.cu: the phases of batch normalization on the GPU (ops/src/batch_norm/phases.rs).
// The launches are built by ops/src/batch_norm/cuda/launch.rs; the CPU kernels they mirror are in
// ops/src/batch_norm/cpu/.
//
// The input is viewed as [N, C, L] (L = H·W…), contiguous, so channel c is N runs of L
// elements, C·L apart. Two kinds of kernel:
//
// - Per-channel reductions (the statistics, the backward reduce): block b of the grid handles
//   split s of channel c (b = c·splits + s), a fixed range of that channel's N·L elements
//   visited in row-major order, so a warp reads consecutive addresses within each run. Each
//   block sums in a fixed order and writes its two totals (f64) to `partials`; a finish kernel
//   adds a channel's partials in a fixed order (one warp per channel). With one split the
//   reduction kernel finishes the channel itself. Results are deterministic for given shapes:
//   the splits depend on the shape only.
// - Elementwise passes (apply, backward apply): one thread per vector of elements, the
//   channel of a vector found with two multiply-shift divisions.
//
// Both read vectors of 16 bytes (4 f32 or 2 f64) when the launch builder found every pointer
// aligned and L a multiple of the vector width (so a vector never straddles two runs), else
// single elements (`vector` = 1).
//
// Numerics. Per element the arithmetic is the CPU kernel's, in the element type, with products
// never fused into additions (tandem_mul_rn), so that the forward's output and the ReLU masks
// the backward recomputes agree with the CPU's bit for bit given the same per-channel
// constants. Sums are taken per vector in the element type and accumulated in f64 beyond (per
// thread, across the block, across splits). The statistics sum x − K and (x − K)² with K the
// channel's first element (the shifted-data variance: no cancellation as long as the values
// are not far from K compared with their spread). Per-channel constants are computed in f64
// with the CPU's formulas (IEEE division and square root, products rounded on their own).

#include "tandem.cuh"

// Vectors of 16 bytes.
template <typename T>
struct bn_vector_width;
template <>
struct bn_vector_width<float> {
    static const int value = 4;
};
template <>
struct bn_vector_width<double> {
    static const int value = 2;
};

template <typename T, int V>
struct alignas(sizeof(T) * V) bn_vec {
    T v[V];
};

// A per-channel f32 or f64 vector (`ChannelArg` in cuda/launch.rs): element c is at
// address + c·stride elements. `present` = 0: no vector (a default value is used instead).
struct bn_channel {
    tandem_u64 address;
    tandem_u64 stride;
    tandem_u32 is_f64;
    tandem_u32 present;
};

TANDEM_FN double bn_get(const bn_channel& p, tandem_u64 c, double absent) {
    if (!p.present) {
        return absent;
    }
    if (p.is_f64) {
        return reinterpret_cast<const double*>(p.address)[c * p.stride];
    }
    return (double)reinterpret_cast<const float*>(p.address)[c * p.stride];
}

// Rounds to the vector's dtype (nearest even), as the CPU's `to_dtype` does.
TANDEM_FN void bn_set(const bn_channel& p, tandem_u64 c, double value) {
    if (p.is_f64) {
        reinterpret_cast<double*>(p.address)[c * p.stride] = value;
    } else {
        reinterpret_cast<float*>(p.address)[c * p.stride] = (float)value;
    }
}

// Division by a fixed divisor (`Divider` in cuda/launch.rs). For dividends below 2^32 and divisors
// below 2^32 (shift < 64): q = (hi32(n·multiplier) + n) >> shift, the round-up multiply-shift
// of Granlund and Montgomery, exact for every such n. Otherwise a plain 64-bit division.
struct bn_divider {
    tandem_u64 divisor;
    tandem_u32 multiplier;
    tandem_u32 shift;
};

TANDEM_FN tandem_u64 bn_div(tandem_u64 n, const bn_divider& d) {
    if ((n >> 32) == 0 && d.shift < 64) {
        tandem_u64 t = (n * (tandem_u64)d.multiplier) >> 32;
        return (t + n) >> d.shift;
    }
    return n / d.divisor;
}

// ReLU of a normalised value as the CPU computes it: 0 where negative, else the value (NaN and
// -0.0 pass).
template <typename T>
TANDEM_FN T bn_relu(T z) {
    return z < T(0) ? T(0) : z;
}

// ---------------------------------------------------------------------------------------------
// Per-channel reductions.
// ---------------------------------------------------------------------------------------------

// Calls f(vector index) for the vectors of channel c in [begin, end) (counted in the channel's
// own row-major order) that this thread takes: begin + threadIdx.x, then every blockDim.x.
// rows: the divider by the run length in vectors; row_stride = C · run length.
template <typename F>
TANDEM_FN void bn_channel_vectors(tandem_u64 c, tandem_u64 row_stride, const bn_divider& rows,
                                  tandem_u64 begin, tandem_u64 end, F f) {
    tandem_u64 l = rows.divisor;
    tandem_u64 j = begin + threadIdx.x;
    if (j >= end) {
        return;
    }
    tandem_u64 row = bn_div(j, rows);
    tandem_u64 col = j - row * l;
    tandem_u64 step_rows = bn_div(blockDim.x, rows);
    tandem_u64 step_cols = blockDim.x - step_rows * l;
    tandem_u64 at = row * row_stride + c * l + col;
    tandem_u64 jump = step_rows * row_stride + step_cols;
    for (; j < end; j += blockDim.x) {
        f(at);
        at += jump;
        col += step_cols;
        if (col >= l) {
            col -= l;
            at += row_stride - l;
        }
    }
}

// Σ(x − shift) and Σ(x − shift)² over this thread's vectors of channel c.
template <typename T, int V>
TANDEM_FN void bn_moments(const T* x, tandem_u64 c, tandem_u64 row_stride,
                          const bn_divider& rows, tandem_u64 begin, tandem_u64 end, T shift,
                          double& sum, double& squares) {
    const bn_vec<T, V>* xv = reinterpret_cast<const bn_vec<T, V>*>(x);
    bn_channel_vectors(c, row_stride, rows, begin, end, [&](tandem_u64 at) {
        bn_vec<T, V> v = xv[at];
        T s = T(0), q = T(0);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            T d = v.v[k] - shift;
            s += d;
            q += tandem_mul_rn(d, d);
        }
        sum += (double)s;
        squares += (double)q;
    });
}

// The mean and biased variance of a channel from its shifted sums.
TANDEM_FN void bn_moments_finish(tandem_u64 c, double sum, double squares, double shift,
                                 double count, double* mean, double* var) {
    double d = sum / count;
    mean[c] = shift + d;
    double v = squares / count - tandem_mul_rn(d, d);
    var[c] = v < 0.0 ? 0.0 : v;  // rounding can make it slightly negative; NaN stays
}

// The first element of channel c, the shift of its sums (0 for an empty channel).
template <typename T>
TANDEM_FN T bn_shift(const T* x, tandem_u64 c, tandem_u64 run, tandem_u64 count) {
    return count > 0 ? x[c * run] : T(0);
}

// vectors: per channel (N · run length in vectors); chunk: vectors per split.
template <typename T>
TANDEM_FN void bn_statistics(const T* x, tandem_u64 channels, tandem_u64 vectors,
                             bn_divider rows, int vector, tandem_u32 splits, tandem_u64 chunk,
                             double* partials, double* mean, double* var) {
    __shared__ double scratch[32];
    const int W = bn_vector_width<T>::value;
    tandem_u64 run = rows.divisor * (tandem_u64)vector;
    tandem_u64 row_stride = channels * rows.divisor;
    double count = (double)vectors * (double)vector;
    tandem_u64 blocks = channels * splits;
    for (tandem_u64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        tandem_u64 c = b / splits;
        tandem_u64 begin = (b - c * splits) * chunk;
        tandem_u64 end = tandem_min_u64(begin + chunk, vectors);
        T shift = bn_shift(x, c, run, vectors);
        double sum = 0.0, squares = 0.0;
        if (vector == W) {
            bn_moments<T, W>(x, c, row_stride, rows, begin, end, shift, sum, squares);
        } else {
            bn_moments<T, 1>(x, c, row_stride, rows, begin, end, shift, sum, squares);
        }
        sum = tandem_block_reduce(sum, tandem_sum_op(), 0.0, scratch);
        squares = tandem_block_reduce(squares, tandem_sum_op(), 0.0, scratch);
        if (threadIdx.x == 0) {
            if (splits == 1) {
                bn_moments_finish(c, sum, squares, (double)shift, count, mean, var);
            } else {
                partials[2 * b] = sum;
                partials[2 * b + 1] = squares;
            }
        }
    }
}

// Channel c's two partial sums over its splits, in a fixed order, by one whole warp.
TANDEM_FN void bn_add_partials(const double* partials, tandem_u64 c, tandem_u32 splits,
                               double& first, double& second) {
    unsigned int lane = threadIdx.x % 32u;
    first = 0.0;
    second = 0.0;
    for (tandem_u32 s = lane; s < splits; s += 32u) {
        first += partials[2 * (c * splits + s)];
        second += partials[2 * (c * splits + s) + 1];
    }
    first = tandem_warp_reduce(first, tandem_sum_op());
    second = tandem_warp_reduce(second, tandem_sum_op());
}

// for each channel c handled by this warp (one warp per channel, grid-stride over channels)
#define BN_FOR_EACH_CHANNEL_BY_WARP(c, channels)                                               \
    for (tandem_u64 c = (tandem_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;        \
         c < (channels); c += (tandem_u64)gridDim.x * (blockDim.x / 32u))

template <typename T>
TANDEM_FN void bn_statistics_finish(const T* x, tandem_u64 channels, tandem_u64 vectors,
                                    tandem_u64 run, tandem_u32 splits, const double* partials,
                                    double count, double* mean, double* var) {
    BN_FOR_EACH_CHANNEL_BY_WARP(c, channels) {
        double sum, squares;
        bn_add_partials(partials, c, splits, sum, squares);
        if (threadIdx.x % 32u == 0) {
            double shift = (double)bn_shift(x, c, run, vectors);
            bn_moments_finish(c, sum, squares, shift, count, mean, var);
        }
    }
}

// How the backward reduce masks the output gradient (`GradMask` in phases.rs).
#define BN_MASK_NONE 0
#define BN_MASK_RELU 1
#define BN_MASK_OUTPUT 2

// Σg' and Σg'·(x − mean) over this thread's vectors of channel c, g' the masked gradient
// (written to `masked` under BN_MASK_OUTPUT).
template <typename T, int V>
TANDEM_FN void bn_grad_sums(const T* g, const T* x, const T* y, T* masked, int mask,
                            tandem_u64 c, tandem_u64 row_stride, const bn_divider& rows,
                            tandem_u64 begin, tandem_u64 end, T mean, T scale, T shift,
                            double& sum, double& centered) {
    typedef bn_vec<T, V> vec;
    const vec* gv = reinterpret_cast<const vec*>(g);
    const vec* xv = reinterpret_cast<const vec*>(x);
    const vec* yv = reinterpret_cast<const vec*>(y);
    vec* mv = reinterpret_cast<vec*>(masked);
    bn_channel_vectors(c, row_stride, rows, begin, end, [&](tandem_u64 at) {
        vec gi = gv[at];
        vec xi = xv[at];
        if (mask == BN_MASK_RELU) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                T z = tandem_mul_rn(scale, xi.v[k]) + shift;
                gi.v[k] = z > T(0) ? gi.v[k] : T(0);
            }
        } else if (mask == BN_MASK_OUTPUT) {
            vec yi = yv[at];
#pragma unroll
            for (int k = 0; k < V; ++k) {
                gi.v[k] = yi.v[k] > T(0) ? gi.v[k] : T(0);
            }
            mv[at] = gi;
        }
        T s = T(0), t = T(0);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            s += gi.v[k];
            t += tandem_mul_rn(gi.v[k], xi.v[k] - mean);
        }
        sum += (double)s;
        centered += (double)t;
    });
}

// table: the [4, C] normalization (mean, 1/σ, scale, shift); sums: the [2, C] result.
template <typename T>
TANDEM_FN void bn_backward_reduce(const T* g, const T* x, const T* y, T* masked, int mask,
                                  const double* table, tandem_u64 channels, tandem_u64 vectors,
                                  bn_divider rows, int vector, tandem_u32 splits,
                                  tandem_u64 chunk, double* partials, double* sums) {
    __shared__ double scratch[32];
    const int W = bn_vector_width<T>::value;
    tandem_u64 row_stride = channels * rows.divisor;
    tandem_u64 blocks = channels * splits;
    for (tandem_u64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        tandem_u64 c = b / splits;
        tandem_u64 begin = (b - c * splits) * chunk;
        tandem_u64 end = tandem_min_u64(begin + chunk, vectors);
        T mean = (T)table[c];
        T scale = (T)table[2 * channels + c];
        T shift = (T)table[3 * channels + c];
        double sum = 0.0, centered = 0.0;
        if (vector == W) {
            bn_grad_sums<T, W>(g, x, y, masked, mask, c, row_stride, rows, begin, end, mean,
                               scale, shift, sum, centered);
        } else {
            bn_grad_sums<T, 1>(g, x, y, masked, mask, c, row_stride, rows, begin, end, mean,
                               scale, shift, sum, centered);
        }
        sum = tandem_block_reduce(sum, tandem_sum_op(), 0.0, scratch);
        centered = tandem_block_reduce(centered, tandem_sum_op(), 0.0, scratch);
        if (threadIdx.x == 0) {
            if (splits == 1) {
                sums[c] = sum;
                sums[channels + c] = centered;
            } else {
                partials[2 * b] = sum;
                partials[2 * b + 1] = centered;
            }
        }
    }
}

extern "C" __global__ void batch_norm_backward_reduce_finish(tandem_u64 channels,
                                                             tandem_u32 splits,
                                                             const double* partials,
                                                             double* sums) {
    BN_FOR_EACH_CHANNEL_BY_WARP(c, channels) {
        double sum, centered;
        bn_add_partials(partials, c, splits, sum, centered);
        if (threadIdx.x % 32u == 0) {
            sums[c] = sum;
            sums[channels + c] = centered;
        }
    }
}
TANDEM_HOST_EXPORT(batch_norm_backward_reduce_finish)

// ---------------------------------------------------------------------------------------------
// Elementwise passes.
// ---------------------------------------------------------------------------------------------

// The channel of vector i: (i / run length) mod C.
TANDEM_FN tandem_u64 bn_channel_of(tandem_u64 i, const bn_divider& rows,
                                   const bn_divider& channels) {
    tandem_u64 row = bn_div(i, rows);
    return row - bn_div(row, channels) * channels.divisor;
}

// What the forward's output pass fuses (`Epilogue` in mod.rs).
#define BN_EPILOGUE_PLAIN 0
#define BN_EPILOGUE_RELU 1
#define BN_EPILOGUE_ADD_RELU 2

template <typename T, int V>
TANDEM_FN void bn_apply(const T* x, const T* residual, T* y, const double* table,
                        tandem_u64 vectors, bn_divider rows, bn_divider channels, int epilogue) {
    typedef bn_vec<T, V> vec;
    const vec* xv = reinterpret_cast<const vec*>(x);
    const vec* rv = reinterpret_cast<const vec*>(residual);
    vec* yv = reinterpret_cast<vec*>(y);
    tandem_u64 C = channels.divisor;
    TANDEM_GRID_STRIDE_LOOP(i, vectors) {
        tandem_u64 c = bn_channel_of(i, rows, channels);
        T scale = (T)table[2 * C + c];
        T shift = (T)table[3 * C + c];
        vec xi = xv[i];
        vec out;
        if (epilogue == BN_EPILOGUE_ADD_RELU) {
            vec ri = rv[i];
#pragma unroll
            for (int k = 0; k < V; ++k) {
                out.v[k] = bn_relu(tandem_mul_rn(scale, xi.v[k]) + shift + ri.v[k]);
            }
        } else if (epilogue == BN_EPILOGUE_RELU) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                out.v[k] = bn_relu(tandem_mul_rn(scale, xi.v[k]) + shift);
            }
        } else {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                out.v[k] = tandem_mul_rn(scale, xi.v[k]) + shift;
            }
        }
        yv[i] = out;
    }
}

// coefficients: [4, C] of T, rows a, offset, slope, shift (see batch_norm_backward_coefficients):
// grad_x = a·g' + offset + slope·x, g' = g masked where shift + a·x ≤ 0 under relu_mask.
template <typename T, int V>
TANDEM_FN void bn_backward_apply(const T* g, const T* x, T* out, const T* coefficients,
                                 tandem_u64 vectors, bn_divider rows, bn_divider channels,
                                 int relu_mask) {
    typedef bn_vec<T, V> vec;
    const vec* gv = reinterpret_cast<const vec*>(g);
    const vec* xv = reinterpret_cast<const vec*>(x);
    vec* ov = reinterpret_cast<vec*>(out);
    tandem_u64 C = channels.divisor;
    TANDEM_GRID_STRIDE_LOOP(i, vectors) {
        tandem_u64 c = bn_channel_of(i, rows, channels);
        T a = coefficients[c];
        T offset = coefficients[C + c];
        T slope = coefficients[2 * C + c];
        T shift = coefficients[3 * C + c];
        vec gi = gv[i];
        vec xi = xv[i];
        vec o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            T gk = gi.v[k];
            if (relu_mask) {
                T z = tandem_mul_rn(a, xi.v[k]) + shift;
                gk = z > T(0) ? gk : T(0);
            }
            o.v[k] = tandem_mul_rn(a, gk) + offset + tandem_mul_rn(slope, xi.v[k]);
        }
        ov[i] = o;
    }
}

// ---------------------------------------------------------------------------------------------
// Per-channel constants: one thread per channel, in f64 with the CPU's formulas.
// ---------------------------------------------------------------------------------------------

// The count a kernel divides by: the host's value, or an f64 in device memory (`at`, the first
// element of all-reduced statistic sums) that the host has not read (`CountArg` in cuda/launch.rs).
TANDEM_FN double bn_count(double host, const bn_channel& at) {
    return at.present ? bn_get(at, 0, host) : host;
}

// sums = [count, count·mean…, count·(var + mean²)…] (`Statistics::to_sums`).
extern "C" __global__ void batch_norm_to_sums(bn_channel mean, bn_channel var, tandem_u64 channels,
                                              double count_host, bn_channel count_at,
                                              double* sums) {
    double count = bn_count(count_host, count_at);
    // The count is written also when there are no channels.
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        sums[0] = count;
    }
    TANDEM_GRID_STRIDE_LOOP(c, channels) {
        double m = bn_get(mean, c, 0.0);
        double v = bn_get(var, c, 0.0);
        sums[1 + c] = tandem_mul_rn(count, m);
        sums[1 + channels + c] = tandem_mul_rn(count, v + tandem_mul_rn(m, m));
    }
}
TANDEM_HOST_EXPORT(batch_norm_to_sums)

// Whether a count of values is one the statistics can be taken of: a whole number above 1 that
// f64 holds exactly (the CPU's check in `Statistics::from_sums`; NaN and infinities fail).
TANDEM_FN bool bn_count_ok(double n) {
    return n >= 2.0 && n < 9007199254740992.0 && n == floor(n);
}

// The inverse (`Statistics::from_sums`): mean = Σx/n, var = max(Σx²/n − mean², 0). The count
// stays on the device, so it is checked here: a bad one is recorded in the deferred-error record
// (core/src/cuda/deferred.rs; position 0, value the count's f64 bits, bound 2), which the host
// reports at its next read, worded as the CPU's error. Thread 0 checks, also for no channels.
extern "C" __global__ void batch_norm_from_sums(bn_channel sums, tandem_u64 channels,
                                                double* mean, double* var, tandem_u32* claim,
                                                tandem_i64* record, tandem_u32 code) {
    double n = bn_get(sums, 0, 0.0);
    if (blockIdx.x == 0 && threadIdx.x == 0 && !bn_count_ok(n)) {
        tandem_deferred_record(claim, record, code, 0, __double_as_longlong(n), 2);
    }
    TANDEM_GRID_STRIDE_LOOP(c, channels) {
        double m = bn_get(sums, 1 + c, 0.0) / n;
        mean[c] = m;
        // f64::max: the non-NaN operand wins, as fmax's does.
        var[c] = fmax(bn_get(sums, 1 + channels + c, 0.0) / n - tandem_mul_rn(m, m), 0.0);
    }
}
TANDEM_HOST_EXPORT(batch_norm_from_sums)

// running = (1 − momentum)·running + momentum·factor·stat, for the mean (factor 1) and the
// variance (factor count/(count − 1), the unbiased variance: `factor` from the host, or from the
// count in device memory at `count_at`, with the host's formula).
extern "C" __global__ void batch_norm_update_running(bn_channel running_mean,
                                                     bn_channel running_var, bn_channel mean,
                                                     bn_channel var, tandem_u64 channels,
                                                     double momentum, double factor,
                                                     bn_channel count_at) {
    if (count_at.present) {
        double n = bn_get(count_at, 0, 0.0);
        factor = n / (n - 1.0);
    }
    double keep = 1.0 - momentum;
    double weight = tandem_mul_rn(momentum, factor);
    TANDEM_GRID_STRIDE_LOOP(c, channels) {
        if (running_mean.present) {
            double old = bn_get(running_mean, c, 0.0);
            double stat = bn_get(mean, c, 0.0);
            bn_set(running_mean, c, tandem_mul_rn(keep, old) + tandem_mul_rn(momentum, stat));
        }
        if (running_var.present) {
            double old = bn_get(running_var, c, 0.0);
            double stat = bn_get(var, c, 0.0);
            bn_set(running_var, c, tandem_mul_rn(keep, old) + tandem_mul_rn(weight, stat));
        }
    }
}
TANDEM_HOST_EXPORT(batch_norm_update_running)

// table = [mean…, 1/σ…, scale…, shift…] with 1/σ = 1/sqrt(var + eps), scale = w/σ,
// shift = b − mean·scale (weight 1 and bias 0 when absent).
extern "C" __global__ void batch_norm_normalization(bn_channel mean, bn_channel var,
                                                    bn_channel weight, bn_channel bias,
                                                    tandem_u64 channels, double eps,
                                                    double* table) {
    TANDEM_GRID_STRIDE_LOOP(c, channels) {
        double m = bn_get(mean, c, 0.0);
        double invstd = 1.0 / sqrt(bn_get(var, c, 0.0) + eps);
        double scale = tandem_mul_rn(bn_get(weight, c, 1.0), invstd);
        table[c] = m;
        table[channels + c] = invstd;
        table[2 * channels + c] = scale;
        table[3 * channels + c] = bn_get(bias, c, 0.0) - tandem_mul_rn(m, scale);
    }
}
TANDEM_HOST_EXPORT(batch_norm_normalization)

// The per-channel constants of the input gradient, rounded to T: a = w/σ; in training
// slope = −a·(1/σ)·(Σg'·x̂)/m and offset = −a·Σg'/m − slope·mean (Σg'·x̂ = Σg'·(x − mean)/σ),
// in evaluation 0 and 0; and the forward's shift, for the ReLU mask.
template <typename T>
TANDEM_FN void bn_backward_coefficients(const double* table, bn_channel sum_g,
                                        bn_channel sum_centered, tandem_u64 channels,
                                        double count_host, bn_channel count_at, int training,
                                        T* coefficients) {
    double count = bn_count(count_host, count_at);
    TANDEM_GRID_STRIDE_LOOP(c, channels) {
        double mean = table[c];
        double invstd = table[channels + c];
        double a = table[2 * channels + c];
        double slope = 0.0, offset = 0.0;
        if (training) {
            double sum_g_xhat = tandem_mul_rn(bn_get(sum_centered, c, 0.0), invstd);
            slope = tandem_mul_rn(tandem_mul_rn(-a, invstd), sum_g_xhat) / count;
            offset = tandem_mul_rn(-a, bn_get(sum_g, c, 0.0)) / count - tandem_mul_rn(slope, mean);
        }
        coefficients[c] = (T)a;
        coefficients[channels + c] = (T)offset;
        coefficients[2 * channels + c] = (T)slope;
        coefficients[3 * channels + c] = (T)table[3 * channels + c];
    }
}

// grad_weight = Σg'·(x − mean)·(1/σ), grad_bias = Σg', rounded to T.
template <typename T>
TANDEM_FN void bn_parameter_gradients(bn_channel sum_g, bn_channel sum_centered,
                                      const double* table, tandem_u64 channels, T* grad_weight,
                                      T* grad_bias) {
    TANDEM_GRID_STRIDE_LOOP(c, channels) {
        grad_weight[c] = (T)tandem_mul_rn(bn_get(sum_centered, c, 0.0), table[channels + c]);
        grad_bias[c] = (T)bn_get(sum_g, c, 0.0);
    }
}

// num_batches_tracked += 1.
extern "C" __global__ void batch_norm_count_batch(tandem_i64* counter) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *counter += 1;
    }
}
TANDEM_HOST_EXPORT(batch_norm_count_batch)

// ---------------------------------------------------------------------------------------------
// Entry points per dtype.
// ---------------------------------------------------------------------------------------------

#define BN_DTYPE(NAME, T)                                                                      \
    extern "C" __global__ void batch_norm_statistics_##NAME(                                   \
        const T* x, tandem_u64 channels, tandem_u64 vectors, bn_divider rows, int vector,      \
        tandem_u32 splits, tandem_u64 chunk, double* partials, double* mean, double* var) {    \
        bn_statistics<T>(x, channels, vectors, rows, vector, splits, chunk, partials, mean,    \
                         var);                                                                 \
    }                                                                                          \
    TANDEM_HOST_EXPORT(batch_norm_statistics_##NAME)                                           \
                                                                                               \
    extern "C" __global__ void batch_norm_statistics_finish_##NAME(                            \
        const T* x, tandem_u64 channels, tandem_u64 vectors, tandem_u64 run,                   \
        tandem_u32 splits, const double* partials, double count, double* mean, double* var) {  \
        bn_statistics_finish<T>(x, channels, vectors, run, splits, partials, count, mean,      \
                                var);                                                          \
    }                                                                                          \
    TANDEM_HOST_EXPORT(batch_norm_statistics_finish_##NAME)                                    \
                                                                                               \
    extern "C" __global__ void batch_norm_apply_##NAME(                                        \
        const T* x, const T* residual, T* y, const double* table, tandem_u64 vectors,          \
        bn_divider rows, bn_divider channels, int vector, int epilogue) {                      \
        if (vector == bn_vector_width<T>::value) {                                             \
            bn_apply<T, bn_vector_width<T>::value>(x, residual, y, table, vectors, rows,       \
                                                   channels, epilogue);                        \
        } else {                                                                               \
            bn_apply<T, 1>(x, residual, y, table, vectors, rows, channels, epilogue);          \
        }                                                                                      \
    }                                                                                          \
    TANDEM_HOST_EXPORT(batch_norm_apply_##NAME)                                                \
                                                                                               \
    extern "C" __global__ void batch_norm_backward_reduce_##NAME(                              \
        const T* g, const T* x, const T* y, T* masked, int mask, const double* table,          \
        tandem_u64 channels, tandem_u64 vectors, bn_divider rows, int vector,                  \
        tandem_u32 splits, tandem_u64 chunk, double* partials, double* sums) {                 \
        bn_backward_reduce<T>(g, x, y, masked, mask, table, channels, vectors, rows, vector,   \
                              splits, chunk, partials, sums);                                  \
    }                                                                                          \
    TANDEM_HOST_EXPORT(batch_norm_backward_reduce_##NAME)                                      \
                                                                                               \
    extern "C" __global__ void batch_norm_backward_coefficients_##NAME(                        \
        const double* table, bn_channel sum_g, bn_channel sum_centered, tandem_u64 channels,   \
        double count_host, bn_channel count_at, int training, T* coefficients) {               \
        bn_backward_coefficients<T>(table, sum_g, sum_centered, channels, count_host,          \
                                    count_at, training, coefficients);                         \
    }                                                                                          \
    TANDEM_HOST_EXPORT(batch_norm_backward_coefficients_##NAME)                                \
                                                                                               \
    extern "C" __global__ void batch_norm_backward_apply_##NAME(                               \
        const T* g, const T* x, T* out, const T* coefficients, tandem_u64 vectors,             \
        bn_divider rows, bn_divider channels, int vector, int relu_mask) {                     \
        if (vector == bn_vector_width<T>::value) {                                             \
            bn_backward_apply<T, bn_vector_width<T>::value>(g, x, out, coefficients, vectors,  \
                                                            rows, channels, relu_mask);        \
        } else {                                                                               \
            bn_backward_apply<T, 1>(g, x, out, coefficients, vectors, rows, channels,          \
                                    relu_mask);                                                \
        }                                                                                      \
    }                                                                                          \
    TANDEM_HOST_EXPORT(batch_norm_backward_apply_##NAME)                                       \
                                                                                               \
    extern "C" __global__ void batch_norm_parameter_gradients_##NAME(                          \
        bn_channel sum_g, bn_channel sum_centered, const double* table, tandem_u64 channels,   \
        T* grad_weight, T* grad_bias) {                                                        \
        bn_parameter_gradients<T>(sum_g, sum_centered, table, channels, grad_weight,           \
                                  grad_bias);                                                  \
    }                                                                                          \
    TANDEM_HOST_EXPORT(batch_norm_parameter_gradients_##NAME)

BN_DTYPE(f32, float)
BN_DTYPE(f64, double)
