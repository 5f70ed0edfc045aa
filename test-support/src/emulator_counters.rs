//! The CUDA emulator's counters (`cuda-emu/src/counters.rs`) for tests outside the emulator's
//! crate: launches, copies, host synchronisations, … of this process, read from the emulated
//! driver tandem loaded. A real GPU has no such counters: every function here returns `None`
//! there (and when the GPU tests are skipped), and a test that needs them says so and passes.
//!
//! The counters are process-wide (every thread, every test of the binary): a test that asserts
//! on them runs alone in its test binary, or serialises its measurements.

use tandem_core::cuda::libs::{self, CudaLibrary};
use tandem_core::Device;
pub use tandem_cuda_emu::counters::{Counters, COUNTERS_VERSION};

/// The emulator-only entry point `name` of the emulated driver as tandem loaded it (its
/// counters are the ones tandem's calls move), when this process's GPU tests run on the
/// emulator.
///
/// # Safety
/// `F` must be the function pointer type of the symbol's C signature.
unsafe fn emulator_entry<F: Copy>(name: &str) -> Option<F> {
    if !crate::on_emulator() {
        return None;
    }
    let driver = libs::library(CudaLibrary::Driver, Device::Cuda(0))
        .unwrap_or_else(|e| panic!("the emulated driver is not loaded: {e}"));
    // SAFETY: the caller names the symbol's type; the library stays loaded for the process.
    let symbol = unsafe { driver.get::<F>(name.as_bytes()) }
        .unwrap_or_else(|e| panic!("the emulator's {name}: {e}"));
    Some(*symbol)
}

/// The emulator's counters now (`tandem_cuda_emu_counters`); `None` off the emulator. Take one
/// before and one after the code to measure and subtract them with [`Counters::since`].
pub fn counters() -> Option<Counters> {
    type Read = unsafe extern "C" fn(*mut Counters, usize) -> u32;
    // SAFETY: the emulator exports this function with this signature.
    let read = unsafe { emulator_entry::<Read>("tandem_cuda_emu_counters") }?;
    let mut out = Counters::default();
    // SAFETY: `out` is a `Counters` of the size passed.
    let code = unsafe { read(&mut out, std::mem::size_of::<Counters>()) };
    assert_eq!(
        code, 0,
        "tandem_cuda_emu_counters failed with CUDA error {code}"
    );
    assert_eq!(
        out.version, COUNTERS_VERSION,
        "the loaded emulator's counters have another layout (a stale copy of the library?)"
    );
    Some(out)
}

/// Makes every host synchronisation print its call stack on stderr, or stop doing so
/// (`tandem_cuda_emu_trace_host_syncs`), to find the code that waited; nothing off the
/// emulator.
pub fn trace_host_syncs(on: bool) {
    type Trace = unsafe extern "C" fn(u32);
    // SAFETY: the emulator exports this function with this signature.
    let Some(trace) = (unsafe { emulator_entry::<Trace>("tandem_cuda_emu_trace_host_syncs") })
    else {
        return;
    };
    // SAFETY: a flag.
    unsafe { trace(on.into()) }
}

/// One line per counter that moved, for a test's output and failure messages.
pub fn table(c: &Counters) -> String {
    c.fields()
        .into_iter()
        .filter(|&(_, v)| v > 0)
        .map(|(name, v)| format!("  {name:<20} {v:>10}"))
        .collect::<Vec<_>>()
        .join("\n")
}
