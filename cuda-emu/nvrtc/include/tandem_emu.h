// tandem_emu.h: what the emulated NVRTC adds to the host harness's execution model
// (cuda-harness/include/tandem_host.h) for kernels run by the emulated driver.
//
// Included after tandem_host.h and before the kernel source. It redefines TANDEM_HOST_EXPORT so
// that each kernel exports, besides its host entry `tandem_host_<name>`, the sizes of its
// parameters, `tandem_emu_params_<name>`: the emulated `cuLaunchKernel` copies the arguments at
// the launch, as the driver does, and needs their sizes for that. It keeps tandem_host.h's
// parameter-kind table (`tandem_param_kinds_<name>`, TANDEM_HOST_EXPORT_PARAM_KINDS), so a
// module built here describes its kernels as the harness's libraries do. It also defines
// `tandem_emu_set_worker_hook` (see below).

#ifndef TANDEM_EMU_H
#define TANDEM_EMU_H

#include <cstddef>
#include <type_traits>

namespace tandem_emu {

// Writes the size of each parameter of `kernel` into `sizes` (at most `capacity` of them) and
// returns how many parameters it has.
template <typename... Params>
int param_sizes(void (*)(Params...), unsigned long long* sizes, int capacity) {
    const unsigned long long all[] = {sizeof(typename std::decay<Params>::type)..., 0ull};
    const int count = (int)sizeof...(Params);
    for (int i = 0; i < count && i < capacity; ++i) {
        sizes[i] = all[i];
    }
    return count;
}

}  // namespace tandem_emu

// Sets the execution model's worker hook (tandem_host.h's `worker_hook`): the emulated driver
// calls it once per module it loads, so that its SIGSEGV handler knows which kernel a faulting
// worker was running. Defined here, once per module (the generated wrapper includes this header
// once).
extern "C" void tandem_emu_set_worker_hook(::tandem_host::WorkerHook hook) {
    ::tandem_host::worker_hook().store(hook, std::memory_order_release);
}

#undef TANDEM_HOST_EXPORT
#define TANDEM_HOST_EXPORT(name)                                                               \
    extern "C" int tandem_host_##name(const tandem_host_launch_config* config, void** args,   \
                                      char* error, std::size_t error_len) {                    \
        return ::tandem_host::launch(name, config, args, error, error_len);                    \
    }                                                                                          \
    extern "C" int tandem_emu_params_##name(unsigned long long* sizes, int capacity) {         \
        return ::tandem_emu::param_sizes(name, sizes, capacity);                               \
    }                                                                                          \
    TANDEM_HOST_EXPORT_PARAM_KINDS(name)

#endif  // TANDEM_EMU_H
