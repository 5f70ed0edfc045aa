//! The emulated NCCL's tests call it directly, through its C ABI, on device memory and streams
//! of the emulated driver (through tandem's CUDA layer), with ranks as threads of this process
//! or as processes (this test binary re-run as a worker). The reference results are computed
//! here on the host, independently of the emulator's own reductions, from inputs chosen so that
//! every result is exact in every data type.

#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use tandem_core::{Device, Stream, Tensor};

pub const GPU: Device = Device::Cuda(0);

pub const SUCCESS: c_int = 0;
pub const INVALID_ARGUMENT: c_int = 4;
pub const INVALID_USAGE: c_int = 5;
pub const IN_PROGRESS: c_int = 7;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Id(pub [c_char; 128]);

/// `ncclConfig_t`'s prefix of NCCL 2.14 (as tandem's ffi.rs declares it).
#[repr(C)]
pub struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net: *const c_char,
    split: c_int,
    traffic: c_int,
}

impl Config {
    pub fn new(blocking: bool) -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 21400,
            blocking: c_int::from(blocking),
            cga: c_int::MIN,
            min_ctas: c_int::MIN,
            max_ctas: c_int::MIN,
            net: std::ptr::null(),
            split: c_int::MIN,
            traffic: c_int::MIN,
        }
    }
}

pub type Comm = *mut c_void;
pub type RawStream = *mut c_void;

type Coll =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, RawStream) -> c_int;

/// The emulated NCCL's functions.
pub struct Nccl {
    pub get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    pub get_unique_id: unsafe extern "C" fn(*mut Id) -> c_int,
    pub init_rank: unsafe extern "C" fn(*mut Comm, c_int, Id, c_int) -> c_int,
    pub init_rank_config: unsafe extern "C" fn(*mut Comm, c_int, Id, c_int, *mut Config) -> c_int,
    pub count: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub user_rank: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub finalize: unsafe extern "C" fn(Comm) -> c_int,
    pub destroy: unsafe extern "C" fn(Comm) -> c_int,
    pub abort: unsafe extern "C" fn(Comm) -> c_int,
    pub last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    pub all_reduce: Coll,
    /// Same signature as a reduction, with the root in place of the operator.
    pub broadcast: Coll,
    pub reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        Comm,
        RawStream,
    ) -> c_int,
    pub all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, RawStream) -> c_int,
    pub reduce_scatter: Coll,
    pub send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, RawStream) -> c_int,
    pub recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, RawStream) -> c_int,
    pub group_start: unsafe extern "C" fn() -> c_int,
    pub group_end: unsafe extern "C" fn() -> c_int,
    _lib: libloading::Library,
}

/// Loads the emulator (driver first, then its NCCL from the emulator's folder).
pub fn nccl() -> &'static Nccl {
    static NCCL: OnceLock<Nccl> = OnceLock::new();
    NCCL.get_or_init(|| {
        let folder = tandem_test_support::use_emulator();
        tandem_core::cuda::device(0).expect("the emulated device");
        // SAFETY: the emulated NCCL has no initialisers with preconditions.
        let lib = unsafe { libloading::Library::new(folder.join("libnccl.so.2")) }
            .expect("the emulated NCCL");
        macro_rules! f {
            ($name:literal) => {
                // SAFETY: the emulated NCCL exports the function with NCCL's signature, which the
                // field's type reproduces.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.expect($name)
            };
        }
        Nccl {
            get_version: f!("ncclGetVersion"),
            get_unique_id: f!("ncclGetUniqueId"),
            init_rank: f!("ncclCommInitRank"),
            init_rank_config: f!("ncclCommInitRankConfig"),
            count: f!("ncclCommCount"),
            user_rank: f!("ncclCommUserRank"),
            get_async_error: f!("ncclCommGetAsyncError"),
            finalize: f!("ncclCommFinalize"),
            destroy: f!("ncclCommDestroy"),
            abort: f!("ncclCommAbort"),
            last_error: f!("ncclGetLastError"),
            all_reduce: f!("ncclAllReduce"),
            broadcast: f!("ncclBroadcast"),
            reduce: f!("ncclReduce"),
            all_gather: f!("ncclAllGather"),
            reduce_scatter: f!("ncclReduceScatter"),
            send: f!("ncclSend"),
            recv: f!("ncclRecv"),
            group_start: f!("ncclGroupStart"),
            group_end: f!("ncclGroupEnd"),
            _lib: lib,
        }
    })
}

/// A fresh unique id.
pub fn new_id() -> Id {
    let mut id = Id([0; 128]);
    // SAFETY: a writable id.
    assert_eq!(unsafe { (nccl().get_unique_id)(&mut id) }, SUCCESS);
    id
}

pub fn id_to_hex(id: &Id) -> String {
    id.0.iter().map(|&b| format!("{:02x}", b as u8)).collect()
}

pub fn id_from_hex(hex: &str) -> Id {
    let mut id = Id([0; 128]);
    for (i, b) in id.0.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex") as c_char;
    }
    id
}

/// NCCL's last error, as text.
pub fn last_error(comm: Comm) -> String {
    // SAFETY: the emulator returns a NUL-terminated string valid until this thread's next call.
    unsafe { CStr::from_ptr((nccl().last_error)(comm)) }
        .to_string_lossy()
        .into_owned()
}

/// The communicator's asynchronous state.
pub fn async_error(comm: Comm) -> c_int {
    let mut state = -1;
    // SAFETY: a communicator handle and an out-parameter.
    let status = unsafe { (nccl().get_async_error)(comm, &mut state) };
    assert_eq!(status, SUCCESS);
    state
}

/// Polls the asynchronous state until it is no longer `ncclInProgress` (at most 60 s).
pub fn settle(comm: Comm) -> c_int {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = async_error(comm);
        if state != IN_PROGRESS || Instant::now() > deadline {
            return state;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One rank: its communicator and its own stream, with the device bound on this thread.
pub struct Rank {
    pub comm: Comm,
    pub rank: usize,
    pub world: usize,
    pub stream: Stream,
}

// SAFETY: the communicator handle is an opaque number the emulator may be called with from any
// thread; each test uses a rank from one thread at a time.
unsafe impl Send for Rank {}

impl Rank {
    /// Joins `id` as `rank` of `world` (blocking init).
    pub fn join(id: Id, rank: usize, world: usize) -> Rank {
        let nccl = nccl();
        let device = tandem_core::cuda::device(0).unwrap();
        device.bind("test").unwrap();
        let stream = Stream::new_on(GPU, &format!("nccl-test-{rank}")).unwrap();
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: an out-parameter and an id of the emulator.
        let status = unsafe { (nccl.init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        assert_eq!(status, SUCCESS, "init rank {rank}: {}", last_error(comm));
        Rank {
            comm,
            rank,
            world,
            stream,
        }
    }

    pub fn raw_stream(&self) -> RawStream {
        self.stream.cuda_stream().unwrap().cu_stream() as RawStream
    }

    pub fn bind(&self) {
        tandem_core::cuda::device(0).unwrap().bind("test").unwrap();
    }

    pub fn sync(&self) {
        self.stream.synchronize().unwrap();
    }

    pub fn destroy(self) {
        let nccl = nccl();
        // SAFETY: a live communicator, used by this thread only.
        let status = unsafe { (nccl.finalize)(self.comm) };
        assert!(status == SUCCESS || status == IN_PROGRESS);
        assert_eq!(settle(self.comm), SUCCESS, "{}", last_error(self.comm));
        // SAFETY: as above; the handle is not used again.
        assert_eq!(unsafe { (nccl.destroy)(self.comm) }, SUCCESS);
    }
}

/// Runs `body(rank)` on `world` threads, each a rank of one communicator, and returns their
/// results in rank order.
pub fn on_threads<T: Send + 'static>(
    world: usize,
    body: impl Fn(Rank) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let id = new_id();
    let body = Arc::new(body);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let body = body.clone();
            std::thread::spawn(move || body(Rank::join(id, rank, world)))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

// ---- Device buffers ---------------------------------------------------------------------------

/// A device buffer of bytes.
pub struct Buf {
    pub t: Tensor,
}

impl Buf {
    pub fn upload(bytes: &[u8]) -> Buf {
        let t = Tensor::from_vec(bytes.to_vec(), &[bytes.len().max(1)], Device::Cpu)
            .unwrap()
            .to_device(GPU)
            .unwrap();
        tandem_core::cuda::device(0).unwrap().synchronize().unwrap();
        Buf { t }
    }

    pub fn zeros(len: usize) -> Buf {
        Buf::upload(&vec![0u8; len])
    }

    pub fn ptr(&self) -> *mut c_void {
        tandem_core::cuda::device_pointer("test", &self.t)
            .unwrap()
            .1 as *mut c_void
    }

    pub fn read(&self) -> Vec<u8> {
        self.t.to_vec::<u8>().unwrap()
    }
}

// ---- Data types and the reference -------------------------------------------------------------

/// The data types the emulator supports: (`ncclDataType_t`, size, name).
pub const DTYPES: [(c_int, usize, &str); 10] = [
    (0, 1, "int8"),
    (1, 1, "uint8"),
    (2, 4, "int32"),
    (3, 4, "uint32"),
    (4, 8, "int64"),
    (5, 8, "uint64"),
    (6, 2, "float16"),
    (7, 4, "float32"),
    (8, 8, "float64"),
    (9, 2, "bfloat16"),
];

/// The operators: (`ncclRedOp_t`, name).
pub const OPS: [(c_int, &str); 5] = [(0, "sum"), (1, "prod"), (2, "max"), (3, "min"), (4, "avg")];

pub fn is_float(dtype: c_int) -> bool {
    matches!(dtype, 6..=9)
}

pub fn is_unsigned(dtype: c_int) -> bool {
    matches!(dtype, 1 | 3 | 5)
}

/// A value of rank `rank`'s input `i` in case `case`: a small integer (in 0..5 for unsigned
/// types, -2..3 otherwise) so that sums, products of up to 8 factors, and the average's
/// pre-multiplication by 1/2, 1/4 or 1/8 are exact in every type.
pub fn value(case: u64, rank: usize, i: usize, dtype: c_int) -> f64 {
    let mut x = case
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((rank as u64) << 32 | i as u64);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    let v = (x % 5) as f64;
    if is_unsigned(dtype) {
        v
    } else {
        v - 2.0
    }
}

/// `values` encoded in `dtype` (integers wrap as C casts do).
pub fn encode(values: &[f64], dtype: c_int) -> Vec<u8> {
    let mut out = Vec::new();
    for &v in values {
        match dtype {
            0 => out.extend((v as i64 as i8).to_le_bytes()),
            1 => out.extend((v as i64 as u8).to_le_bytes()),
            2 => out.extend((v as i64 as i32).to_le_bytes()),
            3 => out.extend((v as i64 as u32).to_le_bytes()),
            4 => out.extend((v as i64).to_le_bytes()),
            5 => out.extend((v as i64 as u64).to_le_bytes()),
            6 => out.extend(f16::from_f64(v).to_le_bytes()),
            7 => out.extend((v as f32).to_le_bytes()),
            8 => out.extend(v.to_le_bytes()),
            9 => out.extend(bf16::from_f64(v).to_le_bytes()),
            _ => unreachable!(),
        }
    }
    out
}

/// `bytes` decoded from `dtype`.
pub fn decode(bytes: &[u8], dtype: c_int) -> Vec<f64> {
    let size = DTYPES[dtype as usize].1;
    bytes
        .chunks_exact(size)
        .map(|b| match dtype {
            0 => b[0] as i8 as f64,
            1 => b[0] as f64,
            2 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
            3 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
            4 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
            5 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
            6 => f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
            7 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
            8 => f64::from_le_bytes(b.try_into().unwrap()),
            9 => bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
            _ => unreachable!(),
        })
        .collect()
}

/// The reduction of `xs` (one value per rank) by `op` in `dtype`, as NCCL defines it: exact
/// for the inputs of [`value`]; integer results wrap to the type, the integer average is the
/// sum divided by the number of ranks, truncated.
pub fn reference(xs: &[f64], op: c_int, dtype: c_int) -> f64 {
    let n = xs.len() as f64;
    let r = match op {
        0 => xs.iter().sum(),
        1 => xs.iter().product(),
        2 => xs.iter().cloned().fold(f64::MIN, f64::max),
        3 => xs.iter().cloned().fold(f64::MAX, f64::min),
        4 if is_float(dtype) => xs.iter().sum::<f64>() / n,
        4 => (xs.iter().sum::<f64>() / n).trunc(),
        _ => unreachable!(),
    };
    // Wrap integers to the type by a round trip through its encoding.
    decode(&encode(&[r], dtype), dtype)[0]
}

/// Runs `f` and fails the test if it returns a status other than success.
pub fn ok(what: &str, comm: Comm, status: c_int) {
    assert_eq!(status, SUCCESS, "{what}: {}", last_error(comm));
}
