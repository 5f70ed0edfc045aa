//! Helpers shared by the CPU kernels: checks with op-named errors, strided iteration over two
//! operands, and reducing a broadcast gradient back to an input's shape.

use smallvec::SmallVec;
use tandem_core::{DType, Error, Result, Tensor};

/// Checks that two inputs share a dtype and a device.
pub fn same_dtype_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    a.device().same_as(b.device(), op)?;
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// Checks that `t` has a float dtype the kernels compute in (f32 or f64).
pub fn float_dtype(op: &'static str, t: &Tensor) -> Result<DType> {
    match t.dtype() {
        DType::F32 | DType::F64 => Ok(t.dtype()),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: "f32, f64",
        }),
    }
}

/// Checks the rank of an input.
pub fn expect_rank(op: &'static str, what: &str, t: &Tensor, rank: usize) -> Result<()> {
    if t.rank() != rank {
        return Err(Error::shape(
            op,
            format!("{what} must have {rank} dims, got shape {:?}", t.dims()),
        ));
    }
    Ok(())
}

/// Calls `f(i, ia, ib)` for every element `i` (row-major) of `shape`, with the storage index of
/// the matching element of two operands laid out by `(strides, offset)`.
pub fn for_each_index2(
    shape: &[usize],
    (sa, oa): (&[usize], usize),
    (sb, ob): (&[usize], usize),
    mut f: impl FnMut(usize, usize, usize),
) {
    let n: usize = shape.iter().product();
    if n == 0 {
        return;
    }
    let rank = shape.len();
    let mut idx: SmallVec<[usize; 6]> = SmallVec::from_elem(0, rank);
    let (mut pa, mut pb) = (oa, ob);
    for i in 0..n {
        f(i, pa, pb);
        for d in (0..rank).rev() {
            idx[d] += 1;
            pa += sa[d];
            pb += sb[d];
            if idx[d] < shape[d] {
                break;
            }
            pa -= sa[d] * shape[d];
            pb -= sb[d] * shape[d];
            idx[d] = 0;
        }
    }
}

/// The dims of `from` that were broadcast to reach it from `to` (leading dims that `to` lacks,
/// and dims where `to` has size 1), as indices into `from`.
pub fn broadcast_dims(from: &[usize], to: &[usize]) -> Vec<usize> {
    let lead = from.len() - to.len();
    (0..from.len())
        .filter(|&d| d < lead || (to[d - lead] == 1 && from[d] != 1))
        .collect()
}

/// Sums a gradient of the broadcast shape down to `target` (the input's shape).
pub fn sum_to_shape(grad: &Tensor, target: &[usize]) -> Result<Tensor> {
    if grad.dims() == target {
        return Ok(grad.clone());
    }
    let dims: Vec<isize> = broadcast_dims(grad.dims(), target)
        .into_iter()
        .map(|d| d as isize)
        .collect();
    let summed = crate::reduce::sum(grad, &dims, true)?;
    let shape: Vec<isize> = target.iter().map(|&d| d as isize).collect();
    crate::views::reshape(&summed, &shape)
}

/// Below this many elements a kernel runs on one thread: rayon's fork-join costs more.
pub const PARALLEL_THRESHOLD: usize = 1 << 15;

/// Whether a kernel touching `work` elements should split it across the rayon pool: only when
/// the work is large and the pool has more than one thread (with one thread, going through
/// rayon costs two context switches and gains nothing, since the calling thread is usually not
/// a pool worker).
pub fn parallel(work: usize) -> bool {
    work >= PARALLEL_THRESHOLD && rayon::current_num_threads() > 1
}
