// device_group.cu: the kernels of the in-process device group (`DeviceThreadGroup`), whose ranks
// are threads sharing one GPU. Each rank snapshots its contribution into memory of its own, and
// every rank then computes its result from all snapshots, on its own comm stream:
//
//   reduce_ranks_<dtype>: out[i] = src_0[offset + i] (+) src_1[offset + i] (+) ... in rank order,
//       the reduction of all_reduce (offset 0) and reduce_scatter (offset = rank * n);
//   gather_ranks_<dtype>: out[k * n + i] = src_k[i], the result of all_gather.
//
// The launch plans are built in device_threads/kernels.rs. The semantics are the CPU backends'
// (dist/src/process_group/reduce.rs): contributions are combined in rank order, the same on every
// rank, so every rank gets bit-identical results; f16 and bf16 accumulate in float and round once;
// an average divides the sum by the number of ranks; max and min propagate NaN and keep the first
// operand on ties.

#include "tandem.cuh"

// The most ranks a device group may have (`MAX_GROUP_RANKS` in kernels.rs).
#define TANDEM_MAX_GROUP_RANKS 64

// The ranks' snapshots, by rank: device addresses of their first elements. Passed by value
// (`RankPointers` in kernels.rs); entries past the rank count are 0 and never read.
struct tandem_rank_pointers {
    tandem_u64 ptr[TANDEM_MAX_GROUP_RANKS];
};

// The reduce ops (`ReduceOp` in kernels.rs).
#define TANDEM_GROUP_SUM 0
#define TANDEM_GROUP_AVG 1
#define TANDEM_GROUP_MAX 2
#define TANDEM_GROUP_MIN 3

// a (+) b for the op, in the compute type A; NaN wins max and min (as a + b), ties keep `a`.
template <typename A>
TANDEM_FN A group_combine(A a, A b, int op) {
    if (op == TANDEM_GROUP_MAX || op == TANDEM_GROUP_MIN) {
        if (a != a || b != b) {
            return a + b;
        }
        bool take_b = op == TANDEM_GROUP_MAX ? b > a : b < a;
        return take_b ? b : a;
    }
    return a + b;
}

// out[i] = the reduction over ranks 0..count of src_k[offset + i], for i < n.
template <typename T>
TANDEM_FN void reduce_ranks_impl(T* out, const tandem_rank_pointers& sources, tandem_u32 count,
                                 tandem_u64 offset, tandem_u64 n, int op) {
    typedef typename tandem_compute<T>::type A;
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        A acc = tandem_load(reinterpret_cast<const T*>(sources.ptr[0])[offset + i]);
        for (tandem_u32 k = 1; k < count; ++k) {
            A x = tandem_load(reinterpret_cast<const T*>(sources.ptr[k])[offset + i]);
            acc = group_combine(acc, x, op);
        }
        if (op == TANDEM_GROUP_AVG) {
            acc = acc / (A)count;
        }
        out[i] = tandem_store<T>(acc);
    }
}

// out[k * n + i] = src_k[i] for k < count, i < n.
template <typename T>
TANDEM_FN void gather_ranks_impl(T* out, const tandem_rank_pointers& sources, tandem_u32 count,
                                 tandem_u64 n) {
    tandem_u64 total = (tandem_u64)count * n;
    TANDEM_GRID_STRIDE_LOOP(j, total) {
        tandem_u64 k = j / n;
        tandem_u64 i = j - k * n;
        out[j] = reinterpret_cast<const T*>(sources.ptr[k])[i];
    }
}

// ---------------------------------------------------------------------------------------------
// Instantiations: <op>_<dtype>.
// ---------------------------------------------------------------------------------------------

#define TANDEM_GROUP_REDUCE(NAME, T)                                                           \
    extern "C" __global__ void reduce_ranks_##NAME(T* out, tandem_rank_pointers sources,       \
                                                   tandem_u32 count, tandem_u64 offset,        \
                                                   tandem_u64 n, int op) {                     \
        reduce_ranks_impl<T>(out, sources, count, offset, n, op);                              \
    }                                                                                          \
    TANDEM_HOST_EXPORT(reduce_ranks_##NAME)

TANDEM_GROUP_REDUCE(f32, float)
TANDEM_GROUP_REDUCE(f64, double)
TANDEM_GROUP_REDUCE(f16, tandem_f16)
TANDEM_GROUP_REDUCE(bf16, tandem_bf16)

#define TANDEM_GROUP_GATHER(NAME, T)                                                           \
    extern "C" __global__ void gather_ranks_##NAME(T* out, tandem_rank_pointers sources,       \
                                                   tandem_u32 count, tandem_u64 n) {           \
        gather_ranks_impl<T>(out, sources, count, n);                                          \
    }                                                                                          \
    TANDEM_HOST_EXPORT(gather_ranks_##NAME)

TANDEM_GROUP_GATHER(f32, float)
TANDEM_GROUP_GATHER(f64, double)
TANDEM_GROUP_GATHER(f16, tandem_f16)
TANDEM_GROUP_GATHER(bf16, tandem_bf16)
TANDEM_GROUP_GATHER(i64, tandem_i64)
TANDEM_GROUP_GATHER(u8, tandem_u8)
