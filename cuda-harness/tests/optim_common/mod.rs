//! Shared by the optimizer kernel tests (`optim_*.rs`): the tensor sizes every multi-tensor
//! kernel runs over, the chunkings and grids, and tensors in guarded host buffers.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::Rng;
use tandem_core::cuda::launch::Launch;
use tandem_core::{Device, Element, Layout, Tensor};

use super::common::{assert_same, small_grid, HostBuffer};

/// Tensor sizes of one table: odd, one element, empty, below and above a warp, a block and
/// the small chunk sizes below, and in an order that is not sorted.
pub const SIZES: [usize; 8] = [37, 0, 1, 100, 257, 31, 1000, 64];

/// How a table is cut and launched: elements per chunk, and whether the grid is shrunk to two
/// one-warp blocks (so blocks loop over chunks and threads over a chunk's elements).
#[derive(Clone, Copy, Debug)]
pub struct Cut {
    pub chunk: u64,
    pub small_grid: bool,
}

/// The production chunk size (every tensor here is one chunk), a chunk size that is a power of
/// two but smaller than several tensors, one that is not (chunks end mid-warp), each with the
/// planned grid; and a small chunk with a shrunk grid.
pub fn cuts() -> Vec<Cut> {
    let c = |chunk, small_grid| Cut { chunk, small_grid };
    vec![
        c(tandem_optim::multi_tensor::CHUNK_ELEMENTS, false),
        c(64, false),
        c(100, false),
        c(50, true),
        c(tandem_optim::multi_tensor::CHUNK_ELEMENTS, true),
    ]
}

/// Three of [`cuts`] (one chunk per tensor, chunks ending mid-warp, blocks looping over
/// chunks), for tests with many cases: the emulation's cost is in its threads.
pub fn few_cuts() -> Vec<Cut> {
    let c = |chunk, small_grid| Cut { chunk, small_grid };
    vec![
        c(tandem_optim::multi_tensor::CHUNK_ELEMENTS, false),
        c(100, false),
        c(50, true),
    ]
}

/// Runs `launch` as `cut` says; a failure names the case.
pub fn run_cut(launch: &Launch, cut: Cut, what: &str) {
    let launch = if cut.small_grid {
        small_grid(launch)
    } else {
        launch.clone()
    };
    // SAFETY: every pointer in the launch's table points into a live HostBuffer (or the table
    // itself) covering the entry's elements.
    unsafe { tandem_cuda_harness::run(&launch) }.unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// Values of `n` elements, of magnitudes from 1e-3 to 1e1 and both signs, with a few zeros.
pub fn random<T: Element>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|i| {
            if i % 17 == 5 {
                return T::from_f64(0.0);
            }
            let magnitude = 10f64.powf(rng.gen_range(-3.0..1.0));
            let sign = if rng.gen::<bool>() { 1.0 } else { -1.0 };
            T::from_f64(sign * magnitude)
        })
        .collect()
}

/// A guarded host buffer holding `values`, and the address of its element 0.
pub struct Dense<T: Element> {
    pub buffer: HostBuffer<T>,
    pub len: usize,
}

impl<T: Element> Dense<T> {
    pub fn new(values: &[T]) -> Self {
        Dense {
            buffer: HostBuffer::new(values),
            len: values.len(),
        }
    }

    pub fn address(&mut self) -> u64 {
        let layout = Layout::contiguous(&[self.len]);
        self.buffer.view(&layout).ptr
    }

    /// The elements, after checking that nothing was written around them.
    pub fn values(&self, what: &str) -> &[T] {
        self.buffer.storage(what)
    }

    /// Asserts the elements equal `want` bit for bit.
    pub fn assert_equals(&self, want: &[T], what: &str) {
        assert_same(self.values(what), want, what);
    }
}

/// A CPU parameter (a leaf that requires grad) holding `values`.
pub fn cpu_param<T: Element>(values: &[T]) -> Tensor {
    Tensor::from_vec(values.to_vec(), &[values.len()], Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap()
}

/// Gives `param` the gradient `values`.
pub fn set_cpu_grad<T: Element>(param: &Tensor, values: &[T]) {
    param
        .set_grad(Some(
            Tensor::from_vec(values.to_vec(), &[values.len()], Device::Cpu).unwrap(),
        ))
        .unwrap();
}
