// multi_tensor.cuh: how optim's kernels walk many tensors in one launch.
//
// An optimizer step, gradient clipping and zero_grad each touch every parameter of a model: up
// to hundreds of tensors, many of them tiny (biases, batch-norm weights). One launch per tensor
// would cost more host time than the arithmetic, so optim's kernels take a *table* in device
// memory with one entry per tensor (`optim_tensor`, built and uploaded by
// optim/src/multi_tensor/table.rs) and cut every tensor into chunks of `chunk_size` elements. The
// chunks of all tensors are numbered one after the other, tensor by tensor; block b handles
// chunks b, b + gridDim.x, ... and finds each chunk's tensor by a binary search over the
// entries' `first_chunk`. So one launch covers every tensor of a dtype, a tensor's size never
// needs to be a multiple of anything, and each chunk is one block's contiguous, coalesced run.
//
// Tensors are dense: entry pointers are the address of element 0 and elements are at
// consecutive addresses. The table's builder leaves out empty tensors; the search would skip
// them anyway (an empty entry has no chunk of its own).

#ifndef OPTIM_MULTI_TENSOR_CUH
#define OPTIM_MULTI_TENSOR_CUH

#include "tandem.cuh"

// One tensor of a table: `TableEntry` in optim/src/multi_tensor/table.rs, 8 words. Addresses
// are 0 where a kernel does not use the role (no momentum buffer, no AMSGrad maximum).
struct optim_tensor {
    tandem_u64 param;        // the parameter (read and written by updates)
    tandem_u64 grad;         // its gradient (read by updates; written by clip and zero)
    tandem_u64 state[3];     // per-element optimizer state (momentum; exp_avg, exp_avg_sq, max)
    tandem_u64 numel;        // elements
    tandem_u64 first_chunk;  // number of chunks of all tensors before this one
    tandem_u64 reserved;     // 0; keeps entries 64 bytes
};

// The chunk `c` of a table: its tensor and the element range [start, end) of that tensor.
struct optim_chunk {
    const optim_tensor* tensor;
    tandem_u64 start;
    tandem_u64 end;
};

// The entry holding chunk `c`: the last one whose first_chunk is <= c. Every thread of a block
// searches for the same chunk, so the loads are uniform. `tensors` >= 1; it is 32-bit because
// the table's builder checks the count with index_u32 (TensorTable::new).
TANDEM_FN optim_chunk optim_chunk_at(const optim_tensor* table, tandem_u32 tensors,
                                     tandem_u64 chunk_size, tandem_u64 c) {
    tandem_u32 lo = 0;
    tandem_u32 hi = tensors;
    while (hi - lo > 1) {
        tandem_u32 mid = lo + (hi - lo) / 2;
        if (table[mid].first_chunk <= c) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    optim_chunk chunk;
    chunk.tensor = table + lo;
    tandem_u64 numel = table[lo].numel;
    chunk.start = (c - table[lo].first_chunk) * chunk_size;
    chunk.end = chunk.start + chunk_size < numel ? chunk.start + chunk_size : numel;
    return chunk;
}

// for (every chunk c of this block) — the loop is uniform across the block, so kernels may
// place barriers inside it.
#define OPTIM_FOR_EACH_CHUNK(c, chunks)                                                        \
    for (tandem_u64 c = blockIdx.x; c < (chunks); c += gridDim.x)

// for (every element i of `chunk` that this thread handles): consecutive threads take
// consecutive elements.
#define OPTIM_FOR_EACH_ELEMENT(i, chunk)                                                       \
    for (tandem_u64 i = (chunk).start + threadIdx.x; i < (chunk).end; i += blockDim.x)

template <typename T>
TANDEM_FN T* optim_ptr(tandem_u64 address) {
    return reinterpret_cast<T*>(address);
}

// Correctly rounded square roots (NVRTC compiles without fast-math, as the host does).
TANDEM_FN float optim_sqrt(float x) { return sqrtf(x); }
TANDEM_FN double optim_sqrt(double x) { return sqrt(x); }

#endif  // OPTIM_MULTI_TENSOR_CUH
