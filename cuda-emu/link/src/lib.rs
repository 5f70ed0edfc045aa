//! `tandem-cuda-emu-link`: what every emulated library of the CUDA emulator needs from the
//! emulated driver and from its own C entry points, written once for cuBLAS, cuBLASLt, cuDNN and
//! NCCL (tests only).
//!
//! - [`Library`]: what a library says about itself (its status type and the codes it returns
//!   for a panic, a stub, a missing driver, a refused enqueue, a range outside every
//!   allocation; how it reports a message);
//! - [`driver`]: the emulated driver's functions, found once in the already-loaded
//!   `libcuda.so` (never loading another one), with a message naming the library when the
//!   loaded driver is not the emulator's;
//! - [`enqueue`] (work in stream order on a stream's worker, through `cuLaunchHostFunc`),
//!   [`check_range`] (`tandem_cuda_emu_check_device_range`) and [`Driver::synchronize`];
//! - [`entry`] (a panic must not unwind into C), [`fail`], [`put`], [`say`] and the stubs'
//!   macro [`stubs!`].
//!
//! The driver itself (`tandem-cuda-emu`) uses only [`say`], [`panic_text`] and [`stubs!`]: it
//! is what the rest finds.

#![warn(missing_docs)]

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::OnceLock;

/// Prints a message of the emulator on stderr.
pub fn say(message: &str) {
    eprintln!("tandem-cuda-emu: {message}");
}

/// The text of a caught panic (its `String` or `&str` payload, else empty).
pub fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// An emulated library: its status type, the codes the shared code returns, and how it reports.
pub trait Library: 'static {
    /// The library's status type (`cublasStatus_t`, `cudnnStatus_t`, `ncclResult_t`).
    type Status: Copy;
    /// Its name in messages ("cuBLAS").
    const NAME: &'static str;
    /// What it enqueues, in messages ("product").
    const WORK: &'static str;
    /// The message when enqueued work panics on the worker ("a cuBLAS product panicked on its
    /// stream's worker").
    const WORKER_PANIC: &'static str;
    /// Returned when an entry point succeeds.
    const SUCCESS: Self::Status;
    /// Returned when an entry point panics.
    const INTERNAL_ERROR: Self::Status;
    /// Returned by a stub.
    const NOT_EMULATED: Self::Status;
    /// Returned when the emulated driver is not loaded.
    const NO_DRIVER: Self::Status;
    /// Returned when the driver refuses to enqueue work.
    const ENQUEUE_FAILED: Self::Status;

    /// Reports a message (stderr; a library may also keep it, as cuDNN's last message).
    fn say(message: &str) {
        say(message)
    }

    /// Keeps the message of a failure beyond [`Library::say`] (NCCL's last error per thread).
    fn keep_error(_message: &str) {}

    /// The status for `len` bytes at a pointer outside every live allocation (the driver has
    /// reported it); `what` names the operand.
    fn range_fault(what: String) -> Self::Status;
}

/// The body of an entry point: `Err` holds the status to return.
pub type Res<L> = Result<(), <L as Library>::Status>;

/// Fails with `status` after saying why.
pub fn fail<L: Library, T>(status: L::Status, message: String) -> Result<T, L::Status> {
    L::say(&message);
    L::keep_error(&message);
    Err(status)
}

/// Runs an entry point's body; a panic becomes the library's internal error with a message (it
/// must not unwind into C).
pub fn entry<L: Library>(name: &str, body: impl FnOnce() -> Res<L>) -> L::Status {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(())) => L::SUCCESS,
        Ok(Err(status)) => status,
        Err(panic) => {
            let text = panic_text(&*panic);
            fail::<L, ()>(
                L::INTERNAL_ERROR,
                format!("{name} panicked inside the emulator: {text}"),
            )
            .err()
            .unwrap_or(L::INTERNAL_ERROR)
        }
    }
}

/// Writes through an out-pointer, or fails with `on_null()` when it is null.
///
/// # Safety
/// A non-null `out` must be valid for a write of `T` (the C API's contract for out-parameters).
pub unsafe fn put<T, E>(out: *mut T, value: T, on_null: impl FnOnce() -> E) -> Result<(), E> {
    if out.is_null() {
        return Err(on_null());
    }
    // SAFETY: non-null; the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// What a stub does: says that `name` is not emulated and returns the library's code for it.
pub fn not_emulated<L: Library>(name: &str) -> L::Status {
    fail::<L, ()>(L::NOT_EMULATED, format!("{name} is not emulated"))
        .err()
        .unwrap_or(L::NOT_EMULATED)
}

/// Exports each name as a C function that ignores its arguments (the C calling convention lets a
/// callee ignore them) and returns `$not_emulated(name)`: cudarc loads each symbol at its first
/// call and panics when it is missing; with a stub a call the emulator lacks is an error naming
/// the function.
///
/// ```ignore
/// tandem_cuda_emu_link::stubs!(Status = tandem_cuda_emu_link::not_emulated::<Cudnn>;
///     cudnnAddTensor, cudnnActivationForward);
/// ```
#[macro_export]
macro_rules! stubs {
    ($status:ty = $not_emulated:expr; $($name:ident),* $(,)?) => {
        $(
            #[doc = concat!("`", stringify!($name), "`: not emulated; reports `", stringify!($name),
                " is not emulated` and returns the library's not-emulated status (the arguments \
                are ignored).")]
            #[no_mangle]
            pub extern "C" fn $name() -> $status {
                $not_emulated(stringify!($name))
            }
        )*
    };
}

// ---- The emulated driver ----------------------------------------------------------------------

type LaunchHostFunc = unsafe extern "C" fn(
    *mut c_void,
    Option<unsafe extern "C" fn(*mut c_void)>,
    *mut c_void,
) -> u32;
type StreamSynchronize = unsafe extern "C" fn(*mut c_void) -> u32;
type CheckRange = unsafe extern "C" fn(u64, usize, *const c_char) -> u32;
type Count = unsafe extern "C" fn(u32);

/// The driver functions the emulated libraries need, from the emulated driver already loaded.
pub struct Driver {
    launch_host_func: LaunchHostFunc,
    stream_synchronize: StreamSynchronize,
    check_range: CheckRange,
    count_blas: Count,
    count_dnn: Count,
}

impl Driver {
    /// `cuStreamSynchronize(stream)`: its `CUresult`.
    pub fn synchronize(&self, stream: usize) -> u32 {
        // SAFETY: the driver checks the stream handle; an unknown one is an error code.
        unsafe { (self.stream_synchronize)(stream as *mut c_void) }
    }

    /// Counts a product in the driver's counters (`tandem_cuda_emu_count_blas`; 0 a GEMM, 1 a
    /// GEMV).
    pub fn count_blas(&self, kind: u32) {
        // SAFETY: the driver's counter takes any kind.
        unsafe { (self.count_blas)(kind) }
    }

    /// Counts a convolution in the driver's counters (`tandem_cuda_emu_count_dnn`; the pass).
    pub fn count_dnn(&self, pass: u32) {
        // SAFETY: the driver's counter takes any kind.
        unsafe { (self.count_dnn)(pass) }
    }
}

/// Why the driver's functions were not found.
enum Missing {
    /// No `libcuda.so` is loaded.
    Driver,
    /// The loaded `libcuda.so` lacks this function: it is not the emulator's.
    Symbol(&'static CStr),
}

/// The emulated driver's functions, found once; fails with `L::NO_DRIVER` and a message naming
/// the library when the loaded driver is missing or not the emulator's.
pub fn driver<L: Library>() -> Result<&'static Driver, L::Status> {
    // One per shared object (each library links its own copy of this crate).
    static DRIVER: OnceLock<Result<Driver, Missing>> = OnceLock::new();
    let found = DRIVER.get_or_init(|| {
        // The driver was opened by tandem (by its path) before the library; its SONAME
        // `libcuda.so` makes this open-by-name find that copy, and RTLD_NOLOAD never loads
        // another one.
        // SAFETY: a NUL-terminated name; NOLOAD runs no initialisers.
        let lib =
            unsafe { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if lib.is_null() {
            return Err(Missing::Driver);
        }
        let symbol = |name: &'static CStr| {
            // SAFETY: a live handle and a NUL-terminated name.
            let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
            if f.is_null() {
                Err(Missing::Symbol(name))
            } else {
                Ok(f)
            }
        };
        let launch = symbol(c"cuLaunchHostFunc")?;
        let sync = symbol(c"cuStreamSynchronize")?;
        let check = symbol(c"tandem_cuda_emu_check_device_range")?;
        let count_blas = symbol(c"tandem_cuda_emu_count_blas")?;
        let count_dnn = symbol(c"tandem_cuda_emu_count_dnn")?;
        // SAFETY: the emulated driver exports these with these signatures (the stream handle
        // and CUresult as pointer and u32).
        Ok(unsafe {
            Driver {
                launch_host_func: std::mem::transmute::<*mut c_void, LaunchHostFunc>(launch),
                stream_synchronize: std::mem::transmute::<*mut c_void, StreamSynchronize>(sync),
                check_range: std::mem::transmute::<*mut c_void, CheckRange>(check),
                count_blas: std::mem::transmute::<*mut c_void, Count>(count_blas),
                count_dnn: std::mem::transmute::<*mut c_void, Count>(count_dnn),
            }
        })
    });
    match found {
        Ok(d) => Ok(d),
        Err(Missing::Driver) => fail::<L, _>(
            L::NO_DRIVER,
            format!(
                "the emulated {} needs the emulated driver (libcuda.so) loaded first",
                L::NAME
            ),
        ),
        Err(Missing::Symbol(name)) => fail::<L, _>(
            L::NO_DRIVER,
            format!(
                "the loaded libcuda.so lacks {}: the emulated {} runs only with the emulated \
                 driver",
                name.to_string_lossy(),
                L::NAME
            ),
        ),
    }
}

/// Checks that `len` bytes at `ptr` lie in one live device allocation; the driver reports the
/// fault (starting with `what`) on stderr, and the library's [`Library::range_fault`] gives the
/// status.
pub fn check_range<L: Library>(ptr: u64, len: usize, what: impl FnOnce() -> String) -> Res<L> {
    if len == 0 {
        return Ok(());
    }
    let d = driver::<L>()?;
    let what = what();
    let text = CString::new(what.as_str()).unwrap_or_default();
    // SAFETY: a NUL-terminated message; the driver only reads the range's bookkeeping.
    match unsafe { (d.check_range)(ptr, len, text.as_ptr()) } {
        0 => Ok(()),
        _ => Err(L::range_fault(what)),
    }
}

/// Work for a stream's worker.
pub type Job = Box<dyn FnOnce() + Send>;

unsafe extern "C" fn run_job<L: Library>(data: *mut c_void) {
    // SAFETY: `data` is the `Box<Job>` `enqueue` leaked for this call, run exactly once.
    let job = unsafe { Box::from_raw(data.cast::<Job>()) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
        L::say(L::WORKER_PANIC);
    }
}

/// Enqueues `job` on `stream` in stream order (`cuLaunchHostFunc`); `name` is the entry point,
/// for the message when the driver refuses.
pub fn enqueue<L: Library>(name: &str, stream: usize, job: Job) -> Res<L> {
    let d = driver::<L>()?;
    let data = Box::into_raw(Box::new(job));
    // SAFETY: the driver runs `run_job(data)` once on the stream's worker, or returns an error
    // without running it.
    let code =
        unsafe { (d.launch_host_func)(stream as *mut c_void, Some(run_job::<L>), data.cast()) };
    if code != 0 {
        // SAFETY: not run, so still ours.
        drop(unsafe { Box::from_raw(data) });
        return fail::<L, _>(
            L::ENQUEUE_FAILED,
            format!(
                "{name}: the driver refused to enqueue the {} on stream {stream:#x} (CUresult \
                 {code})",
                L::WORK
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A library whose messages are kept, to check what the shared code reports.
    enum Lib {}

    thread_local! {
        static SAID: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    impl Library for Lib {
        type Status = u32;
        const NAME: &'static str = "Lib";
        const WORK: &'static str = "job";
        const WORKER_PANIC: &'static str = "a Lib job panicked on its stream's worker";
        const SUCCESS: u32 = 0;
        const INTERNAL_ERROR: u32 = 1;
        const NOT_EMULATED: u32 = 2;
        const NO_DRIVER: u32 = 3;
        const ENQUEUE_FAILED: u32 = 4;

        fn say(message: &str) {
            SAID.with(|s| s.borrow_mut().push(message.to_string()));
        }

        fn range_fault(_what: String) -> u32 {
            5
        }
    }

    fn said() -> Vec<String> {
        SAID.with(|s| std::mem::take(&mut *s.borrow_mut()))
    }

    #[test]
    fn entry_returns_the_body_s_status_and_turns_a_panic_into_the_internal_error() {
        assert_eq!(entry::<Lib>("ok", || Ok(())), 0);
        assert_eq!(entry::<Lib>("refused", || Err(7)), 7);
        assert!(said().is_empty());
        assert_eq!(entry::<Lib>("libBoom", || panic!("at {}", 3)), 1);
        assert_eq!(said(), ["libBoom panicked inside the emulator: at 3"]);
    }

    #[test]
    fn put_writes_or_fails_on_a_null_pointer_and_stubs_say_their_name() {
        let mut v = 0u64;
        // SAFETY: a live local, then a null pointer (never written).
        unsafe {
            assert_eq!(put(&mut v, 9, || 6), Ok(()));
            assert_eq!(put(std::ptr::null_mut::<u64>(), 9, || 6), Err(6));
        }
        assert_eq!(v, 9);
        assert_eq!(not_emulated::<Lib>("libThing"), 2);
        assert_eq!(said(), ["libThing is not emulated"]);
    }

    #[test]
    fn without_the_emulated_driver_the_library_says_it_needs_it() {
        // No libcuda.so is loaded in this test binary.
        assert_eq!(driver::<Lib>().err(), Some(3));
        assert_eq!(
            said(),
            ["the emulated Lib needs the emulated driver (libcuda.so) loaded first"]
        );
        assert_eq!(enqueue::<Lib>("libRun", 0, Box::new(|| ())), Err(3));
        assert_eq!(check_range::<Lib>(0x1000, 0, String::new), Ok(()), "empty");
    }
}
