//! Kernel launches as plain data: which kernel, with what grid, block and arguments.
//!
//! An op's CUDA code does not launch anything itself. A pure function computes a [`Launch`] from
//! device pointers, layouts and scalars; the CUDA runtime executes it on a device
//! (`cuLaunchKernel` with [`Launch::params`]), and the host harness (`tandem-cuda-harness`)
//! executes the very same plan on the CPU against an emulation of the execution model. So the
//! launch arithmetic — grid sizes, argument order, layouts — is tested in every CI run, on
//! machines without a GPU.
//!
//! Launch configurations are computed here and only here ([`LaunchConfig`]'s constructors), with
//! checked arithmetic: a size that does not fit the device's grid or block limits, or a 32-bit
//! index where a kernel uses one, is an error naming the op, never a silent wrap-around.

use std::ffi::c_void;
use std::marker::PhantomData;

use crate::{Error, Layout, Result};

/// A CUDA C source file embedded in the binary, with the headers it includes besides
/// `tandem.cuh` (which every kernel source may include and is always supplied).
#[derive(Debug)]
pub struct KernelSource {
    /// The file's name without `.cu` (`"runtime"`); unique across tandem, it names the compiled
    /// module and, in the host harness, the shared library built from the file.
    pub name: &'static str,
    /// The CUDA C text (`include_str!("runtime.cu")`).
    pub source: &'static str,
    /// Further headers the source includes, by the name it includes them under.
    pub headers: &'static [KernelHeader],
}

/// A header a kernel source includes (`#include "name"`), embedded in the binary.
#[derive(Debug)]
pub struct KernelHeader {
    /// The name in the `#include` line.
    pub name: &'static str,
    /// The header's text.
    pub source: &'static str,
}

/// tandem's shared kernel header: integer and 16-bit float types, layouts, conversions, the
/// grid-stride loop and the conventions every kernel follows (see its top comment).
pub static TANDEM_CUH: KernelHeader = KernelHeader {
    name: "tandem.cuh",
    source: include_str!("kernels/tandem.cuh"),
};

/// Threads in a warp on every NVIDIA GPU tandem supports.
pub const WARP_SIZE: u32 = 32;
/// The most threads a block may have.
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;
/// The largest `grid[0]`.
pub const MAX_GRID_X: u32 = i32::MAX as u32;
/// The largest `grid[1]` and `grid[2]`.
pub const MAX_GRID_YZ: u32 = 65_535;
/// The largest `block[2]`.
pub const MAX_BLOCK_Z: u32 = 64;
/// The most shared memory (static plus dynamic) a block may use without opting in to more per
/// kernel, which tandem's launcher does not do.
pub const MAX_SHARED_MEM_BYTES: u32 = 48 * 1024;
/// The most blocks a grid-stride launch uses: enough to fill the largest GPUs several times over;
/// past it, each thread handles more elements.
pub const GRID_STRIDE_MAX_BLOCKS: u32 = 16_384;

/// The grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A configuration from explicit sizes, checked against the device limits (every dimension
    /// at least 1; `block` at most 1024 threads with `block[2] <= 64`; `grid[0] < 2^31`,
    /// `grid[1]`, `grid[2] <= 65535`; shared memory at most 48 KiB).
    pub fn new(
        op: &'static str,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem_bytes: u32,
    ) -> Result<Self> {
        let bad = |msg: String| Err(Error::invalid(op, format!("launch configuration: {msg}")));
        if grid.contains(&0) || block.contains(&0) {
            return bad(format!(
                "grid {grid:?} and block {block:?} must be at least 1 in every dimension"
            ));
        }
        if grid[0] > MAX_GRID_X || grid[1] > MAX_GRID_YZ || grid[2] > MAX_GRID_YZ {
            return bad(format!(
                "grid {grid:?} exceeds the limits [{MAX_GRID_X}, {MAX_GRID_YZ}, {MAX_GRID_YZ}]"
            ));
        }
        let threads = block.iter().map(|&b| u64::from(b)).product::<u64>();
        if threads > u64::from(MAX_THREADS_PER_BLOCK) || block[2] > MAX_BLOCK_Z {
            return bad(format!(
                "block {block:?} has {threads} threads; the limit is {MAX_THREADS_PER_BLOCK} \
                 with at most {MAX_BLOCK_Z} in z"
            ));
        }
        if shared_mem_bytes > MAX_SHARED_MEM_BYTES {
            return bad(format!(
                "{shared_mem_bytes} bytes of dynamic shared memory; the limit is {MAX_SHARED_MEM_BYTES}"
            ));
        }
        Ok(LaunchConfig {
            grid,
            block,
            shared_mem_bytes,
        })
    }

    /// One thread per element for `n` elements in a grid-stride loop: blocks of
    /// `threads_per_block` (a multiple of 32 up to 1024), as many blocks as cover `n` up to
    /// [`GRID_STRIDE_MAX_BLOCKS`]. At least one block, so an empty launch is still valid; the
    /// kernel's loop then does nothing.
    pub fn for_elements(op: &'static str, n: usize, threads_per_block: u32) -> Result<Self> {
        check_threads_per_block(op, threads_per_block)?;
        let blocks = blocks_for(
            n as u64,
            u64::from(threads_per_block),
            GRID_STRIDE_MAX_BLOCKS,
        );
        LaunchConfig::new(op, [blocks, 1, 1], [threads_per_block, 1, 1], 0)
    }

    /// One block per row for `rows` rows (a block-per-row reduction or normalisation), in a
    /// grid-stride loop over rows: up to [`GRID_STRIDE_MAX_BLOCKS`] blocks of
    /// `threads_per_block` threads (a multiple of 32 up to 1024) with `shared_mem_bytes` of
    /// dynamic shared memory each.
    pub fn for_rows(
        op: &'static str,
        rows: usize,
        threads_per_block: u32,
        shared_mem_bytes: u32,
    ) -> Result<Self> {
        check_threads_per_block(op, threads_per_block)?;
        let blocks = (rows as u64).clamp(1, u64::from(GRID_STRIDE_MAX_BLOCKS)) as u32;
        LaunchConfig::new(
            op,
            [blocks, 1, 1],
            [threads_per_block, 1, 1],
            shared_mem_bytes,
        )
    }

    /// Threads in one block.
    pub fn threads_per_block(&self) -> u32 {
        // new() checked that the product is at most 1024.
        self.block[0] * self.block[1] * self.block[2]
    }

    /// Blocks in the grid.
    pub fn blocks(&self) -> u64 {
        self.grid.iter().map(|&g| u64::from(g)).product()
    }
}

/// `ceil(n / per_block)` clamped to `1..=cap`.
fn blocks_for(n: u64, per_block: u64, cap: u32) -> u32 {
    n.div_ceil(per_block).clamp(1, u64::from(cap)) as u32
}

fn check_threads_per_block(op: &'static str, threads: u32) -> Result<()> {
    if threads == 0 || threads > MAX_THREADS_PER_BLOCK || !threads.is_multiple_of(WARP_SIZE) {
        return Err(Error::invalid(
            op,
            format!(
                "launch configuration: {threads} threads per block; tandem's kernels use whole \
                 warps: a multiple of {WARP_SIZE} up to {MAX_THREADS_PER_BLOCK}"
            ),
        ));
    }
    Ok(())
}

/// `value` as a 32-bit index, for a kernel that indexes `what` with 32-bit integers; errors when
/// it does not fit (`<= i32::MAX`). tandem's rule (see `tandem.cuh`): kernels index with 64-bit
/// integers unless their launch builder checks the size with this function.
pub fn index_u32(op: &'static str, what: &str, value: usize) -> Result<u32> {
    if value > i32::MAX as usize {
        return Err(Error::invalid(
            op,
            format!(
                "{what} is {value}, beyond the 32-bit indices of this kernel ({} at most)",
                i32::MAX
            ),
        ));
    }
    Ok(value as u32)
}

/// The most dimensions a [`StridedLayout`] carries (after merging dimensions that need no
/// separate stride).
pub const MAX_KERNEL_RANK: usize = 8;

/// A tensor layout as kernels receive it, by value: `tandem_layout` in `tandem.cuh`.
///
/// Element `i` in row-major order sits at `offset + Σ index[d] · strides[d]`, where `index` is
/// `i` unravelled over `shape[..rank]`. Dimensions of size 1 are dropped and neighbours that
/// are contiguous with each other are merged, so a dense tensor of any shape has rank 1 and the
/// kernel's unravel loop is short.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedLayout {
    /// Dimensions used (at most [`MAX_KERNEL_RANK`]).
    pub rank: u32,
    padding: u32,
    /// Offset of the first element, in elements.
    pub offset: u64,
    /// Sizes; entries past `rank` are 1.
    pub shape: [u64; MAX_KERNEL_RANK],
    /// Strides in elements; entries past `rank` are 0.
    pub strides: [u64; MAX_KERNEL_RANK],
}

impl StridedLayout {
    /// The kernel form of `layout`; errors naming `op` when more than [`MAX_KERNEL_RANK`]
    /// dimensions remain after merging.
    pub fn new(op: &'static str, layout: &Layout) -> Result<Self> {
        let mut dims: Vec<(u64, u64)> = Vec::with_capacity(layout.rank());
        if layout.numel() == 0 {
            dims.push((0, 1));
        } else {
            for (&size, &stride) in layout.shape().iter().zip(layout.strides()) {
                if size == 1 {
                    continue;
                }
                let (size, stride) = (size as u64, stride as u64);
                match dims.last_mut() {
                    // The outer dimension steps exactly over the inner one: one dimension.
                    Some(outer) if outer.1 == stride * size => *outer = (outer.0 * size, stride),
                    _ => dims.push((size, stride)),
                }
            }
        }
        if dims.len() > MAX_KERNEL_RANK {
            return Err(Error::invalid(
                op,
                format!(
                    "layout with shape {:?} and strides {:?} needs {} dimensions in a kernel; \
                     at most {MAX_KERNEL_RANK} are supported (make the tensor contiguous first)",
                    layout.shape().as_slice(),
                    layout.strides().as_slice(),
                    dims.len()
                ),
            ));
        }
        let mut out = StridedLayout {
            rank: dims.len() as u32,
            padding: 0,
            offset: layout.offset() as u64,
            shape: [1; MAX_KERNEL_RANK],
            strides: [0; MAX_KERNEL_RANK],
        };
        for (d, (size, stride)) in dims.into_iter().enumerate() {
            out.shape[d] = size;
            out.strides[d] = stride;
        }
        Ok(out)
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape[..self.rank as usize].iter().product()
    }

    /// Whether the elements are dense and in row-major order.
    pub fn is_contiguous(&self) -> bool {
        self.rank == 0 || (self.rank == 1 && self.strides[0] == 1) || self.numel() == 0
    }

    /// The storage index of the `i`-th element in row-major order (what the kernels compute).
    pub fn storage_index(&self, mut i: u64) -> u64 {
        let mut index = self.offset;
        for d in (0..self.rank as usize).rev() {
            index += (i % self.shape[d]) * self.strides[d];
            i /= self.shape[d];
        }
        index
    }
}

/// A plain-data type that may be passed to a kernel by value as its bytes.
///
/// # Safety
/// The type must be `#[repr(C)]` with the same layout as the CUDA C struct it stands for, have
/// no padding bytes that are read as values, and hold no pointers into host memory.
pub unsafe trait KernelPod: Copy + 'static {}

// SAFETY: repr(C), all fields are integers, the padding field is explicit; matches
// `tandem_layout` in tandem.cuh.
unsafe impl KernelPod for StridedLayout {}

/// One kernel argument, by value, as `cuLaunchKernel` copies it into the kernel's parameters.
///
/// A device pointer is declared by what the kernel does with it, [`KernelArg::In`] or
/// [`KernelArg::Out`], and the stream sanitizer trusts that declaration. The host harness
/// (`tandem-cuda-harness`) checks it against the kernel's signature at every launch it runs: `In`
/// for each `const T*` parameter, `Out` for each `T*`, a value of the parameter's size for the
/// rest. Buffers a kernel reaches through addresses stored elsewhere (inside a [`KernelArg::Pod`]
/// or a table in device memory) are not covered by the declarations.
#[derive(Clone, Debug, PartialEq)]
pub enum KernelArg {
    /// A device pointer the kernel only reads (`const T*` in the kernel).
    In(u64),
    /// A device pointer the kernel writes, and may also read (`T*` in the kernel).
    Out(u64),
    /// `int`.
    I32(i32),
    /// `unsigned int`.
    U32(u32),
    /// `long long` (`tandem_i64`).
    I64(i64),
    /// `unsigned long long` (`tandem_u64`).
    U64(u64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
    /// `unsigned short` or a 16-bit float (`tandem_f16`, `tandem_bf16`), as its bits.
    U16(u16),
    /// `unsigned char` (`tandem_u8`).
    U8(u8),
    /// A plain-data struct passed by value (see [`KernelArg::pod`]).
    Pod(PodBytes),
}

/// The bytes of a struct argument, kept 8-byte aligned so that the kernel (or the host harness)
/// may read them as the struct.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodBytes {
    words: Box<[u64]>,
    len: usize,
    reaches: Vec<Reach>,
}

/// Device memory a struct argument points at, and what the kernel does there: the declaration
/// [`KernelArg::In`] and [`KernelArg::Out`] make for plain pointers, for an address inside a
/// struct (see [`KernelArg::pod_reaching`]). The stream sanitizer reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// The kernel only reads there.
    In(u64),
    /// The kernel writes there, and may also read.
    Out(u64),
}

impl PodBytes {
    /// The device memory the struct points at (addresses of 0, "absent", are left out).
    pub fn reaches(&self) -> &[Reach] {
        &self.reaches
    }
}

impl KernelArg {
    /// A struct argument: a copy of `value`'s bytes. Its alignment must be at most 8.
    pub fn pod<T: KernelPod>(value: &T) -> KernelArg {
        const {
            assert!(
                std::mem::align_of::<T>() <= 8,
                "kernel structs are at most 8-aligned"
            )
        };
        let len = std::mem::size_of::<T>();
        let mut words = vec![0u64; len.div_ceil(8)].into_boxed_slice();
        // SAFETY: `words` holds at least `len` bytes; T is plain data (KernelPod), so reading
        // its bytes is valid; the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (value as *const T).cast::<u8>(),
                words.as_mut_ptr().cast::<u8>(),
                len,
            );
        }
        KernelArg::Pod(PodBytes {
            words,
            len,
            reaches: Vec::new(),
        })
    }

    /// A struct argument holding device addresses: [`KernelArg::pod`], declaring what the kernel
    /// does at each address (`reaches`; a null address is left out).
    pub fn pod_reaching<T: KernelPod>(value: &T, reaches: &[Reach]) -> KernelArg {
        let mut arg = KernelArg::pod(value);
        if let KernelArg::Pod(bytes) = &mut arg {
            bytes.reaches = reaches
                .iter()
                .copied()
                .filter(|r| !matches!(r, Reach::In(0) | Reach::Out(0)))
                .collect();
        }
        arg
    }

    /// Size of the argument in bytes, as the kernel sees it.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            KernelArg::In(_)
            | KernelArg::Out(_)
            | KernelArg::I64(_)
            | KernelArg::U64(_)
            | KernelArg::F64(_) => 8,
            KernelArg::I32(_) | KernelArg::U32(_) | KernelArg::F32(_) => 4,
            KernelArg::U16(_) => 2,
            KernelArg::U8(_) => 1,
            KernelArg::Pod(p) => p.len,
        }
    }

    /// Address of the value (what `cuLaunchKernel`'s `kernelParams[i]` points at).
    fn address(&self) -> *mut c_void {
        let p: *const c_void = match self {
            KernelArg::In(v) | KernelArg::Out(v) | KernelArg::U64(v) => (v as *const u64).cast(),
            KernelArg::I32(v) => (v as *const i32).cast(),
            KernelArg::U32(v) => (v as *const u32).cast(),
            KernelArg::I64(v) => (v as *const i64).cast(),
            KernelArg::F32(v) => (v as *const f32).cast(),
            KernelArg::F64(v) => (v as *const f64).cast(),
            KernelArg::U16(v) => (v as *const u16).cast(),
            KernelArg::U8(v) => (v as *const u8).cast(),
            KernelArg::Pod(p) => p.words.as_ptr().cast(),
        };
        // The launcher only reads through these pointers; `*mut` is the C API's type.
        p.cast_mut()
    }
}

/// One kernel launch, as data: the plan an op computes and a device or the host harness runs.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The source file that defines the kernel.
    pub source: &'static KernelSource,
    /// The kernel's `extern "C"` name (`fill_f32`).
    pub kernel: String,
    /// Grid, block and dynamic shared memory.
    pub config: LaunchConfig,
    /// The arguments, in the kernel's parameter order.
    pub args: Vec<KernelArg>,
}

impl Launch {
    /// The argument array in the form `cuLaunchKernel` takes (`void** kernelParams`): one
    /// pointer per argument, to its value. Valid while `self` is borrowed.
    pub fn params(&self) -> KernelParams<'_> {
        KernelParams {
            pointers: self.args.iter().map(KernelArg::address).collect(),
            _launch: PhantomData,
        }
    }
}

/// The `void**` argument array of a [`Launch`], borrowing it.
#[derive(Debug)]
pub struct KernelParams<'a> {
    pointers: Vec<*mut c_void>,
    _launch: PhantomData<&'a Launch>,
}

impl KernelParams<'_> {
    /// The array, for `cuLaunchKernel`'s `kernelParams`. The callee only reads through it.
    pub fn as_mut_ptr(&mut self) -> *mut *mut c_void {
        self.pointers.as_mut_ptr()
    }

    /// The array as a slice, for `cudarc::driver::result::launch_kernel`.
    pub fn as_mut_slice(&mut self) -> &mut [*mut c_void] {
        &mut self.pointers
    }

    /// Number of arguments.
    pub fn len(&self) -> usize {
        self.pointers.len()
    }

    /// Whether the kernel takes no arguments.
    pub fn is_empty(&self) -> bool {
        self.pointers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::contiguous_strides;
    use crate::Shape;

    fn layout(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        Layout::from_parts(Shape::from_slice(shape), strides.into(), offset)
    }

    #[test]
    fn for_elements_covers_n_with_a_capped_grid() {
        let c = LaunchConfig::for_elements("t", 1000, 256).unwrap();
        assert_eq!((c.grid, c.block), ([4, 1, 1], [256, 1, 1]));
        let c = LaunchConfig::for_elements("t", 0, 256).unwrap();
        assert_eq!(c.grid, [1, 1, 1], "an empty launch still has one block");
        let c = LaunchConfig::for_elements("t", 1 << 40, 256).unwrap();
        assert_eq!(c.grid[0], GRID_STRIDE_MAX_BLOCKS);
    }

    #[test]
    fn block_sizes_must_be_whole_warps() {
        for bad in [0, 31, 100, 2048] {
            let err = LaunchConfig::for_elements("fill_", 10, bad)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("fill_") && err.contains("multiple of 32"),
                "{err}"
            );
        }
    }

    #[test]
    fn explicit_configurations_are_checked_against_device_limits() {
        assert!(LaunchConfig::new("t", [1, 1, 1], [32, 32, 1], 0).is_ok());
        assert!(LaunchConfig::new("t", [1, 1, 1], [32, 33, 1], 0).is_err());
        assert!(LaunchConfig::new("t", [1, 65_536, 1], [32, 1, 1], 0).is_err());
        assert!(LaunchConfig::new("t", [0, 1, 1], [32, 1, 1], 0).is_err());
        assert!(LaunchConfig::new("t", [1, 1, 1], [1, 1, 65], 0).is_err());
        let err = LaunchConfig::new("t", [1, 1, 1], [32, 1, 1], 64 * 1024).unwrap_err();
        assert!(err.to_string().contains("shared memory"), "{err}");
    }

    #[test]
    fn thirty_two_bit_indices_are_checked() {
        assert_eq!(index_u32("t", "n", 5).unwrap(), 5);
        let err = index_u32("softmax", "row length", 1 << 31)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("softmax") && err.contains("row length"),
            "{err}"
        );
    }

    #[test]
    fn contiguous_layouts_collapse_to_one_dimension() {
        let l = StridedLayout::new("t", &Layout::contiguous(&[2, 3, 4])).unwrap();
        assert_eq!((l.rank, l.shape[0], l.strides[0]), (1, 24, 1));
        assert!(l.is_contiguous());
        let scalar = StridedLayout::new("t", &Layout::contiguous(&[])).unwrap();
        assert_eq!((scalar.rank, scalar.numel()), (0, 1));
        let empty = StridedLayout::new("t", &Layout::contiguous(&[3, 0, 2])).unwrap();
        assert_eq!(empty.numel(), 0);
    }

    #[test]
    fn strided_layouts_map_indices_like_the_cpu_layout() {
        // A transposed [3, 4] matrix narrowed to columns 1..3, and an expanded row.
        let base = Layout::contiguous(&[4, 3]);
        let t = base.transpose("t", 0, 1).unwrap();
        let n = t.narrow("t", 1, 1, 2).unwrap();
        let e = layout(&[5, 1, 3], &[0, 0, 1], 2);
        for l in [t, n, e, Layout::contiguous(&[2, 1, 3])] {
            let k = StridedLayout::new("t", &l).unwrap();
            let mut want = Vec::new();
            l.for_each_index(|i| want.push(i as u64));
            let got: Vec<u64> = (0..k.numel()).map(|i| k.storage_index(i)).collect();
            assert_eq!(got, want, "{l:?}");
        }
    }

    #[test]
    fn too_many_dimensions_is_an_error() {
        // The first two of three along each of 9 dimensions: nothing merges.
        let shape = [2usize; 9];
        let strides = contiguous_strides(&[3; 9]);
        let err = StridedLayout::new("copy_", &layout(&shape, &strides, 0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("copy_") && err.contains("at most 8"), "{err}");
    }

    #[test]
    fn params_point_at_each_argument_value() {
        static SRC: KernelSource = KernelSource {
            name: "t",
            source: "",
            headers: &[],
        };
        let layout = StridedLayout::new("t", &Layout::contiguous(&[7])).unwrap();
        let launch = Launch {
            source: &SRC,
            kernel: "k".into(),
            config: LaunchConfig::for_elements("t", 7, 32).unwrap(),
            args: vec![
                KernelArg::In(0xdead_beef),
                KernelArg::F32(1.5),
                KernelArg::U16(0x3c00),
                KernelArg::pod(&layout),
            ],
        };
        let mut params = launch.params();
        assert_eq!(params.len(), 4);
        let p = params.as_mut_ptr();
        // SAFETY: each pointer points at a live value of the stated type inside `launch`.
        unsafe {
            assert_eq!(*(*p.add(0)).cast::<u64>(), 0xdead_beef);
            assert_eq!(*(*p.add(1)).cast::<f32>(), 1.5);
            assert_eq!(*(*p.add(2)).cast::<u16>(), 0x3c00);
            assert_eq!(*(*p.add(3)).cast::<StridedLayout>(), layout);
        }
        assert_eq!(
            launch.args[3].size_in_bytes(),
            std::mem::size_of::<StridedLayout>()
        );
    }
}
