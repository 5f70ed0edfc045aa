//! The batched product of BF16 operands on the CPU by the bf16 GEMM (`cpu::gemm_bf16`): every
//! batch entry's product accumulates in f32 (entries that map to the same output entry, as in
//! a broadcast operand's gradient, add there in f32 too), and the result is rounded once.

use tandem_core::half::bf16;
use tandem_core::{checked_numel, DType, Result, Tensor};

use crate::cpu::gemm::MatRef;
use crate::cpu::gemm_bf16::{gemm_bf16, Bf16Mat, Path};
use crate::cpu::memory::{self, host_slice};
use crate::matmul::shape::batch_strides;

/// An operand's matrix of batch entry 0 and the stride of each full batch dim (0 where it is
/// broadcast).
fn operand(t: &Tensor, batch: &[usize], trans: bool) -> (MatRef, Vec<usize>) {
    let (rank, st) = (t.rank(), t.layout().strides());
    let mat = MatRef {
        offset: t.layout().offset(),
        rs: st[rank - 2],
        cs: st[rank - 1],
    };
    (if trans { mat.t() } else { mat }, batch_strides(t, batch))
}

/// [`super::batched_product`] for BF16 operands (and bias): the same shapes and
/// semantics, the result in BF16; `None` when an operand is not BF16 (the caller then takes
/// the path through f32).
#[allow(clippy::too_many_arguments)]
pub(crate) fn batched_product(
    op: &'static str,
    x: &Tensor,
    tx: bool,
    y: &Tensor,
    ty: bool,
    batch: &[usize],
    out_batch: &[usize],
    bias: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    if [x, y]
        .into_iter()
        .chain(bias)
        .any(|t| t.dtype() != DType::BF16)
    {
        return Ok(None);
    }
    let (xd, yd) = (x.dims(), y.dims());
    let (m, k) = match tx {
        true => (xd[xd.len() - 1], xd[xd.len() - 2]),
        false => (xd[xd.len() - 2], xd[xd.len() - 1]),
    };
    let n = if ty {
        yd[yd.len() - 2]
    } else {
        yd[yd.len() - 1]
    };
    let mut shape = out_batch.to_vec();
    shape.extend([m, n]);
    let numel = checked_numel(op, &shape)?;
    let mut acc = memory::zeroed::<f32>(op, numel)?;
    if let Some(b) = bias {
        let b: Vec<f32> = memory::gather::<bf16>(op, b)?
            .iter()
            .map(|v| v.to_f32())
            .collect();
        acc.chunks_mut(n.max(1))
            .for_each(|row| row.copy_from_slice(&b));
    }
    let gx = x.storage().read_host(op)?;
    // One read lock where both operands share a buffer (a second read of the same lock could
    // wait behind a writer queued in between).
    let gy_own;
    let ys: &[bf16] = if y.storage().same_buffer(x.storage()) {
        host_slice::<bf16>(op, &gx)?
    } else {
        gy_own = y.storage().read_host(op)?;
        host_slice::<bf16>(op, &gy_own)?
    };
    let xs = host_slice::<bf16>(op, &gx)?;
    let ((xm, xb), (ym, yb)) = (operand(x, batch, tx), operand(y, batch, ty));
    let count: usize = batch.iter().product();
    let path = Path::detect();
    let mut index = vec![0usize; batch.len()];
    for e in 0..count {
        // The batch index of entry `e`, and the output entry it adds to (0 along the dims
        // `out_batch` broadcasts).
        let mut rest = e;
        for d in (0..batch.len()).rev() {
            index[d] = rest % batch[d];
            rest /= batch[d];
        }
        let lead = batch.len() - out_batch.len();
        let out_entry = out_batch.iter().enumerate().fold(0, |at, (d, &size)| {
            at * size + if size == 1 { 0 } else { index[lead + d] }
        });
        let shift = |mat: MatRef, strides: &[usize]| MatRef {
            offset: mat.offset + index.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>(),
            ..mat
        };
        let a = Bf16Mat {
            data: xs,
            at: shift(xm, &xb),
        };
        let b = Bf16Mat {
            data: ys,
            at: shift(ym, &yb),
        };
        let dst = &mut acc[out_entry * m * n..][..m * n];
        gemm_bf16(path, (m, n, k), a, b, dst, n.max(1), true, true);
    }
    let out: Vec<bf16> = acc.iter().map(|&v| bf16::from_f32(v)).collect();
    Tensor::from_vec(out, &shape, x.device()).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::Device;

    fn tensor(shape: &[usize], seed: u32) -> Tensor {
        let numel: usize = shape.iter().product();
        let v: Vec<f32> = (0..numel as u32)
            .map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 20) as f32 / 2048.0) - 1.0)
            .collect();
        let t = Tensor::from_vec(v, shape, Device::Cpu).unwrap();
        t.to_dtype(DType::BF16).unwrap()
    }

    /// Each case against the f32 product of the same values rounded once to bf16: equal up to
    /// one bf16 rounding step (the f32 sums may differ in their last bits).
    #[test]
    fn bf16_product_matches_the_f32_product_rounded_once() {
        // (x shape, tx, y shape, ty, batch, out batch, bias)
        type Case = (
            Vec<usize>,
            bool,
            Vec<usize>,
            bool,
            Vec<usize>,
            Vec<usize>,
            bool,
        );
        let cases: Vec<Case> = vec![
            (vec![5, 7], false, vec![7, 3], false, vec![], vec![], false),
            (
                vec![37, 65],
                false,
                vec![40, 65],
                true,
                vec![],
                vec![],
                true,
            ),
            (
                vec![2, 65, 9],
                true,
                vec![65, 33],
                false,
                vec![2],
                vec![2],
                false,
            ),
            (
                vec![3, 4, 6],
                false,
                vec![3, 6, 5],
                false,
                vec![3],
                vec![1],
                false,
            ),
            (
                vec![2, 3, 4, 6],
                false,
                vec![6, 5],
                false,
                vec![2, 3],
                vec![3],
                true,
            ),
        ];
        for (xs, tx, ys, ty, batch, out_batch, with_bias) in cases {
            let (x, y) = (tensor(&xs, 1), tensor(&ys, 2));
            let n = if ty {
                ys[ys.len() - 2]
            } else {
                ys[ys.len() - 1]
            };
            let bias = with_bias.then(|| tensor(&[n], 3));
            let got = batched_product("t", &x, tx, &y, ty, &batch, &out_batch, bias.as_ref())
                .unwrap()
                .unwrap();
            assert_eq!(got.dtype(), DType::BF16);
            let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let b32 = bias.as_ref().map(wide);
            let want = super::super::batched_product(
                "t",
                &wide(&x),
                tx,
                &wide(&y),
                ty,
                &batch,
                &out_batch,
                b32.as_ref(),
            )
            .unwrap();
            assert_eq!(got.dims(), want.dims());
            let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
            for (i, (g, w)) in g.iter().zip(&w).enumerate() {
                assert!(
                    (g - w).abs() <= w.abs() / 128.0 + 1e-3,
                    "{xs:?}·{ys:?} [{i}]: {g} vs {w}"
                );
            }
        }
        let (x, y) = (
            tensor(&[2, 3], 1),
            tensor(&[3, 2], 2).to_dtype(DType::F32).unwrap(),
        );
        assert!(batched_product("t", &x, false, &y, false, &[], &[], None)
            .unwrap()
            .is_none());
    }
}
