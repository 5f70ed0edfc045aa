// emulator_checks.cu: kernels that exercise the host emulation itself (tests/emulator.rs):
// shared-memory reductions with barriers and warp shuffles, atomics, votes, dynamic shared
// memory, multi-dimensional indices, and kernels that break the rules on purpose so the
// emulation's fault detection can be checked. They are compiled by NVRTC too (tests/nvrtc.rs),
// so they are also valid CUDA.

#include "tandem.cuh"

// block_sums[blockIdx.x] = the sum of this block's grid-stride share of x: a shared-memory tree
// down to one warp, then shuffles.
extern "C" __global__ void block_sum_tree_f32(const float* x, tandem_u64 n, float* block_sums) {
    __shared__ float partial[1024];
    float acc = 0.0f;
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        acc += x[i];
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int stride = blockDim.x / 2; stride >= 32; stride /= 2) {
        if (threadIdx.x < stride) {
            partial[threadIdx.x] += partial[threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x < 32) {
        float v = partial[threadIdx.x];
        for (int offset = 16; offset > 0; offset /= 2) {
            v += __shfl_down_sync(0xffffffffu, v, offset);
        }
        if (threadIdx.x == 0) {
            block_sums[blockIdx.x] = v;
        }
    }
}
TANDEM_HOST_EXPORT(block_sum_tree_f32)

// out[blockIdx.x] = the sum, and out[gridDim.x + blockIdx.x] the maximum, of this block's share,
// through tandem_block_reduce.
extern "C" __global__ void block_reduce_f64(const double* x, tandem_u64 n, double* out) {
    __shared__ double scratch[32];
    double sum = 0.0;
    double largest = -1.0e300;
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        sum += x[i];
        largest = tandem_max_nan_op()(largest, x[i]);
    }
    sum = tandem_block_reduce(sum, tandem_sum_op(), 0.0, scratch);
    largest = tandem_block_reduce(largest, tandem_max_nan_op(), -1.0e300, scratch);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = sum;
        out[gridDim.x + blockIdx.x] = largest;
    }
}
TANDEM_HOST_EXPORT(block_reduce_f64)

// Every element adds to four counters of different types.
extern "C" __global__ void atomic_counts(tandem_u64 n, int* count, unsigned long long* wide,
                                         float* float_sum, double* double_sum) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        atomicAdd(count, 1);
        atomicAdd(wide, 1ull);
        atomicAdd(float_sum, 1.0f);
        atomicAdd(double_sum, 0.5);
    }
}
TANDEM_HOST_EXPORT(atomic_counts)

// Max, min, a single compare-and-swap winner, and exchange.
extern "C" __global__ void atomic_extremes(const int* x, tandem_u64 n, int* largest, int* smallest,
                                           unsigned int* winner, int* last) {
    TANDEM_GRID_STRIDE_LOOP(i, n) {
        atomicMax(largest, x[i]);
        atomicMin(smallest, x[i]);
        atomicCAS(winner, 0xffffffffu, (unsigned int)i);
        atomicExch(last, x[i]);
    }
}
TANDEM_HOST_EXPORT(atomic_extremes)

// Nine results per thread of the warp intrinsics (see tests/emulator.rs for the expected ones).
extern "C" __global__ void warp_intrinsics(int* out) {
    int lane = (int)(threadIdx.x % 32u);
    int* mine = out + 9 * (blockIdx.x * blockDim.x + threadIdx.x);
    mine[0] = __shfl_sync(0xffffffffu, lane * 10, 3);
    mine[1] = __shfl_up_sync(0xffffffffu, lane * 10, 1);
    mine[2] = __shfl_down_sync(0xffffffffu, lane * 10, 2);
    mine[3] = __shfl_xor_sync(0xffffffffu, lane * 10, 1);
    mine[4] = (int)__ballot_sync(0xffffffffu, lane % 2 == 0);
    mine[5] = __any_sync(0xffffffffu, lane == 5);
    mine[6] = __all_sync(0xffffffffu, lane < 32);
    mine[7] = __all_sync(0xffffffffu, lane < 31);
    mine[8] = __shfl_sync(0xffffffffu, lane * 10, 1, 8);
}
TANDEM_HOST_EXPORT(warp_intrinsics)

// Each block reverses its chunk of blockDim.x elements through dynamic shared memory.
extern "C" __global__ void reverse_chunks(const float* in, float* out, tandem_u64 n) {
    TANDEM_DYNAMIC_SHARED(float, tile);
    tandem_u64 first = (tandem_u64)blockIdx.x * blockDim.x;
    tandem_u64 i = first + threadIdx.x;
    tile[threadIdx.x] = i < n ? in[i] : 0.0f;
    __syncthreads();
    tandem_u64 chunk = n - first < blockDim.x ? n - first : blockDim.x;
    if (threadIdx.x < chunk) {
        out[first + threadIdx.x] = tile[chunk - 1 - threadIdx.x];
    }
}
TANDEM_HOST_EXPORT(reverse_chunks)

// out[global linear thread] = the thread's and block's indices, packed.
extern "C" __global__ void indices_3d(unsigned int* out) {
    unsigned int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned int threads = blockDim.x * blockDim.y * blockDim.z;
    out[block * threads + thread] = threadIdx.x | threadIdx.y << 4 | threadIdx.z << 8 |
                                    blockIdx.x << 12 | blockIdx.y << 16 | blockIdx.z << 20;
}
TANDEM_HOST_EXPORT(indices_3d)

// Each thread of the grid adds one to its own slot: every slot must be 1 once the launch returns.
extern "C" __global__ void count_each_thread(unsigned int* hits) {
    unsigned int threads = blockDim.x * blockDim.y * blockDim.z;
    atomicAdd(&hits[blockIdx.x * threads + threadIdx.x], 1u);
}
TANDEM_HOST_EXPORT(count_each_thread)

// Broken on purpose: thread 0 returns before a barrier the others reach.
extern "C" __global__ void broken_early_return(int* out) {
    if (threadIdx.x == 0) {
        return;
    }
    __syncthreads();
    out[threadIdx.x] = 1;
}
TANDEM_HOST_EXPORT(broken_early_return)

// Broken on purpose: lane 0 waits for the block while the rest of its warp waits for the warp.
extern "C" __global__ void broken_mismatched_barriers(int* out) {
    if (threadIdx.x == 0) {
        __syncthreads();
    } else if (threadIdx.x < 32) {
        __syncwarp();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}
TANDEM_HOST_EXPORT(broken_mismatched_barriers)

// Broken on purpose: a shuffle over half a warp.
extern "C" __global__ void broken_partial_mask(int* out) {
    out[threadIdx.x] = __shfl_sync(0x0000ffffu, (int)threadIdx.x, 0);
}
TANDEM_HOST_EXPORT(broken_partial_mask)

// One thread spins for `cycles` of clock64(): out[0] = the start, out[1] = the end, out[2] =
// clock() at the start.
extern "C" __global__ void clock_spin(long long cycles, long long* out) {
    long long start = clock64();
    long long start32 = (long long)clock();
    long long now = start;
    while (now - start < cycles) {
        now = clock64();
    }
    out[0] = start;
    out[1] = now;
    out[2] = start32;
}
TANDEM_HOST_EXPORT(clock_spin)

// Spins until *flag is non-zero or `cycles` of clock64() have passed; out[0] = the flag seen
// last (0: it gave up).
extern "C" __global__ void wait_for_flag(const volatile int* flag, long long cycles, int* out) {
    long long start = clock64();
    int seen = *flag;
    while (seen == 0 && clock64() - start < cycles) {
        seen = *flag;
    }
    out[0] = seen;
}
TANDEM_HOST_EXPORT(wait_for_flag)

// *flag = 1 (one thread of a block of 64).
extern "C" __global__ void raise_flag(int* flag) {
    if (threadIdx.x == 0) {
        atomicExch(flag, 1);
    }
}
TANDEM_HOST_EXPORT(raise_flag)

// Broken on purpose when two kernels calling it run at once: `__shared__` storage in a
// `__device__` function is one static copy on the host. Raises *started once it holds the
// storage, then spins until *release is non-zero (or `cycles` of clock64() pass).
__device__ void shared_scratch_user(int* started, const volatile int* release, long long cycles,
                                    int* out) {
    __shared__ int scratch[32];
    scratch[threadIdx.x % 32] = (int)threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicExch(started, 1);
        long long start = clock64();
        while (*release == 0 && clock64() - start < cycles) {
        }
        out[0] = scratch[1];
    }
}

extern "C" __global__ void shared_scratch_first(int* started, const volatile int* release,
                                                long long cycles, int* out) {
    shared_scratch_user(started, release, cycles, out);
}
TANDEM_HOST_EXPORT(shared_scratch_first)

extern "C" __global__ void shared_scratch_second(int* started, const volatile int* release,
                                                 long long cycles, int* out) {
    shared_scratch_user(started, release, cycles, out);
}
TANDEM_HOST_EXPORT(shared_scratch_second)
