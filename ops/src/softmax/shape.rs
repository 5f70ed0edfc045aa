//! The device-neutral view of a softmax's input, shared by the CPU and CUDA kernels.

/// The split of a contiguous tensor around the softmax dim.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Split {
    /// Product of the dims before the softmax dim.
    pub outer: usize,
    /// Size of the softmax dim.
    pub n: usize,
    /// Product of the dims after the softmax dim.
    pub inner: usize,
}

impl Split {
    /// The split of `dims` around `dim`.
    pub(crate) fn around(dims: &[usize], dim: usize) -> Self {
        Split {
            outer: dims[..dim].iter().product(),
            n: dims[dim],
            inner: dims[dim + 1..].iter().product(),
        }
    }
}
