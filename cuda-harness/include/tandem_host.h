// tandem_host.h: runs tandem's CUDA C kernels on the CPU, for tests on machines without a GPU.
//
// The harness (cuda-harness/build.rs) compiles each `.cu` file as C++17 with the host compiler,
// with this header included first. It emulates the CUDA execution model closely enough to test
// indexing, bounds, barriers and reduction logic:
//
// - A launch runs its blocks one at a time, in order (x fastest). The threads of a block are
//   OS threads (one per CUDA thread, from a crew of workers reused across launches) that really
//   run concurrently and meet at barriers: `__syncthreads()` for the block, `__syncwarp()` and
//   the warp intrinsics for each warp of 32 consecutive threads.
// - Several launches may run at the same time, each called from its own host thread (the
//   emulated driver runs one launch per stream at a time, on the stream's worker, so kernels of
//   different streams overlap as on a GPU). A launch's state (barriers, warps, dynamic shared
//   memory, its first fault, `blockDim`, `gridDim`) is its own, on the launching thread's stack,
//   reached by its workers through thread-locals; each running launch has its own crew of
//   workers (`WorkerCrews`). A kernel that spins until another launch or the host writes a flag
//   therefore finishes, as on a GPU.
// - `threadIdx`, `blockIdx`, `blockDim`, `gridDim` (all per thread) and `warpSize` are
//   variables of the same names; kernels read them as on the device.
// - `__shared__` variables become `static`: one copy per function that declares them (per
//   template instance), shared by the block's threads. That is correct because the blocks of a
//   launch run one at a time and two launches of the same kernel never overlap: the harness
//   runs one launch at a time, the emulated driver one launch of each kernel (by name) at a time
//   (a launch of kernel K waits for the running launch of K on another stream). Launches of
//   different kernels do overlap; their `__shared__` variables are distinct as long as no
//   `__device__` function declaring `__shared__` storage is called by two kernels (tandem's
//   kernels declare it in the kernel or in an `_impl` template used by one kernel).
//   Dynamic shared memory (`TANDEM_DYNAMIC_SHARED`) is a per-launch buffer of the launch's size,
//   filled with 0xA5 before every block so that reading it before writing shows.
// - Warp shuffles (`__shfl_sync`, `__shfl_up_sync`, `__shfl_down_sync`, `__shfl_xor_sync`) and
//   votes (`__ballot_sync`, `__any_sync`, `__all_sync`) exchange values through a per-warp slot
//   array between two warp barriers. They need every lane of the warp present (the full mask,
//   or exactly the lanes of a partial last warp) and none returned.
// - Atomics (`atomicAdd`, `atomicSub`, `atomicMax`, `atomicMin`, `atomicExch`, `atomicCAS`) are
//   the compiler's atomic builtins; float and double addition are compare-and-swap loops.
// - Bit casts, the `_rn` arithmetic intrinsics (the host build uses -ffp-contract=off, so no
//   product is fused on the host either) and the usual math functions are provided.
// - `clock64()` and `clock()` count cycles of a 2 GHz clock (the host's monotonic clock; see
//   "Clocks" at the end).
//
// What the emulation detects, as an error of the launch (never a hang or a crash of the test
// process): a thread that returns while others wait at a barrier, or a barrier reached after a
// thread returned (every thread must reach every barrier; one of the two shows whichever
// order the threads run in), a warp intrinsic with a partial mask or a returned lane, a shuffle from
// a lane outside the warp, threads stuck at different barriers (after a timeout), an invalid
// launch configuration, a `__shared__` variable used by two launches running at once.
// Out-of-bounds accesses are not caught by the emulation itself; the harness's tests poison
// their buffers so that unwritten elements show, and the emulated driver places every
// allocation's end against an inaccessible page and reports a kernel reading or writing there
// (cuda-emu/src/memory.rs).
//
// What it cannot check: memory ordering and races between threads that the GPU would expose
// differently, timing, and anything of cuBLAS, cuDNN or NCCL. Not emulated (the host compile
// fails): `__syncthreads_count/and/or`, `__constant__` memory, textures, cooperative groups.

#ifndef TANDEM_HOST_H
#define TANDEM_HOST_H

#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define TANDEM_HOST_EMULATION 1

// ---------------------------------------------------------------------------------------------
// Qualifiers and attributes.
// ---------------------------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// `__shared__` storage is `static`, preceded by a claim that records which launch uses it (see
// "Shared memory claims" below). Inside functions only (as everywhere in tandem's kernels).
#define TANDEM_HOST_SHARED_(n)                                                                 \
    static ::tandem_host::SharedOwner tandem_host_shared_owner_##n;                            \
    ::tandem_host::claim_shared(tandem_host_shared_owner_##n, __FILE__, __LINE__);             \
    static
#define TANDEM_HOST_SHARED(n) TANDEM_HOST_SHARED_(n)
#define __shared__ TANDEM_HOST_SHARED(__COUNTER__)

// ---------------------------------------------------------------------------------------------
// Thread and block indices.
// ---------------------------------------------------------------------------------------------

struct uint3 {
    unsigned int x, y, z;
};
typedef uint3 dim3;

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
// Per thread too: launches of different streams run at the same time, each on its own workers.
inline thread_local uint3 blockDim;
inline thread_local uint3 gridDim;
constexpr int warpSize = 32;

// The launch configuration the harness passes (`HostLaunchConfig` in cuda-harness/src/lib.rs).
struct tandem_host_launch_config {
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int shared_mem_bytes;
    unsigned int barrier_timeout_ms;
};

namespace tandem_host {

// The first fault of a launch, and how long its barriers wait; once a fault is set, every
// barrier lets its threads through so that the launch ends quickly. One per launch (a member of
// its LaunchState), reached by its workers through `this_fault`.
struct FaultState {
    std::mutex mutex;
    std::string message;
    std::atomic<bool> broken{false};
    unsigned int barrier_timeout_ms = 20000;
};

// The fault state of the launch the calling worker runs.
inline thread_local FaultState* this_fault = nullptr;

inline FaultState& fault_state() {
    // Only workers of a launch fault; the fallback keeps a stray call from crashing.
    static FaultState outside_launches;
    return this_fault != nullptr ? *this_fault : outside_launches;
}

inline bool broken() { return fault_state().broken.load(std::memory_order_acquire); }

__attribute__((format(printf, 1, 2))) inline void fault(const char* format, ...) {
    char text[512];
    va_list args;
    va_start(args, format);
    vsnprintf(text, sizeof text, format, args);
    va_end(args);
    FaultState& state = fault_state();
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.message.empty()) {
        char where[160];
        snprintf(where, sizeof where, " (thread (%u,%u,%u) of block (%u,%u,%u))", threadIdx.x,
                 threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z);
        state.message = std::string(text) + where;
    }
    state.broken.store(true, std::memory_order_release);
}

inline unsigned int barrier_timeout_ms() { return fault_state().barrier_timeout_ms; }

// Sleeps while `*word == expected`, for at most `timeout_ms` (a Linux futex: no mutex to
// reacquire on wake-up, so releasing hundreds of threads does not convoy them).
inline void futex_wait(std::atomic<unsigned int>* word, unsigned int expected, long timeout_ms) {
    struct timespec timeout = {timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
    syscall(SYS_futex, reinterpret_cast<unsigned int*>(word), FUTEX_WAIT_PRIVATE, expected,
            &timeout, nullptr, 0);
}

inline void futex_wake_all(std::atomic<unsigned int>* word) {
    syscall(SYS_futex, reinterpret_cast<unsigned int*>(word), FUTEX_WAKE_PRIVATE, INT_MAX,
            nullptr, nullptr, 0);
}

// A reusable barrier for a group of threads whose members may leave for good (return from the
// kernel): `leave` lowers the count, releasing the others if they were only waiting for it.
// Lock-free: the member and arrival counts share one atomic word, and waiters sleep on a
// generation futex, so hundreds of threads pass it without convoying on a mutex.
class Barrier {
public:
    // Only while no thread is at the barrier. A barrier with a `strict` name (every member must
    // reach it: __syncthreads and the warp intrinsics) faults when a member returns while others
    // wait at it, or when one arrives after a member returned, whichever happens first.
    void reset(unsigned int members, const char* strict = nullptr) {
        strict_ = strict;
        initial_.store(members, std::memory_order_relaxed);
        counts_.store(pack(members, 0), std::memory_order_release);
    }

    // Waits until every member still present has arrived. `what` names the barrier in faults.
    // The last thread to arrive runs `completion` (if any) before releasing the others.
    void arrive_and_wait(const char* what, void (*completion)(void*) = nullptr,
                         void* context = nullptr) {
        unsigned int generation = generation_.load(std::memory_order_acquire);
        unsigned int counts = counts_.load(std::memory_order_acquire);
        bool last;
        for (;;) {
            unsigned int members = counts >> 16, arrived = (counts & 0xffffu) + 1;
            last = arrived >= members;
            unsigned int next = last ? pack(members, 0) : pack(members, arrived);
            if (counts_.compare_exchange_weak(counts, next, std::memory_order_acq_rel)) {
                unsigned int initial = initial_.load(std::memory_order_relaxed);
                if (strict_ != nullptr && members < initial) {
                    fault("%s reached after %u thread(s) returned: every thread must reach "
                          "every barrier (%s)",
                          what, initial - members, strict_);
                }
                break;
            }
        }
        if (last) {
            if (completion != nullptr) {
                completion(context);
            }
            release();
            return;
        }
        auto deadline =
            std::chrono::steady_clock::now() + std::chrono::milliseconds(barrier_timeout_ms());
        while (generation_.load(std::memory_order_acquire) == generation && !broken()) {
            futex_wait(&generation_, generation, 20);
            if (generation_.load(std::memory_order_acquire) == generation &&
                std::chrono::steady_clock::now() > deadline) {
                fault("threads waited %u ms at %s: threads of the block are stuck at different "
                      "barriers, or one never arrives",
                      barrier_timeout_ms(), what);
            }
        }
    }

    // The calling thread leaves the group for good.
    void leave() {
        unsigned int counts = counts_.load(std::memory_order_acquire);
        for (;;) {
            unsigned int members = counts >> 16, arrived = counts & 0xffffu;
            if (members == 0) {
                return;
            }
            members -= 1;
            bool releases = arrived > 0 && arrived >= members;
            unsigned int next = releases ? pack(members, 0) : pack(members, arrived);
            if (counts_.compare_exchange_weak(counts, next, std::memory_order_acq_rel)) {
                if (strict_ != nullptr && arrived > 0) {
                    fault("a thread returned while %u other(s) wait at %s: every thread must "
                          "reach every barrier",
                          arrived, strict_);
                }
                if (releases) {
                    release();
                }
                return;
            }
        }
    }

private:
    static unsigned int pack(unsigned int members, unsigned int arrived) {
        return members << 16 | arrived;
    }

    void release() {
        generation_.fetch_add(1, std::memory_order_acq_rel);
        futex_wake_all(&generation_);
    }

    const char* strict_ = nullptr;
    std::atomic<unsigned int> initial_{0};
    std::atomic<unsigned int> counts_{0};  // members << 16 | arrived
    std::atomic<unsigned int> generation_{0};
};

struct Warp {
    Barrier barrier;
    unsigned int lanes = 32;
    std::atomic<unsigned int> returned{0};  // bit per lane that returned from the kernel
    // Two sets of slots, used by alternate exchanges: a lane cannot write the set it read in
    // the previous exchange until every lane has passed the next exchange's barrier, so each
    // exchange needs only one barrier.
    unsigned long long slots[2][32];
};

// The state of one launch, on the stack of the thread that called `launch`; its workers reach it
// through `this_launch`. Several launches (of different streams) may be in progress at once.
struct LaunchState {
    const tandem_host_launch_config* config = nullptr;
    uint3 grid_dim{}, block_dim{};
    FaultState fault;
    unsigned int threads = 0;
    Barrier block_barrier;  // __syncthreads
    Barrier block_end;      // all threads done with a block
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<unsigned char> dynamic_shared;
    unsigned int dynamic_shared_bytes = 0;
    // The `__shared__` variables this launch claimed, released when it ends.
    std::mutex claims_mutex;
    std::vector<std::atomic<LaunchState*>*> claims;
};

// The launch the calling worker runs (set at the start of its share of the launch).
inline thread_local LaunchState* this_launch = nullptr;

inline LaunchState* current_launch() { return this_launch; }

// ---------------------------------------------------------------------------------------------
// Shared memory claims.
//
// A `__shared__` variable is one static copy per declaring function (per template instance),
// correct only while one launch uses it at a time. The launchers keep two launches of one kernel
// apart; a `__device__` function declaring `__shared__` storage called by two kernels running at
// once would still share it. Each thread passing the declaration claims the variable for its
// launch (an atomic load when it already holds it); a variable held by another running launch is
// a fault of the launch ("used by two launches at once") instead of a silent race.
// ---------------------------------------------------------------------------------------------

struct SharedOwner {
    std::atomic<LaunchState*> launch{nullptr};
};

inline void claim_shared(SharedOwner& owner, const char* file, int line) {
    LaunchState* me = this_launch;
    LaunchState* holder = owner.launch.load(std::memory_order_acquire);
    if (holder == me || me == nullptr) {
        return;
    }
    if (holder == nullptr &&
        owner.launch.compare_exchange_strong(holder, me, std::memory_order_acq_rel)) {
        std::lock_guard<std::mutex> lock(me->claims_mutex);
        me->claims.push_back(&owner.launch);
        return;
    }
    if (holder != me) {
        fault("the __shared__ variable declared at %s:%d is used by another launch running at "
              "the same time (static storage on the host: a __device__ function declaring "
              "__shared__ storage must not be called by kernels that run concurrently)",
              file, line);
    }
}

inline thread_local unsigned int this_lane;
inline thread_local unsigned int this_warp;
inline thread_local unsigned int exchanges;  // warp exchanges of this thread in this block

inline Warp& this_warp_state() { return *current_launch()->warps[this_warp]; }

// The launch's dynamic shared memory (16-byte aligned).
inline void* dynamic_shared() {
    std::vector<unsigned char>& buffer = current_launch()->dynamic_shared;
    std::size_t misalignment = reinterpret_cast<std::size_t>(buffer.data()) % 16;
    return buffer.data() + (misalignment == 0 ? 0 : 16 - misalignment);
}

// The mask of the lanes a warp has (all 32, or fewer in a partial last warp).
inline unsigned int full_mask(const Warp& warp) {
    return warp.lanes == 32 ? 0xffffffffu : (1u << warp.lanes) - 1u;
}

// Faults unless every lane of the warp takes part: the whole-warp mask, no lane returned.
inline void check_whole_warp(const char* what, const Warp& warp, unsigned int mask) {
    if (mask != full_mask(warp)) {
        fault("%s with mask %#x; tandem's kernels use the whole warp (%#x here)", what, mask,
              full_mask(warp));
    }
    if (warp.returned.load() != 0) {
        fault("%s after lane(s) %#x of the warp returned", what, warp.returned.load());
    }
}

// Every lane of the warp exchanges one value of up to 8 bytes; `source(lane)` picks the lane to
// read from. Returns the value read.
template <typename T, typename Source>
T warp_exchange(const char* what, unsigned int mask, T value, Source source) {
    static_assert(sizeof(T) <= 8, "warp intrinsics exchange values of at most 8 bytes");
    static_assert(std::is_trivially_copyable<T>::value, "warp intrinsics exchange plain values");
    Warp& warp = this_warp_state();
    check_whole_warp(what, warp, mask);
    unsigned long long* slots = warp.slots[exchanges++ % 2];
    std::memcpy(&slots[this_lane], &value, sizeof(T));
    warp.barrier.arrive_and_wait(what);
    unsigned int from = source(this_lane);
    T out = value;
    if (from >= warp.lanes) {
        fault("%s reads lane %u of a warp of %u lanes", what, from, warp.lanes);
    } else {
        std::memcpy(&out, &slots[from], sizeof(T));
    }
    return out;
}

// Bit `lane` set for every lane whose predicate holds.
inline unsigned int warp_ballot(unsigned int mask, bool predicate) {
    Warp& warp = this_warp_state();
    check_whole_warp("__ballot_sync()", warp, mask);
    unsigned long long* slots = warp.slots[exchanges++ % 2];
    slots[this_lane] = predicate ? 1u : 0u;
    warp.barrier.arrive_and_wait("__ballot_sync()");
    unsigned int result = 0;
    for (unsigned int lane = 0; lane < warp.lanes; ++lane) {
        result |= (slots[lane] != 0 ? 1u : 0u) << lane;
    }
    return result;
}

// Runs `kernel` over the grid with the arguments in `args` (as cuLaunchKernel takes them).
template <typename... Params>
struct Kernel {
    typedef void (*Function)(Params...);
    typedef std::tuple<typename std::decay<Params>::type...> Arguments;

    template <std::size_t... I>
    static Arguments unpack(void** args, std::index_sequence<I...>) {
        return Arguments(*static_cast<typename std::tuple_element<I, Arguments>::type*>(args[I])...);
    }
};

// The kernel, its arguments and the per-thread body of one launch, as the workers see it.
struct LaunchJob {
    void (*body)(const LaunchJob&, unsigned int);
    LaunchState* launch;
    void* kernel;
    const void* arguments;
};

// Microseconds a worker sleeps between seeing a new launch and reading it, times (its id % 3):
// `TANDEM_HOST_WORKER_DELAY_US`, read once, 0 when unset. Only for the harness's own test of the
// pool (tests/worker_pool.rs): it widens the window in which the OS may preempt a worker, so a
// race there shows in every run instead of one run in ten on a busy 2-core machine.
inline unsigned int worker_delay_us() {
    static const unsigned int delay = [] {
        const char* text = getenv("TANDEM_HOST_WORKER_DELAY_US");
        return text == nullptr ? 0u : (unsigned int)strtoul(text, nullptr, 10);
    }();
    return delay;
}

// A crew of worker threads kept for the life of the process and reused by launch after launch:
// creating one OS thread per CUDA thread per launch would dominate the run time of the tests.
// Workers sleep on a futex until the crew's next launch. A crew runs one launch at a time;
// launches that run at the same time (different streams) take different crews (WorkerCrews).
class WorkerPool {
public:
    // Runs job(context, t) for every t in [0, threads) on `threads` distinct workers and waits
    // for all of them. Returns false, running nothing, if the system refuses enough threads.
    // Called by one launching thread at a time (the thread that took the crew from WorkerCrews).
    bool run(unsigned int threads, void (*job)(void*, unsigned int), void* context) {
        while (workers_ < threads) {
            if (!spawn(workers_)) {
                return false;
            }
            ++workers_;
        }
        // Publish the launch like a sequence lock: an odd generation while its fields are
        // written, the next even one once they are complete. A worker that sat out the last
        // launch may still be reading the fields; it sees the generation move and reads again,
        // so it never takes this launch's size with the last launch's generation (which ran a
        // thread twice and let the launch return while a kernel thread was still running).
        unsigned int generation = generation_.load(std::memory_order_relaxed);
        generation_.store(generation + 1, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_release);
        job_.store(job, std::memory_order_relaxed);
        context_.store(context, std::memory_order_relaxed);
        active_.store(threads, std::memory_order_relaxed);
        finished_.store(0, std::memory_order_relaxed);
        generation_.store(generation + 2, std::memory_order_release);
        futex_wake_all(&generation_);
        for (;;) {
            unsigned int done = finished_.load(std::memory_order_acquire);
            if (done == threads) {
                return true;
            }
            futex_wait(&finished_, done, 1000);
        }
    }

    // Workers started so far (read by WorkerCrews while the crew is idle).
    unsigned int size() const { return workers_; }

private:
    struct Start {
        WorkerPool* pool;
        unsigned int id;
        unsigned int seen;
    };

    bool spawn(unsigned int id) {
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setstacksize(&attributes, 512 * 1024);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        // The worker starts from the current generation: it joins the next launch.
        Start* start = new Start{this, id, generation_.load(std::memory_order_acquire)};
        pthread_t handle;
        bool ok = pthread_create(&handle, &attributes, &WorkerPool::main, start) == 0;
        pthread_attr_destroy(&attributes);
        if (!ok) {
            delete start;
        }
        return ok;
    }

    static void* main(void* raw) {
        Start start = *static_cast<Start*>(raw);
        delete static_cast<Start*>(raw);
        start.pool->work(start.id, start.seen);
        return nullptr;
    }

    void work(unsigned int id, unsigned int seen) {
        for (;;) {
            unsigned int generation = generation_.load(std::memory_order_acquire);
            if (generation == seen || (generation & 1) != 0) {
                futex_wait(&generation_, generation, 1000);
                continue;
            }
            if (worker_delay_us() != 0) {
                usleep(worker_delay_us() * (id % 3));
            }
            void (*job)(void*, unsigned int) = job_.load(std::memory_order_relaxed);
            void* context = context_.load(std::memory_order_relaxed);
            unsigned int active = active_.load(std::memory_order_relaxed);
            std::atomic_thread_fence(std::memory_order_acquire);
            if (generation_.load(std::memory_order_relaxed) != generation) {
                // A newer launch overwrote the fields while they were read. This worker was
                // not part of the older one: a launch only ends when all its workers finish.
                continue;
            }
            seen = generation;
            if (id >= active) {
                continue;
            }
            job(context, id);
            if (finished_.fetch_add(1, std::memory_order_acq_rel) + 1 == active) {
                futex_wake_all(&finished_);
            }
        }
    }

    std::atomic<unsigned int> generation_{0};
    std::atomic<unsigned int> active_{0};
    std::atomic<unsigned int> finished_{0};
    unsigned int workers_ = 0;
    std::atomic<void (*)(void*, unsigned int)> job_{nullptr};
    std::atomic<void*> context_{nullptr};
};

// The crews of the process. A launch takes an idle crew (the smallest one with enough workers,
// else the largest, which grows), runs on it and gives it back, so launches of different streams
// run at the same time on different threads, while the number of threads stays that of the
// widest launches that ever ran together. Every kernel library of a process shares one set:
// `worker_crews`'s static is a unique symbol.
class WorkerCrews {
public:
    bool run(unsigned int threads, void (*job)(void*, unsigned int), void* context) {
        WorkerPool* crew = take(threads);
        bool ran = crew->run(threads, job, context);
        std::lock_guard<std::mutex> lock(mutex_);
        idle_.push_back(crew);
        return ran;
    }

private:
    WorkerPool* take(unsigned int threads) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (idle_.empty()) {
            // Never destroyed: its workers sleep on its futexes until the process exits.
            return new WorkerPool();
        }
        std::size_t best = 0;
        for (std::size_t i = 1; i < idle_.size(); ++i) {
            unsigned int have = idle_[i]->size(), best_have = idle_[best]->size();
            bool fits = have >= threads, best_fits = best_have >= threads;
            bool better = fits ? (!best_fits || have < best_have) : (!best_fits && have > best_have);
            if (better) {
                best = i;
            }
        }
        WorkerPool* crew = idle_[best];
        idle_.erase(idle_.begin() + (std::ptrdiff_t)best);
        return crew;
    }

    std::mutex mutex_;
    std::vector<WorkerPool*> idle_;
};

inline WorkerCrews& worker_crews() {
    static WorkerCrews* crews = new WorkerCrews();
    return *crews;
}

// Called by every worker of a launch with the launch's configuration when it starts its share,
// and with nullptr when it is done: the emulated driver (cuda-emu) sets it to know, in its
// SIGSEGV handler, which kernel a faulting thread was running. Unset in the harness.
typedef void (*WorkerHook)(const tandem_host_launch_config*);

inline std::atomic<WorkerHook>& worker_hook() {
    static std::atomic<WorkerHook> hook{nullptr};
    return hook;
}

// Run by the last thread to finish a block, while the others wait: barriers and warps start
// afresh, dynamic shared memory is poisoned again.
inline void reset_block(void* raw) {
    LaunchState* launch = static_cast<LaunchState*>(raw);
    launch->block_barrier.reset(launch->threads, "__syncthreads()");
    for (auto& w : launch->warps) {
        w->barrier.reset(w->lanes, "the warp's intrinsics");
        w->returned.store(0);
    }
    std::memset(launch->dynamic_shared.data(), 0xa5, launch->dynamic_shared.size());
}

template <typename... Params>
void thread_body(const LaunchJob& job, unsigned int linear) {
    typedef Kernel<Params...> K;
    LaunchState* launch = job.launch;
    this_launch = launch;
    this_fault = &launch->fault;
    blockDim = launch->block_dim;
    gridDim = launch->grid_dim;
    threadIdx.x = linear % blockDim.x;
    threadIdx.y = (linear / blockDim.x) % blockDim.y;
    threadIdx.z = linear / (blockDim.x * blockDim.y);
    this_lane = linear % 32u;
    this_warp = linear / 32u;
    auto kernel = reinterpret_cast<typename K::Function>(job.kernel);
    const auto* arguments = static_cast<const typename K::Arguments*>(job.arguments);
    for (unsigned int z = 0; z < gridDim.z; ++z) {
        for (unsigned int y = 0; y < gridDim.y; ++y) {
            for (unsigned int x = 0; x < gridDim.x; ++x) {
                blockIdx.x = x;
                blockIdx.y = y;
                blockIdx.z = z;
                exchanges = 0;
                if (!broken()) {
                    // Each thread gets its own copy of the parameters, as on the device.
                    typename K::Arguments copy = *arguments;
                    std::apply(kernel, copy);
                }
                Warp& warp = *launch->warps[this_warp];
                warp.returned.fetch_or(1u << this_lane);
                warp.barrier.leave();
                launch->block_barrier.leave();
                // Every thread has left the block; the last one out resets it for the next.
                launch->block_end.arrive_and_wait("the end of a block", &reset_block, launch);
            }
        }
    }
}

inline void run_job(void* context, unsigned int linear) {
    const LaunchJob& job = *static_cast<const LaunchJob*>(context);
    WorkerHook hook = worker_hook().load(std::memory_order_acquire);
    if (hook != nullptr) {
        hook(job.launch->config);
    }
    job.body(job, linear);
    this_launch = nullptr;
    this_fault = nullptr;
    if (hook != nullptr) {
        hook(nullptr);
    }
}

template <typename... Params>
int launch(void (*kernel)(Params...), const tandem_host_launch_config* config, void** args,
           char* error, std::size_t error_len) {
    typedef Kernel<Params...> K;
    unsigned long long threads = 1;
    for (int d = 0; d < 3; ++d) {
        threads *= config->block[d];
        if (config->grid[d] == 0 || config->block[d] == 0) {
            snprintf(error, error_len, "invalid launch: a grid or block dimension is 0");
            return 1;
        }
    }
    if (threads > 1024) {
        snprintf(error, error_len, "invalid launch: %llu threads per block (at most 1024)", threads);
        return 1;
    }
    LaunchState launch_state;
    launch_state.config = config;
    launch_state.block_dim = uint3{config->block[0], config->block[1], config->block[2]};
    launch_state.grid_dim = uint3{config->grid[0], config->grid[1], config->grid[2]};
    launch_state.fault.barrier_timeout_ms = config->barrier_timeout_ms;
    FaultState& state = launch_state.fault;
    launch_state.threads = (unsigned int)threads;
    launch_state.block_barrier.reset(launch_state.threads, "__syncthreads()");
    launch_state.block_end.reset(launch_state.threads);
    for (unsigned int first = 0; first < threads; first += 32) {
        std::unique_ptr<Warp> warp(new Warp());
        warp->lanes = (unsigned int)std::min<unsigned long long>(32, threads - first);
        warp->barrier.reset(warp->lanes, "the warp's intrinsics");
        launch_state.warps.push_back(std::move(warp));
    }
    launch_state.dynamic_shared_bytes = config->shared_mem_bytes;
    launch_state.dynamic_shared.assign(config->shared_mem_bytes + 16, 0xa5);

    typename K::Arguments arguments = K::unpack(args, std::index_sequence_for<Params...>{});
    LaunchJob job{&thread_body<Params...>, &launch_state, reinterpret_cast<void*>(kernel),
                  &arguments};
    bool ran = worker_crews().run((unsigned int)threads, &run_job, &job);
    for (std::atomic<LaunchState*>* claim : launch_state.claims) {
        claim->store(nullptr, std::memory_order_release);
    }
    if (!ran) {
        snprintf(error, error_len, "could not start %llu threads for the block", threads);
        return 1;
    }
    std::lock_guard<std::mutex> lock(state.mutex);
    if (!state.message.empty()) {
        snprintf(error, error_len, "%s", state.message.c_str());
        return 1;
    }
    return 0;
}

}  // namespace tandem_host

// ---- Parameter kinds: begin ------------------------------------------------------------------
// What each kernel parameter is, so that the harness can check a launch plan's declarations
// against the kernel's signature (cuda-harness/src/lib.rs, `check_declarations`): a
// `KernelArg::In` must be a pointer to const (`const T*`: the kernel only reads it), a
// `KernelArg::Out` a pointer to non-const (`T*`: the kernel writes it), any other argument a
// value of the parameter's size. The stream sanitizer trusts these declarations, so a kernel
// that only reads a buffer says so with `const`, and the plan with `In`.
namespace tandem_host {

// 'i' for a pointer to const, 'o' for a pointer to non-const, 'v' for a value.
template <typename P>
constexpr char param_kind() {
    typedef typename std::decay<P>::type T;
    return !std::is_pointer<T>::value                                      ? 'v'
           : std::is_const<typename std::remove_pointer<T>::type>::value ? 'i'
                                                                          : 'o';
}

// Writes the kind and the size of each parameter of `kernel` (at most `capacity` of them) and
// returns how many parameters it has.
template <typename... Params>
int param_kinds(void (*)(Params...), char* kinds, unsigned long long* sizes, int capacity) {
    const char all_kinds[] = {param_kind<Params>()..., 0};
    const unsigned long long all_sizes[] = {sizeof(typename std::decay<Params>::type)..., 0ull};
    const int count = (int)sizeof...(Params);
    for (int i = 0; i < count && i < capacity; ++i) {
        kinds[i] = all_kinds[i];
        sizes[i] = all_sizes[i];
    }
    return count;
}

}  // namespace tandem_host

// `tandem_param_kinds_<name>(kinds, sizes, capacity)`: the table above for one kernel. Part of
// every TANDEM_HOST_EXPORT (also of cuda-emu/nvrtc's redefinition of it).
#define TANDEM_HOST_EXPORT_PARAM_KINDS(name)                                                   \
    extern "C" int tandem_param_kinds_##name(char* kinds, unsigned long long* sizes,          \
                                             int capacity) {                                   \
        return ::tandem_host::param_kinds(name, kinds, sizes, capacity);                       \
    }
// ---- Parameter kinds: end --------------------------------------------------------------------

// The host entry point of a kernel: `tandem_host_<name>(config, args, error, error_len)`,
// returning 0, or 1 with a message in `error`; and its parameter kinds (above).
#define TANDEM_HOST_EXPORT(name)                                                               \
    extern "C" int tandem_host_##name(const tandem_host_launch_config* config, void** args,   \
                                      char* error, std::size_t error_len) {                    \
        return ::tandem_host::launch(name, config, args, error, error_len);                    \
    }                                                                                          \
    TANDEM_HOST_EXPORT_PARAM_KINDS(name)

#define TANDEM_DYNAMIC_SHARED(type, name)                                                      \
    type* name = reinterpret_cast<type*>(::tandem_host::dynamic_shared())

// ---------------------------------------------------------------------------------------------
// Barriers, warp intrinsics and fences.
// ---------------------------------------------------------------------------------------------

inline void __syncthreads() {
    ::tandem_host::current_launch()->block_barrier.arrive_and_wait("__syncthreads()");
}

inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    ::tandem_host::warp_exchange("__syncwarp()", mask, 0, [](unsigned int lane) { return lane; });
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
T __shfl_sync(unsigned int mask, T value, int source_lane, int width = 32) {
    return ::tandem_host::warp_exchange("__shfl_sync()", mask, value, [=](unsigned int lane) {
        unsigned int base = lane & ~(unsigned int)(width - 1);
        return base + ((unsigned int)source_lane & (unsigned int)(width - 1));
    });
}

template <typename T>
T __shfl_up_sync(unsigned int mask, T value, unsigned int delta, int width = 32) {
    return ::tandem_host::warp_exchange("__shfl_up_sync()", mask, value, [=](unsigned int lane) {
        unsigned int in_segment = lane & (unsigned int)(width - 1);
        return in_segment >= delta ? lane - delta : lane;
    });
}

template <typename T>
T __shfl_down_sync(unsigned int mask, T value, unsigned int delta, int width = 32) {
    return ::tandem_host::warp_exchange("__shfl_down_sync()", mask, value, [=](unsigned int lane) {
        unsigned int in_segment = lane & (unsigned int)(width - 1);
        return in_segment + delta < (unsigned int)width ? lane + delta : lane;
    });
}

template <typename T>
T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = 32) {
    return ::tandem_host::warp_exchange("__shfl_xor_sync()", mask, value, [=](unsigned int lane) {
        unsigned int base = lane & ~(unsigned int)(width - 1);
        unsigned int other = lane ^ (unsigned int)lane_mask;
        return other >= base + (unsigned int)width ? lane : other;
    });
}

inline unsigned int __ballot_sync(unsigned int mask, int predicate) {
    return ::tandem_host::warp_ballot(mask, predicate != 0);
}

inline int __any_sync(unsigned int mask, int predicate) {
    return __ballot_sync(mask, predicate) != 0;
}

inline int __all_sync(unsigned int mask, int predicate) {
    return __ballot_sync(mask, predicate) == ::tandem_host::full_mask(::tandem_host::this_warp_state());
}

inline unsigned int __activemask() {
    ::tandem_host::Warp& warp = ::tandem_host::this_warp_state();
    return ::tandem_host::full_mask(warp) & ~warp.returned.load();
}

// ---------------------------------------------------------------------------------------------
// Atomics.
// ---------------------------------------------------------------------------------------------

#define TANDEM_HOST_ATOMIC_INTEGER(T)                                                          \
    inline T atomicAdd(T* address, T value) {                                                  \
        return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);                           \
    }                                                                                          \
    inline T atomicSub(T* address, T value) {                                                  \
        return __atomic_fetch_sub(address, value, __ATOMIC_SEQ_CST);                           \
    }                                                                                          \
    inline T atomicExch(T* address, T value) {                                                 \
        return __atomic_exchange_n(address, value, __ATOMIC_SEQ_CST);                          \
    }                                                                                          \
    inline T atomicCAS(T* address, T compare, T value) {                                       \
        __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST,         \
                                    __ATOMIC_SEQ_CST);                                         \
        return compare;                                                                        \
    }                                                                                          \
    inline T atomicMax(T* address, T value) {                                                  \
        T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);                                    \
        while (old < value && !__atomic_compare_exchange_n(address, &old, value, false,        \
                                                           __ATOMIC_SEQ_CST,                   \
                                                           __ATOMIC_SEQ_CST)) {                \
        }                                                                                      \
        return old;                                                                            \
    }                                                                                          \
    inline T atomicMin(T* address, T value) {                                                  \
        T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);                                    \
        while (old > value && !__atomic_compare_exchange_n(address, &old, value, false,        \
                                                           __ATOMIC_SEQ_CST,                   \
                                                           __ATOMIC_SEQ_CST)) {                \
        }                                                                                      \
        return old;                                                                            \
    }

TANDEM_HOST_ATOMIC_INTEGER(int)
TANDEM_HOST_ATOMIC_INTEGER(unsigned int)
TANDEM_HOST_ATOMIC_INTEGER(long long)
TANDEM_HOST_ATOMIC_INTEGER(unsigned long long)

inline unsigned short atomicCAS(unsigned short* address, unsigned short compare,
                                unsigned short value) {
    __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    return compare;
}

namespace tandem_host {
// A floating-point read-modify-write through compare-and-swap on the bits.
template <typename F, typename Bits, typename Op>
F atomic_float_update(F* address, F value, Op op) {
    Bits* bits = reinterpret_cast<Bits*>(address);
    Bits old = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
    for (;;) {
        F old_value;
        std::memcpy(&old_value, &old, sizeof(F));
        F new_value = op(old_value, value);
        Bits new_bits;
        std::memcpy(&new_bits, &new_value, sizeof(F));
        if (__atomic_compare_exchange_n(bits, &old, new_bits, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
            return old_value;
        }
    }
}
}  // namespace tandem_host

inline float atomicAdd(float* address, float value) {
    return ::tandem_host::atomic_float_update<float, unsigned int>(
        address, value, [](float a, float b) { return a + b; });
}
inline double atomicAdd(double* address, double value) {
    return ::tandem_host::atomic_float_update<double, unsigned long long>(
        address, value, [](double a, double b) { return a + b; });
}
inline float atomicExch(float* address, float value) {
    return ::tandem_host::atomic_float_update<float, unsigned int>(
        address, value, [](float, float b) { return b; });
}

// ---------------------------------------------------------------------------------------------
// Bit casts, arithmetic intrinsics and math.
// ---------------------------------------------------------------------------------------------

namespace tandem_host {
template <typename To, typename From>
inline To bit_cast(From value) {
    static_assert(sizeof(To) == sizeof(From), "bit casts keep the size");
    To out;
    std::memcpy(&out, &value, sizeof(To));
    return out;
}
}  // namespace tandem_host

inline unsigned int __float_as_uint(float x) { return ::tandem_host::bit_cast<unsigned int>(x); }
inline int __float_as_int(float x) { return ::tandem_host::bit_cast<int>(x); }
inline float __uint_as_float(unsigned int x) { return ::tandem_host::bit_cast<float>(x); }
inline float __int_as_float(int x) { return ::tandem_host::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return ::tandem_host::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return ::tandem_host::bit_cast<double>(x); }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }

template <typename T>
inline T __ldg(const T* address) {
    return *address;
}

// CUDA's min and max overloads for same-typed arguments.
#define TANDEM_HOST_MIN_MAX(T)                                                                 \
    inline T min(T a, T b) { return b < a ? b : a; }                                           \
    inline T max(T a, T b) { return a < b ? b : a; }
TANDEM_HOST_MIN_MAX(int)
TANDEM_HOST_MIN_MAX(unsigned int)
TANDEM_HOST_MIN_MAX(long long)
TANDEM_HOST_MIN_MAX(unsigned long long)
TANDEM_HOST_MIN_MAX(float)
TANDEM_HOST_MIN_MAX(double)
#undef TANDEM_HOST_MIN_MAX

// ---------------------------------------------------------------------------------------------
// Clocks.
// ---------------------------------------------------------------------------------------------

namespace tandem_host {
// The emulated SM clock: 2 GHz, about an H100's boost clock, so cycle counts written for a GPU
// ("spin for 60e9 cycles, about 30 s") mean about the same time here.
constexpr long long clock_rate_hz = 2000000000LL;

// Cycles of the emulated clock: the host's monotonic clock (CLOCK_MONOTONIC) in nanoseconds,
// times 2. Monotonic and shared by every thread (a GPU's counter is per SM; kernels only take
// differences on one thread, which this keeps).
inline long long device_clock64() {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return ((long long)now.tv_sec * 1000000000LL + now.tv_nsec) * (clock_rate_hz / 1000000000LL);
}
}  // namespace tandem_host

// `clock64()`: the 64-bit cycle counter (never wraps in practice).
inline long long clock64() { return ::tandem_host::device_clock64(); }

// `clock()`: the low 32 bits of the same counter, as the device's 32-bit `%clock` (it wraps
// every 2.1 s at 2 GHz; use clock64 for longer spans). A macro, because the C library's
// `clock()` (host CPU time) is already declared with the same signature; kernel code sees this one.
#define clock() ((clock_t)(unsigned int)::tandem_host::device_clock64())

#endif  // TANDEM_HOST_H
