// tandem.cuh: the header every tandem kernel includes.
//
// It gives kernels what they would otherwise take from the CUDA toolkit's headers (which tandem
// never needs at run time): fixed-size integer types, 16-bit float storage types with exact
// conversions, the layout struct strided kernels receive, the grid-stride loop, and block
// reductions. NVRTC compiles it with every kernel source; the host harness compiles it with the
// host C++ compiler after `tandem_host.h`, which emulates the CUDA execution model.
//
// CONVENTIONS for writing a tandem kernel
//
//  1. Files. An op's kernels live in `ops/src/<op>/<op>.cu`, the runtime's in
//     `core/src/cuda/kernels/runtime.cu`; helpers shared by several kernels of an op go in a
//     `.cuh` beside them. The file's stem is unique in the workspace: it names the compiled
//     module. Each `.cu` is embedded by a `KernelSource` static (`include_str!`) that lists the
//     headers it includes besides this one. Include with quotes only (`#include "tandem.cuh"`);
//     no `<...>` includes and no CUDA toolkit headers.
//  2. Names. Kernels are `extern "C" __global__ void <op>_<dtype>(...)`, dtype one of f32 f64
//     f16 bf16 i64 u8 (a cast is `cast_<from>_<to>`). Write the body once as a template and
//     instantiate it for each dtype through a macro. Every kernel definition is followed by
//     `TANDEM_HOST_EXPORT(<name>)`, which expands to nothing under NVRTC and to the host entry
//     point `tandem_host_<name>` in the harness.
//  3. Arguments. Plain pointers (`T*`, `const T*`), scalars (`int`, `unsigned`, `tandem_i64`,
//     `tandem_u64`, `float`, `double`, `tandem_f16`, `tandem_bf16`, `tandem_u8`) and plain
//     structs by value (`tandem_layout`), matching `KernelArg` in `core/src/cuda/launch.rs`.
//     Scalars that are values of a tensor's dtype are converted on the host, in the launch
//     builder, exactly as the CPU op converts them.
//  4. Indices. Element indices, element counts and storage offsets are 64-bit (`tandem_u64`):
//     a tensor may exceed 2^31 elements, and a grid-stride loop's index passes the count. A
//     kernel may use 32-bit indices only for a size its launch builder has checked with
//     `index_u32` (launch.rs), and says so in a comment.
//  5. Any size. Every kernel handles any `n`, including 0 (a launch always has at least one
//     block): grid-stride loops (`TANDEM_GRID_STRIDE_LOOP`) or explicit bounds checks. Grids and
//     blocks come only from `LaunchConfig`'s constructors, which check the device limits.
//  6. Blocks are 1-D and whole warps (a multiple of 32, at most 1024; `LaunchConfig` enforces
//     it). Warp intrinsics use the full mask `0xffffffffu`. Every thread of a block reaches
//     each `__syncthreads()` and every lane of a warp reaches each warp intrinsic: no early
//     `return` before a barrier.
//  7. Shared memory. Static `__shared__` arrays inside the kernel, or dynamic shared memory
//     through `TANDEM_DYNAMIC_SHARED(type, name)` (never a bare `extern __shared__`). At most
//     48 KiB per block in all.
//  8. Floating point. No fast-math. f16 and bf16 are stored as `tandem_f16` / `tandem_bf16`
//     and computed in float; every conversion rounds to nearest even and is written in plain
//     integer code, so the harness runs exactly what the GPU runs. NVRTC contracts `a * b + c`
//     into a fused multiply-add; where a result must equal the CPU's bit for bit, multiply with
//     `tandem_mul_rn` (never contracted).
//  9. Portability. The same file is compiled as C++17 by the host compiler. Use only the
//     device built-ins `tandem_host.h` emulates (thread and block indices, `__syncthreads`,
//     `__syncwarp`, `__shfl*_sync`, `__ballot_sync`, `__any_sync`, `__all_sync`, the atomics
//     `atomicAdd/Sub/Max/Min/Exch/CAS`, bit casts such as `__float_as_uint`, the `_rn`
//     arithmetic intrinsics, and the usual math functions). Inline PTX only under
//     `#ifdef __CUDA_ARCH__` with a portable `#else`.
// 10. Spills. The NVRTC test compiles every kernel for sm_80 and sm_90 and fails for a kernel
//     that spills registers unless its file has a comment `// spills: <kernel>: <why>`.

#ifndef TANDEM_CUH
#define TANDEM_CUH

// The host harness defines these before including this header.
#ifndef TANDEM_HOST_EXPORT
#define TANDEM_HOST_EXPORT(name)
#endif
#ifndef TANDEM_DYNAMIC_SHARED
#define TANDEM_DYNAMIC_SHARED(type, name)                                                      \
    extern __shared__ __align__(16) unsigned char tandem_dynamic_shared_[];                   \
    type* name = reinterpret_cast<type*>(tandem_dynamic_shared_)
#endif

// Every helper is a device function, inlined.
#define TANDEM_FN __device__ __forceinline__

typedef long long tandem_i64;
typedef unsigned long long tandem_u64;
typedef unsigned int tandem_u32;
typedef unsigned short tandem_u16;
typedef unsigned char tandem_u8;

// ---------------------------------------------------------------------------------------------
// 16-bit floats: storage types with exact, round-to-nearest-even conversions.
// ---------------------------------------------------------------------------------------------

// IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits.
struct tandem_f16 {
    tandem_u16 bits;
};

// bfloat16: the top half of an f32 (1 sign, 8 exponent, 7 mantissa bits).
struct tandem_bf16 {
    tandem_u16 bits;
};

TANDEM_FN tandem_f16 tandem_f16_from_bits(tandem_u32 bits) {
    tandem_f16 h;
    h.bits = (tandem_u16)bits;
    return h;
}

TANDEM_FN tandem_bf16 tandem_bf16_from_bits(tandem_u32 bits) {
    tandem_bf16 h;
    h.bits = (tandem_u16)bits;
    return h;
}

// Rounds `m >> shift` to nearest, ties to even (1 <= shift <= 63).
TANDEM_FN tandem_u64 tandem_shift_round_even(tandem_u64 m, tandem_u32 shift) {
    tandem_u64 r = m >> shift;
    tandem_u64 rest = m & ((1ull << shift) - 1);
    tandem_u64 half = 1ull << (shift - 1);
    if (rest > half || (rest == half && (r & 1))) {
        r += 1;
    }
    return r;
}

// Exact. NaNs stay NaN (quieted), keeping their sign and top payload bits.
TANDEM_FN float tandem_f16_to_f32(tandem_f16 h) {
    tandem_u32 sign = ((tandem_u32)h.bits & 0x8000u) << 16;
    tandem_u32 exponent = ((tandem_u32)h.bits >> 10) & 0x1fu;
    tandem_u32 mantissa = (tandem_u32)h.bits & 0x3ffu;
    if (exponent == 0x1fu) {
        tandem_u32 nan = mantissa != 0 ? 0x00400000u : 0u;
        return __uint_as_float(sign | 0x7f800000u | nan | (mantissa << 13));
    }
    if (exponent == 0) {
        // Zero or subnormal: mantissa * 2^-24, exact in float.
        float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Round to nearest even; overflow gives infinity, NaN stays NaN.
TANDEM_FN tandem_f16 tandem_f32_to_f16(float value) {
    tandem_u32 x = __float_as_uint(value);
    tandem_u32 sign = (x >> 16) & 0x8000u;
    tandem_u32 magnitude = x & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) {
        tandem_u32 nan = magnitude > 0x7f800000u ? 0x200u | ((magnitude >> 13) & 0x3ffu) : 0u;
        return tandem_f16_from_bits(sign | 0x7c00u | nan);
    }
    if (magnitude >= 0x477ff000u) {  // 65520 and above round to infinity
        return tandem_f16_from_bits(sign | 0x7c00u);
    }
    if (magnitude >= 0x38800000u) {  // 2^-14 and above: normal
        tandem_u64 r = tandem_shift_round_even(magnitude - 0x38000000u, 13);
        return tandem_f16_from_bits(sign | (tandem_u32)r);
    }
    if (magnitude <= 0x33000000u) {  // 2^-25 and below round to zero
        return tandem_f16_from_bits(sign);
    }
    // Subnormal: the value in units of 2^-24, rounded.
    tandem_u32 exponent = magnitude >> 23;
    tandem_u64 mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    return tandem_f16_from_bits(sign | (tandem_u32)tandem_shift_round_even(mantissa, 126u - exponent));
}

// Round to nearest even, directly from double (no double rounding through float).
TANDEM_FN tandem_f16 tandem_f64_to_f16(double value) {
    tandem_u64 x = (tandem_u64)__double_as_longlong(value);
    tandem_u32 sign = (tandem_u32)(x >> 48) & 0x8000u;
    tandem_u64 magnitude = x & 0x7fffffffffffffffull;
    if (magnitude >= 0x7ff0000000000000ull) {
        tandem_u32 nan = magnitude > 0x7ff0000000000000ull
                             ? 0x200u | ((tandem_u32)(magnitude >> 42) & 0x3ffu)
                             : 0u;
        return tandem_f16_from_bits(sign | 0x7c00u | nan);
    }
    if (magnitude >= 0x40effe0000000000ull) {  // 65520
        return tandem_f16_from_bits(sign | 0x7c00u);
    }
    if (magnitude >= 0x3f10000000000000ull) {  // 2^-14
        tandem_u64 r = tandem_shift_round_even(magnitude - (1008ull << 52), 42);
        return tandem_f16_from_bits(sign | (tandem_u32)r);
    }
    if (magnitude <= 0x3e60000000000000ull) {  // 2^-25
        return tandem_f16_from_bits(sign);
    }
    tandem_u32 exponent = (tandem_u32)(magnitude >> 52);
    tandem_u64 mantissa = (magnitude & 0xfffffffffffffull) | (1ull << 52);
    return tandem_f16_from_bits(sign | (tandem_u32)tandem_shift_round_even(mantissa, 1051u - exponent));
}

// Exact. NaNs are quieted.
TANDEM_FN float tandem_bf16_to_f32(tandem_bf16 h) {
    tandem_u32 bits = (tandem_u32)h.bits;
    if ((bits & 0x7fffu) > 0x7f80u) {
        bits |= 0x40u;
    }
    return __uint_as_float(bits << 16);
}

// Round to nearest even; overflow gives infinity, NaN stays NaN.
TANDEM_FN tandem_bf16 tandem_f32_to_bf16(float value) {
    tandem_u32 x = __float_as_uint(value);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return tandem_bf16_from_bits((x >> 16) | 0x40u);
    }
    return tandem_bf16_from_bits((tandem_u32)tandem_shift_round_even(x, 16));
}

// Round to nearest even, directly from double.
TANDEM_FN tandem_bf16 tandem_f64_to_bf16(double value) {
    tandem_u64 x = (tandem_u64)__double_as_longlong(value);
    tandem_u32 sign = (tandem_u32)(x >> 48) & 0x8000u;
    tandem_u64 magnitude = x & 0x7fffffffffffffffull;
    if (magnitude >= 0x7ff0000000000000ull) {
        tandem_u32 nan = magnitude > 0x7ff0000000000000ull
                             ? 0x40u | ((tandem_u32)(magnitude >> 45) & 0x7fu)
                             : 0u;
        return tandem_bf16_from_bits(sign | 0x7f80u | nan);
    }
    if (magnitude >= 0x47eff00000000000ull) {  // halfway between the largest bf16 and 2^128
        return tandem_bf16_from_bits(sign | 0x7f80u);
    }
    if (magnitude >= 0x3810000000000000ull) {  // 2^-126: normal
        tandem_u64 r = tandem_shift_round_even(magnitude - (896ull << 52), 45);
        return tandem_bf16_from_bits(sign | (tandem_u32)r);
    }
    if (magnitude <= 0x3790000000000000ull) {  // 2^-134, half the smallest subnormal
        return tandem_bf16_from_bits(sign);
    }
    tandem_u32 exponent = (tandem_u32)(magnitude >> 52);
    tandem_u64 mantissa = (magnitude & 0xfffffffffffffull) | (1ull << 52);
    return tandem_bf16_from_bits(sign | (tandem_u32)tandem_shift_round_even(mantissa, 942u - exponent));
}

// ---------------------------------------------------------------------------------------------
// Conversions between dtypes, with the CPU's semantics (`Element::to_f64` / `from_f64` in
// core/src/dtype.rs): every value goes through double; floats round to nearest even; floats to
// integers truncate toward zero and saturate, NaN gives 0.
// ---------------------------------------------------------------------------------------------

TANDEM_FN double tandem_to_f64(float v) { return (double)v; }
TANDEM_FN double tandem_to_f64(double v) { return v; }
TANDEM_FN double tandem_to_f64(tandem_f16 v) { return (double)tandem_f16_to_f32(v); }
TANDEM_FN double tandem_to_f64(tandem_bf16 v) { return (double)tandem_bf16_to_f32(v); }
TANDEM_FN double tandem_to_f64(tandem_i64 v) { return (double)v; }
TANDEM_FN double tandem_to_f64(tandem_u8 v) { return (double)v; }

template <typename T>
TANDEM_FN T tandem_from_f64(double v);

template <>
TANDEM_FN float tandem_from_f64<float>(double v) { return (float)v; }
template <>
TANDEM_FN double tandem_from_f64<double>(double v) { return v; }
template <>
TANDEM_FN tandem_f16 tandem_from_f64<tandem_f16>(double v) { return tandem_f64_to_f16(v); }
template <>
TANDEM_FN tandem_bf16 tandem_from_f64<tandem_bf16>(double v) { return tandem_f64_to_bf16(v); }
template <>
TANDEM_FN tandem_i64 tandem_from_f64<tandem_i64>(double v) {
    if (v != v) {
        return 0;
    }
    if (v >= 9223372036854775808.0) {
        return 0x7fffffffffffffffll;
    }
    if (v <= -9223372036854775808.0) {
        return -0x7fffffffffffffffll - 1;
    }
    return (tandem_i64)v;
}
template <>
TANDEM_FN tandem_u8 tandem_from_f64<tandem_u8>(double v) {
    if (!(v > 0.0)) {  // also NaN
        return 0;
    }
    if (v >= 255.0) {
        return 255;
    }
    return (tandem_u8)(tandem_u32)v;
}

// The type a dtype is computed in: float for the 16-bit floats, the type itself otherwise.
template <typename T>
struct tandem_compute {
    typedef T type;
};
template <>
struct tandem_compute<tandem_f16> {
    typedef float type;
};
template <>
struct tandem_compute<tandem_bf16> {
    typedef float type;
};

TANDEM_FN float tandem_load(float v) { return v; }
TANDEM_FN double tandem_load(double v) { return v; }
TANDEM_FN float tandem_load(tandem_f16 v) { return tandem_f16_to_f32(v); }
TANDEM_FN float tandem_load(tandem_bf16 v) { return tandem_bf16_to_f32(v); }

template <typename T>
TANDEM_FN T tandem_store(typename tandem_compute<T>::type v);
template <>
TANDEM_FN float tandem_store<float>(float v) { return v; }
template <>
TANDEM_FN double tandem_store<double>(double v) { return v; }
template <>
TANDEM_FN tandem_f16 tandem_store<tandem_f16>(float v) { return tandem_f32_to_f16(v); }
template <>
TANDEM_FN tandem_bf16 tandem_store<tandem_bf16>(float v) { return tandem_f32_to_bf16(v); }

// A product the compiler may not fuse with a following addition.
TANDEM_FN float tandem_mul_rn(float a, float b) { return __fmul_rn(a, b); }
TANDEM_FN double tandem_mul_rn(double a, double b) { return __dmul_rn(a, b); }

// e^v and ln v in the compute type (float or double).
TANDEM_FN float tandem_exp(float v) { return expf(v); }
TANDEM_FN double tandem_exp(double v) { return exp(v); }
TANDEM_FN float tandem_log(float v) { return logf(v); }
TANDEM_FN double tandem_log(double v) { return log(v); }

// A quiet NaN and -infinity in the compute type, whose value the argument's type selects (no
// NAN or INFINITY macros: kernels include no toolkit header).
TANDEM_FN float tandem_nan(float) { return __uint_as_float(0x7fc00000u); }
TANDEM_FN double tandem_nan(double) { return __longlong_as_double((tandem_i64)0x7ff8000000000000ull); }
TANDEM_FN float tandem_negative_infinity(float) { return __uint_as_float(0xff800000u); }
TANDEM_FN double tandem_negative_infinity(double) {
    return __longlong_as_double((tandem_i64)0xfff0000000000000ull);
}

// ---------------------------------------------------------------------------------------------
// Layouts and loops.
// ---------------------------------------------------------------------------------------------

#define TANDEM_MAX_RANK 8

// `StridedLayout` in launch.rs: element i (row-major) is at
// offset + sum_d index_d(i) * strides[d] over the first `rank` dimensions. Dense tensors arrive
// with rank 1 and stride 1.
struct tandem_layout {
    tandem_u32 rank;
    tandem_u32 padding;
    tandem_u64 offset;
    tandem_u64 shape[TANDEM_MAX_RANK];
    tandem_u64 strides[TANDEM_MAX_RANK];
};

// a / b, dividing in 32 bits while both fit (a 64-bit division is several times slower on the
// GPU). `b` is not 0.
TANDEM_FN tandem_u64 tandem_div_u64(tandem_u64 a, tandem_u64 b) {
    return ((a | b) >> 32) == 0 ? (tandem_u64)((tandem_u32)a / (tandem_u32)b) : a / b;
}

TANDEM_FN tandem_u64 tandem_min_u64(tandem_u64 a, tandem_u64 b) { return a < b ? a : b; }

// The storage index of the i-th element in row-major order. The unravel divides in 32 bits
// while the numbers fit (a 64-bit division is several times slower on the GPU), and the loop is
// not unrolled: unrolled, it doubled NVRTC's compile time of runtime.cu for no register saving.
TANDEM_FN tandem_u64 tandem_layout_index(const tandem_layout& layout, tandem_u64 i) {
    if (layout.rank == 1) {
        return layout.offset + i * layout.strides[0];
    }
    tandem_u64 index = layout.offset;
#pragma unroll 1
    for (int d = TANDEM_MAX_RANK - 1; d >= 0; --d) {
        if (d < (int)layout.rank) {
            tandem_u64 size = layout.shape[d];
            tandem_u64 quotient = tandem_div_u64(i, size);
            index += (i - quotient * size) * layout.strides[d];
            i = quotient;
        }
    }
    return index;
}

// for (tandem_u64 i = first index of this thread; i < n; i += threads in the grid)
#define TANDEM_GRID_STRIDE_LOOP(i, n)                                                          \
    for (tandem_u64 i = (tandem_u64)blockIdx.x * blockDim.x + threadIdx.x,                    \
                    tandem_step_##i = (tandem_u64)gridDim.x * blockDim.x;                      \
         i < (n); i += tandem_step_##i)

// ---------------------------------------------------------------------------------------------
// Elementwise loops: out[i] = f(x[i]) (map) or f(a[i], b[i]) (zip) for i < n, in grid-stride
// loops. Outputs are dense. The dense forms move 16-byte packs (one 128-bit access each) when
// every pointer is 16-byte aligned, then the elements past the last whole pack one by one; when
// a pointer is not aligned every element goes one by one (the test is uniform over the grid,
// so it costs no divergence). Size their grids by packs: ceil(n / TANDEM_PACK_WIDTH(T)) threads.
// The strided forms read each input through its layout.
// ---------------------------------------------------------------------------------------------

// 16 bytes of T (4 floats, 2 doubles), aligned so that it moves in one 128-bit access.
template <typename T>
struct __align__(16) tandem_pack {
    T v[16 / sizeof(T)];
};

#define TANDEM_PACK_WIDTH(T) (16 / sizeof(T))

TANDEM_FN bool tandem_aligned16(const void* p) {
    return (reinterpret_cast<tandem_u64>(p) & 15u) == 0;
}

template <typename T, typename F>
TANDEM_FN void tandem_map_dense(T* out, const T* x, tandem_u64 n, F f) {
    const tandem_u64 width = TANDEM_PACK_WIDTH(T);
    tandem_u64 packs = 0;
    if (tandem_aligned16(out) && tandem_aligned16(x)) {
        packs = n / width;
        const tandem_pack<T>* xp = reinterpret_cast<const tandem_pack<T>*>(x);
        tandem_pack<T>* op = reinterpret_cast<tandem_pack<T>*>(out);
        TANDEM_GRID_STRIDE_LOOP(i, packs) {
            tandem_pack<T> v = xp[i];
#pragma unroll
            for (int k = 0; k < (int)width; ++k) {
                v.v[k] = f(v.v[k]);
            }
            op[i] = v;
        }
    }
    const tandem_u64 done = packs * width;
    TANDEM_GRID_STRIDE_LOOP(j, n - done) {
        out[done + j] = f(x[done + j]);
    }
}

template <typename T, typename F>
TANDEM_FN void tandem_zip_dense(T* out, const T* a, const T* b, tandem_u64 n, F f) {
    const tandem_u64 width = TANDEM_PACK_WIDTH(T);
    tandem_u64 packs = 0;
    if (tandem_aligned16(out) && tandem_aligned16(a) && tandem_aligned16(b)) {
        packs = n / width;
        const tandem_pack<T>* ap = reinterpret_cast<const tandem_pack<T>*>(a);
        const tandem_pack<T>* bp = reinterpret_cast<const tandem_pack<T>*>(b);
        tandem_pack<T>* op = reinterpret_cast<tandem_pack<T>*>(out);
        TANDEM_GRID_STRIDE_LOOP(i, packs) {
            tandem_pack<T> u = ap[i];
            tandem_pack<T> v = bp[i];
#pragma unroll
            for (int k = 0; k < (int)width; ++k) {
                u.v[k] = f(u.v[k], v.v[k]);
            }
            op[i] = u;
        }
    }
    const tandem_u64 done = packs * width;
    TANDEM_GRID_STRIDE_LOOP(j, n - done) {
        out[done + j] = f(a[done + j], b[done + j]);
    }
}

template <typename T, typename F>
TANDEM_FN void tandem_map_strided(T* out, const T* x, const tandem_layout& x_layout,
                                  tandem_u64 n, F f) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        out[i] = f(x[tandem_layout_index(x_layout, i)]);
    }
}

template <typename T, typename F>
TANDEM_FN void tandem_zip_strided(T* out, const T* a, const tandem_layout& a_layout, const T* b,
                                  const tandem_layout& b_layout, tandem_u64 n, F f) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        out[i] = f(a[tandem_layout_index(a_layout, i)], b[tandem_layout_index(b_layout, i)]);
    }
}

// ---------------------------------------------------------------------------------------------
// Reductions within a warp and a block (1-D blocks of whole warps).
// ---------------------------------------------------------------------------------------------

struct tandem_sum_op {
    template <typename T>
    TANDEM_FN T operator()(T a, T b) const {
        return a + b;
    }
};

// The larger of two values; a NaN wins, so that it is reported rather than hidden.
struct tandem_max_nan_op {
    template <typename T>
    TANDEM_FN T operator()(T a, T b) const {
        return (a != a || a > b) ? a : b;
    }
};

// Every lane gets the reduction of the warp's 32 values.
template <typename T, typename Op>
TANDEM_FN T tandem_warp_reduce(T value, Op op) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    return value;
}

// Every thread gets the reduction of the block's values. `scratch` is shared memory for 32
// values; `identity` is the operation's neutral element. Contains barriers: every thread of the
// block must call it.
template <typename T, typename Op>
TANDEM_FN T tandem_block_reduce(T value, Op op, T identity, T* scratch) {
    unsigned int lane = threadIdx.x % 32u;
    unsigned int warp = threadIdx.x / 32u;
    unsigned int warps = blockDim.x / 32u;
    value = tandem_warp_reduce(value, op);
    if (lane == 0) {
        scratch[warp] = value;
    }
    __syncthreads();
    value = lane < warps ? scratch[lane] : identity;
    value = tandem_warp_reduce(value, op);
    // Every warp computed the same total; wait until all have read `scratch` before anyone may
    // reuse it.
    __syncthreads();
    return value;
}

// The threads that reduce one row together in a row kernel: a warp per row (short rows) or the
// whole block per row. Row r of a kernel's rows is handled by the group with
// `first + k·step == r`; `rank` is the thread's position in its group of `size` threads.
struct tandem_row_group {
    tandem_u64 first;  // the first row of this group
    tandem_u64 step;   // rows between two rows of this group
    tandem_u32 rank;   // this thread's position in the group
    tandem_u32 size;   // threads in the group
};

TANDEM_FN tandem_row_group tandem_row_group_of(int warp_per_row) {
    tandem_row_group g;
    if (warp_per_row) {
        g.first = ((tandem_u64)blockIdx.x * blockDim.x + threadIdx.x) / 32u;
        g.step = (tandem_u64)gridDim.x * blockDim.x / 32u;
        g.rank = threadIdx.x % 32u;
        g.size = 32u;
    } else {
        g.first = blockIdx.x;
        g.step = gridDim.x;
        g.rank = threadIdx.x;
        g.size = blockDim.x;
    }
    return g;
}

// The reduction over the thread's row group. A block reduction has barriers, so every thread of
// the block must call it: the row loops are uniform over the group.
template <typename C, typename Op>
TANDEM_FN C tandem_row_group_reduce(C value, Op op, C identity, C* scratch, int warp_per_row) {
    return warp_per_row ? tandem_warp_reduce(value, op)
                        : tandem_block_reduce(value, op, identity, scratch);
}

// ---------------------------------------------------------------------------------------------
// Deferred errors: what a kernel found wrong in data the host never reads (class labels, a
// count all-reduced on the device), reported by the host at its next read of the device
// (core/src/cuda/deferred.rs).
// ---------------------------------------------------------------------------------------------

// Records a finding in the calling thread's deferred-error record (`claim`, `record`, `code` are
// the launch's `DeferredSlot`): the thread that claims the record writes position, value and
// bound, makes them visible to the host, then the code. Findings after the first are dropped.
TANDEM_FN void tandem_deferred_record(tandem_u32* claim, tandem_i64* record, tandem_u32 code,
                                      tandem_i64 position, tandem_i64 value, tandem_i64 bound) {
    if (atomicCAS(claim, 0u, 1u) == 0u) {
        volatile tandem_i64* words = record;
        words[1] = position;
        words[2] = value;
        words[3] = bound;
#ifdef __CUDA_ARCH__
        __threadfence_system();
#else
        __threadfence();
#endif
        words[0] = (tandem_i64)code;
    }
}

#endif  // TANDEM_CUH
