//! How a tensor's elements sit in its storage: a shape, strides (in elements) and an offset.
//!
//! Views — reshape, transpose, permute, narrow, expand, squeeze, unsqueeze — only compute a new
//! `Layout` over the same storage. Invariants: `shape` and `strides` have the same length, and
//! every index inside `shape` maps to `offset + Σ index[d]·strides[d]`, which lies inside the
//! storage. A stride of 0 repeats an element (broadcasting).

use smallvec::SmallVec;

use crate::error::fmt_shape;
use crate::{Error, Result};

/// A tensor shape; small ranks never allocate.
pub type Shape = SmallVec<[usize; 6]>;

/// Strides in elements, one per dimension.
pub type Strides = SmallVec<[usize; 6]>;

/// Builds a `Shape` from a slice.
pub fn shape(dims: &[usize]) -> Shape {
    Shape::from_slice(dims)
}

/// Row-major strides for a shape.
pub fn contiguous_strides(shape: &[usize]) -> Strides {
    let mut strides: Strides = SmallVec::from_elem(0, shape.len());
    let mut acc = 1;
    for d in (0..shape.len()).rev() {
        strides[d] = acc;
        acc *= shape[d].max(1);
    }
    strides
}

/// The shape that two shapes broadcast to under NumPy rules (align right; 1 stretches).
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Shape> {
    let rank = a.len().max(b.len());
    let mut out: Shape = SmallVec::from_elem(0, rank);
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(Error::shape(
                op,
                format!(
                    "cannot broadcast {:?} with {:?} (dim {i}: {da} vs {db})",
                    a, b
                ),
            ));
        };
    }
    checked_numel(op, &out)?;
    Ok(out)
}

/// The most elements a tensor may have: its bytes (at most 8 per element) must fit in an
/// `isize`, as Rust's allocations and CUDA's 64-bit indices require.
pub const MAX_NUMEL: usize = (isize::MAX as usize) / 8;

/// The number of elements of `shape`, or an error naming `op` when the product overflows or
/// exceeds [`MAX_NUMEL`] (no tensor of that shape could ever be allocated).
pub fn checked_numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= MAX_NUMEL)
        .ok_or_else(|| {
            Error::shape(
                op,
                format!(
                    "shape {shape:?} has more elements than any tensor can hold (at most {MAX_NUMEL})"
                ),
            )
        })
}

/// Resolves a possibly negative dim against a rank.
pub fn normalize_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    // A scalar accepts dim 0 and -1, as in PyTorch.
    let r = rank.max(1) as isize;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r {
        return Err(Error::invalid(
            op,
            format!("dim {dim} is out of range for a tensor of rank {rank}"),
        ));
    }
    Ok(d as usize)
}

/// Shape, strides and offset of a tensor within its storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Strides,
    offset: usize,
}

impl Layout {
    /// The row-major layout of a fresh tensor of this shape.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: Shape::from_slice(shape),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A layout from explicit parts. The caller guarantees the invariants above.
    pub fn from_parts(shape: Shape, strides: Strides, offset: usize) -> Self {
        debug_assert_eq!(shape.len(), strides.len());
        Layout {
            shape,
            strides,
            offset,
        }
    }

    /// The dimensions.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The strides in elements.
    pub fn strides(&self) -> &Strides {
        &self.strides
    }

    /// Offset of the first element in the storage, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are dense and in row-major order.
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut acc = 1;
        for d in (0..self.shape.len()).rev() {
            if self.shape[d] != 1 && self.strides[d] != acc {
                return false;
            }
            acc *= self.shape[d];
        }
        true
    }

    /// One past the largest storage index this layout touches (0 for an empty tensor).
    pub fn storage_extent(&self) -> usize {
        if self.numel() == 0 {
            return self.offset;
        }
        // Saturating: a layout reaching past the address space is caught by the caller's
        // comparison with the storage length instead of wrapping around.
        self.shape
            .iter()
            .zip(&self.strides)
            .fold(self.offset, |acc, (&n, &s)| {
                acc.saturating_add((n - 1).saturating_mul(s))
            })
            .saturating_add(1)
    }

    /// A view with a new shape of the same element count. Works without a copy when the
    /// layout is contiguous; otherwise returns `None` and the caller must copy first.
    pub fn reshape(&self, new_shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() {
            Some(Layout {
                shape: Shape::from_slice(new_shape),
                strides: contiguous_strides(new_shape),
                offset: self.offset,
            })
        } else {
            None
        }
    }

    /// Resolves `-1` in a requested shape and checks the element count.
    pub fn infer_shape(&self, op: &'static str, requested: &[isize]) -> Result<Shape> {
        let numel = self.numel();
        let mut infer_at = None;
        let mut known = 1usize;
        let mut out: Shape = SmallVec::with_capacity(requested.len());
        for (i, &d) in requested.iter().enumerate() {
            if d == -1 {
                if infer_at.replace(i).is_some() {
                    return Err(Error::shape(
                        op,
                        format!("only one -1 is allowed in {requested:?}"),
                    ));
                }
                out.push(1);
            } else if d < 0 {
                return Err(Error::shape(op, format!("negative size in {requested:?}")));
            } else {
                known = known.checked_mul(d as usize).ok_or_else(|| {
                    Error::shape(op, format!("the element count of {requested:?} overflows"))
                })?;
                out.push(d as usize);
            }
        }
        if let Some(i) = infer_at {
            if known == 0 || !numel.is_multiple_of(known) {
                return Err(Error::shape(
                    op,
                    format!("cannot view {} as {requested:?}", fmt_shape(&self.shape)),
                ));
            }
            out[i] = numel / known;
        }
        if out.iter().product::<usize>() != numel {
            return Err(Error::shape(
                op,
                format!(
                    "cannot view {} ({numel} elements) as {requested:?}",
                    fmt_shape(&self.shape)
                ),
            ));
        }
        Ok(out)
    }

    /// Dimensions reordered by `perm` (a permutation of `0..rank`).
    pub fn permute(&self, op: &'static str, perm: &[usize]) -> Result<Layout> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank
            || perm
                .iter()
                .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
        {
            return Err(Error::invalid(
                op,
                format!("{perm:?} is not a permutation of the {rank} dims"),
            ));
        }
        Ok(Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    /// Swaps two dims.
    pub fn transpose(&self, op: &'static str, a: usize, b: usize) -> Result<Layout> {
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        if a >= perm.len() || b >= perm.len() {
            return Err(Error::invalid(
                op,
                format!("dims ({a}, {b}) out of range for rank {}", self.rank()),
            ));
        }
        perm.swap(a, b);
        self.permute(op, &perm)
    }

    /// Elements `start..start+len` along `dim`.
    pub fn narrow(&self, op: &'static str, dim: usize, start: usize, len: usize) -> Result<Layout> {
        if dim >= self.rank()
            || start
                .checked_add(len)
                .is_none_or(|end| end > self.shape[dim])
        {
            return Err(Error::invalid(
                op,
                format!(
                    "range {start}..{} of dim {dim} is outside shape {}",
                    start.saturating_add(len),
                    fmt_shape(&self.shape)
                ),
            ));
        }
        let mut out = self.clone();
        out.offset += start * self.strides[dim];
        out.shape[dim] = len;
        Ok(out)
    }

    /// A broadcast view to `target` (dims of size 1, or missing leading dims, get stride 0).
    pub fn expand(&self, op: &'static str, target: &[usize]) -> Result<Layout> {
        if target.len() < self.rank() {
            return Err(Error::shape(
                op,
                format!(
                    "cannot expand {} to fewer dims {:?}",
                    fmt_shape(&self.shape),
                    target
                ),
            ));
        }
        let lead = target.len() - self.rank();
        let mut strides: Strides = SmallVec::from_elem(0, target.len());
        for (i, &t) in target.iter().enumerate() {
            if i < lead {
                continue;
            }
            let (s, st) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = if s == t {
                st
            } else if s == 1 {
                0
            } else {
                return Err(Error::shape(
                    op,
                    format!(
                        "cannot expand {} to {:?} (dim {i}: {s} vs {t})",
                        fmt_shape(&self.shape),
                        target
                    ),
                ));
            };
        }
        checked_numel(op, target)?;
        Ok(Layout {
            shape: Shape::from_slice(target),
            strides,
            offset: self.offset,
        })
    }

    /// Removes a dim of size 1.
    pub fn squeeze(&self, op: &'static str, dim: usize) -> Result<Layout> {
        if dim >= self.rank() || self.shape[dim] != 1 {
            return Err(Error::invalid(
                op,
                format!(
                    "dim {dim} of shape {} is not of size 1",
                    fmt_shape(&self.shape)
                ),
            ));
        }
        let mut out = self.clone();
        out.shape.remove(dim);
        out.strides.remove(dim);
        Ok(out)
    }

    /// Inserts a dim of size 1 at `dim` (0..=rank).
    pub fn unsqueeze(&self, op: &'static str, dim: usize) -> Result<Layout> {
        if dim > self.rank() {
            return Err(Error::invalid(
                op,
                format!("dim {dim} out of range for rank {}", self.rank()),
            ));
        }
        let mut out = self.clone();
        let stride = if dim < self.rank() {
            self.strides[dim] * self.shape[dim]
        } else {
            1
        };
        out.shape.insert(dim, 1);
        out.strides.insert(dim, stride);
        Ok(out)
    }

    /// Calls `f` with the storage index of every element in row-major order.
    pub fn for_each_index(&self, mut f: impl FnMut(usize)) {
        let n = self.numel();
        if n == 0 {
            return;
        }
        if self.is_contiguous() {
            (self.offset..self.offset + n).for_each(f);
            return;
        }
        let row_len = self.shape.last().copied().unwrap_or(1);
        self.for_each_row(|start, stride| (0..row_len).for_each(|j| f(start + j * stride)));
    }

    /// Calls `f(start, stride)` for every innermost row in row-major order: the row's elements
    /// are at `start + j · stride` for `j` in `0..row_len`, where `row_len` (returned) is the
    /// innermost extent. A rank-0 layout is one row of one element.
    pub fn for_each_row(&self, mut f: impl FnMut(usize, usize)) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        let rank = self.rank();
        if rank == 0 {
            f(self.offset, 1);
            return 1;
        }
        let (len, stride) = (self.shape[rank - 1], self.strides[rank - 1]);
        let outer = &self.shape[..rank - 1];
        let mut idx: SmallVec<[usize; 6]> = SmallVec::from_elem(0, rank - 1);
        let mut pos = self.offset;
        let rows: usize = outer.iter().product();
        for _ in 0..rows {
            f(pos, stride);
            for d in (0..rank - 1).rev() {
                idx[d] += 1;
                pos += self.strides[d];
                if idx[d] < outer[d] {
                    break;
                }
                pos -= self.strides[d] * outer[d];
                idx[d] = 0;
            }
        }
        len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_a_transposed_layout_visit_every_element_in_row_major_order() {
        let l = Layout::contiguous(&[2, 3, 4])
            .permute("p", &[2, 0, 1])
            .unwrap();
        let mut by_rows = vec![];
        let mut starts = vec![];
        let len = l.for_each_row(|start, stride| starts.push((start, stride)));
        for (start, stride) in starts {
            by_rows.extend((0..len).map(|j| start + j * stride));
        }
        let mut by_elements = vec![];
        l.for_each_index(|i| by_elements.push(i));
        assert_eq!(by_rows, by_elements);
        assert_eq!(
            Layout::contiguous(&[]).for_each_row(|s, _| assert_eq!(s, 0)),
            1
        );
        assert_eq!(
            Layout::contiguous(&[3, 0]).for_each_row(|_, _| panic!("empty")),
            0
        );
    }

    #[test]
    fn transpose_then_iterate_visits_column_major() {
        let l = Layout::contiguous(&[2, 3]).transpose("t", 0, 1).unwrap();
        let mut seen = vec![];
        l.for_each_index(|i| seen.push(i));
        assert_eq!(seen, vec![0, 3, 1, 4, 2, 5]);
        assert!(!l.is_contiguous());
    }

    #[test]
    fn expand_uses_zero_strides() {
        let l = Layout::contiguous(&[3, 1]).expand("e", &[2, 3, 4]).unwrap();
        assert_eq!(l.strides().as_slice(), &[0, 1, 0]);
        assert!(Layout::contiguous(&[3, 2]).expand("e", &[3, 4]).is_err());
    }

    #[test]
    fn broadcast_shapes_follow_numpy() {
        assert_eq!(
            broadcast_shapes("b", &[4, 1, 3], &[5, 1])
                .unwrap()
                .as_slice(),
            &[4, 5, 3]
        );
        assert!(broadcast_shapes("b", &[2, 3], &[4, 3]).is_err());
    }

    #[test]
    fn narrow_and_unsqueeze() {
        let l = Layout::contiguous(&[4, 5]).narrow("n", 1, 2, 2).unwrap();
        assert_eq!(l.offset(), 2);
        let u = l.unsqueeze("u", 0).unwrap();
        assert_eq!(u.shape().as_slice(), &[1, 4, 2]);
        assert_eq!(u.squeeze("s", 0).unwrap(), l);
    }

    #[test]
    fn infer_shape_resolves_minus_one() {
        let l = Layout::contiguous(&[4, 6]);
        assert_eq!(l.infer_shape("v", &[-1, 3]).unwrap().as_slice(), &[8, 3]);
        assert!(l.infer_shape("v", &[5, -1]).is_err());
    }
}
