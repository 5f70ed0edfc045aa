//! Matrix products with `torch.matmul` semantics: vector·vector, matrix·matrix, and batched
//! products whose batch dims broadcast, through the `gemm` crate on the CPU and cuBLAS on CUDA
//! (`cuda/launch.rs` maps the layouts to cuBLAS calls, `cuda/mod.rs` issues them).
//!
//! Operands are read in place through their strides, so transposed views cost no copy. The
//! backward is two more products, `grad_a = g·bᵀ` and `grad_b = aᵀ·g`, each summed over the
//! batch dims its operand was broadcast along.

mod cpu;
pub mod cuda;
mod low_precision;
mod shape;

use tandem_autograd::record_fn;
use tandem_core::{broadcast_shapes, Device, Error, Result, Tensor};

use crate::autocast::{self, is_low, matrix_dtype};
use crate::checks::same_dtype_device;
use crate::views::{squeeze, unsqueeze};

/// Matrix product of `a` and `b`, like `torch.matmul`.
///
/// # Shapes
/// - `[k]·[k]` → `[]` (dot product);
/// - `[m, k]·[k, n]` → `[m, n]`;
/// - `[k]·[.., k, n]` → `[.., n]` and `[.., m, k]·[k]` → `[.., m]` (the vector is treated as a
///   one-row / one-column matrix whose extra dim is removed from the result);
/// - `[ba.., m, k]·[bb.., k, n]` → `[broadcast(ba, bb).., m, n]`: the batch dims broadcast
///   under NumPy rules (a `[k, n]` operand is shared by the whole batch).
///
/// Both operands share a float dtype and a device: f32/f64, or f16/bf16 on the CPU (computed
/// with f32 accumulation, rounded once). Under autocast f32 operands are cast to the autocast
/// dtype first (see `crate::autocast`). An inner-size mismatch or batch dims that do not
/// broadcast are errors naming both shapes.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("matmul", tandem_core::profile::Phase::Forward);
    let (a, b) = (&autocast::lower(a)?, &autocast::lower(b)?);
    same_dtype_device("matmul", a, b)?;
    matrix_dtype("matmul", a)?;
    if a.rank() == 0 || b.rank() == 0 {
        return Err(Error::shape(
            "matmul",
            format!(
                "both operands need at least 1 dim, got {:?} and {:?}",
                a.dims(),
                b.dims()
            ),
        ));
    }
    let ka = a.dims()[a.rank() - 1];
    let kb = if b.rank() == 1 {
        b.dims()[0]
    } else {
        b.dims()[b.rank() - 2]
    };
    if ka != kb {
        return Err(Error::shape(
            "matmul",
            format!(
                "inner dims differ: {:?} · {:?} ({ka} vs {kb})",
                a.dims(),
                b.dims()
            ),
        ));
    }
    let a2 = if a.rank() == 1 {
        unsqueeze(a, 0)?
    } else {
        a.clone()
    };
    let b2 = if b.rank() == 1 {
        unsqueeze(b, -1)?
    } else {
        b.clone()
    };
    let batch_a = &a2.dims()[..a2.rank() - 2];
    let batch_b = &b2.dims()[..b2.rank() - 2];
    let batch = broadcast_shapes("matmul", batch_a, batch_b).map_err(|_| {
        Error::shape(
            "matmul",
            format!(
                "batch dims of {:?} and {:?} do not broadcast",
                a.dims(),
                b.dims()
            ),
        )
    })?;
    let mut out = matrix_product(&a2, &b2, &batch)?;
    if b.rank() == 1 {
        out = squeeze(&out, -1)?;
    }
    if a.rank() == 1 {
        out = squeeze(&out, if b.rank() == 1 { -1 } else { -2 })?;
    }
    Ok(out)
}

/// The batched product `op(x) · op(y)` that matmul, its backward and linear are built on,
/// dispatched on the device (see `cpu::batched_product` for the arguments): `op` transposes the
/// last two dims when `tx`/`ty` is set, the batch dims broadcast to `batch` and are summed into
/// `out_batch`, and `bias` is added to every row.
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
) -> Result<Tensor> {
    match x.device() {
        Device::Cpu if is_low(x.dtype()) || is_low(y.dtype()) => {
            low_precision::batched_product(op, x, tx, y, ty, batch, out_batch, bias)
        }
        Device::Cpu => cpu::batched_product(op, x, tx, y, ty, batch, out_batch, bias),
        Device::Cuda(_) => cuda::batched_product(op, x, tx, y, ty, batch, out_batch, bias),
    }
}

/// `[ba.., m, k]·[bb.., k, n]` with checked shapes, recorded for autograd.
fn matrix_product(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
    let out = batched_product("matmul", a, false, b, false, batch, batch, None)?;
    let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
    let batch = batch.to_vec();
    Ok(record_fn(out, &[a, b], "matmul", move || {
        let (da, db) = (a.detach(), b.detach());
        move |g: &Tensor| {
            let ga = if need_a {
                let out_batch = &da.dims()[..da.rank() - 2];
                Some(batched_product(
                    "matmul_backward",
                    g,
                    false,
                    &db,
                    true,
                    &batch,
                    out_batch,
                    None,
                )?)
            } else {
                None
            };
            let gb = if need_b {
                let out_batch = &db.dims()[..db.rank() - 2];
                Some(batched_product(
                    "matmul_backward",
                    &da,
                    true,
                    g,
                    false,
                    &batch,
                    out_batch,
                    None,
                )?)
            } else {
                None
            };
            Ok(vec![ga, gb])
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use crate::views::{expand, transpose};
    use tandem_core::{DType, Device, Generator};

    /// Direct-loop reference for `[B, m, k]·[B, k, n]` on row-major values.
    fn naive(a: &[f64], b: &[f64], batch: usize, m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0; batch * m * n];
        for p in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    out[(p * m + i) * n + j] = (0..k)
                        .map(|t| a[(p * m + i) * k + t] * b[(p * k + t) * n + j])
                        .sum();
                }
            }
        }
        out
    }

    fn assert_close(got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{i}: {g} vs {w}");
        }
    }

    #[test]
    fn matrix_and_batched_products_match_direct_loops() {
        let a = rand_f64(&[3, 5, 7], 1);
        let b = rand_f64(&[3, 7, 4], 2);
        let got = matmul(&a, &b).unwrap();
        assert_eq!(got.dims(), &[3, 5, 4]);
        let want = naive(
            &a.to_vec_f64().unwrap(),
            &b.to_vec_f64().unwrap(),
            3,
            5,
            7,
            4,
        );
        assert_close(&got.to_vec_f64().unwrap(), &want, 1e-12);

        // Large enough for gemm's threaded path, with a transposed (strided) operand.
        let a = rand_f64(&[96, 80], 3);
        let bt = rand_f64(&[112, 80], 4);
        let got = matmul(&a, &transpose(&bt, 0, 1).unwrap()).unwrap();
        let b_rows = bt.to_vec_f64().unwrap();
        let mut b = vec![0.0; 80 * 112];
        for i in 0..112 {
            for j in 0..80 {
                b[j * 112 + i] = b_rows[i * 80 + j];
            }
        }
        let want = naive(&a.to_vec_f64().unwrap(), &b, 1, 96, 80, 112);
        assert_close(&got.to_vec_f64().unwrap(), &want, 1e-12);
    }

    #[test]
    fn broadcast_batch_and_vector_operands_follow_torch_shapes() {
        // [2, 1, 3, 4]·[3, 4, 5] → [2, 3, 3, 5]; each output block uses a[p, 0] and b[q].
        let a = rand_f64(&[2, 1, 3, 4], 5);
        let b = rand_f64(&[3, 4, 5], 6);
        let got = matmul(&a, &b).unwrap();
        assert_eq!(got.dims(), &[2, 3, 3, 5]);
        let (av, bv, gv) = (
            a.to_vec_f64().unwrap(),
            b.to_vec_f64().unwrap(),
            got.to_vec_f64().unwrap(),
        );
        for p in 0..2 {
            for q in 0..3 {
                let want = naive(
                    &av[p * 12..p * 12 + 12],
                    &bv[q * 20..q * 20 + 20],
                    1,
                    3,
                    4,
                    5,
                );
                let at = (p * 3 + q) * 15;
                assert_close(&gv[at..at + 15], &want, 1e-12);
            }
        }
        let v = rand_f64(&[4], 7);
        let w = rand_f64(&[4], 8);
        let dot = matmul(&v, &w).unwrap();
        assert_eq!(dot.dims(), &[] as &[usize]);
        let want: f64 = v
            .to_vec_f64()
            .unwrap()
            .iter()
            .zip(w.to_vec_f64().unwrap())
            .map(|(x, y)| x * y)
            .sum();
        assert!((dot.item().unwrap() - want).abs() < 1e-12);
        assert_eq!(matmul(&v, &b).unwrap().dims(), &[3, 5]);
        assert_eq!(matmul(&a, &v).unwrap().dims(), &[2, 1, 3]);
    }

    #[test]
    fn empty_dims_give_empty_or_zero_products() {
        let a = Tensor::zeros(&[2, 0], DType::F64, Device::Cpu).unwrap();
        let b = Tensor::zeros(&[0, 3], DType::F64, Device::Cpu).unwrap();
        let c = matmul(&a, &b).unwrap();
        assert_eq!(c.dims(), &[2, 3]);
        assert_eq!(c.to_vec_f64().unwrap(), vec![0.0; 6]);
        let a = Tensor::zeros(&[0, 4, 3], DType::F64, Device::Cpu).unwrap();
        let b = Tensor::ones(&[3, 5], DType::F64, Device::Cpu).unwrap();
        assert_eq!(matmul(&a, &b).unwrap().dims(), &[0, 4, 5]);
    }

    #[test]
    fn f32_products_agree_with_the_f64_reference() {
        let mut g = Generator::new(11);
        let a = Tensor::rand(&[4, 33, 65], -1.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let b = Tensor::rand(&[65, 17], -1.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let got = matmul(&a, &b).unwrap().to_vec_f64().unwrap();
        let bv = b.to_vec_f64().unwrap();
        let mut b_rep = Vec::new();
        for _ in 0..4 {
            b_rep.extend_from_slice(&bv);
        }
        let want = naive(&a.to_vec_f64().unwrap(), &b_rep, 4, 33, 65, 17);
        assert_close(&got, &want, 1e-5);
    }

    #[test]
    fn gradcheck_matmul_over_shapes_layouts_and_broadcasts() {
        let cases: [(&[usize], &[usize]); 7] = [
            (&[3, 4], &[4, 5]),
            (&[2, 3, 4], &[2, 4, 5]),
            (&[2, 3, 4], &[4, 5]),
            (&[4, 5], &[2, 5, 3]),
            (&[2, 1, 3, 4], &[3, 4, 2]),
            (&[4], &[4]),
            (&[2, 3, 4], &[4]),
        ];
        for (i, (sa, sb)) in cases.iter().enumerate() {
            let a = rand_f64(sa, 20 + i as u64);
            let b = rand_f64(sb, 40 + i as u64);
            check(|t| matmul(&t[0], &t[1]), &[a, b]);
        }
        check(
            |t| matmul(&t[0], &t[1]),
            &[rand_f64(&[4], 60), rand_f64(&[2, 4, 3], 61)],
        );
        // Transposed (non-contiguous) operands on either side.
        check(
            |t| matmul(&t[0], &t[1]),
            &[
                rand_f64_noncontiguous(&[3, 4], 62),
                rand_f64_noncontiguous(&[4, 5], 63),
            ],
        );
        check(
            |t| matmul(&t[0], &t[1]),
            &[
                rand_f64_noncontiguous(&[2, 3, 4], 64),
                rand_f64_noncontiguous(&[4, 2], 65),
            ],
        );
        // An operand expanded along the batch (stride 0) and one that only one input needs.
        check(
            |t| matmul(&expand(&t[0], &[3, 2, 4])?, &t[1]),
            &[rand_f64(&[1, 2, 4], 66), rand_f64(&[3, 4, 2], 67)],
        );
        let fixed = rand_f64(&[4, 3], 68).detach();
        check(
            |t| matmul(&t[0], &fixed),
            &[rand_f64_noncontiguous(&[2, 5, 4], 69)],
        );
    }

    #[test]
    fn shape_mismatches_are_errors_naming_both_shapes() {
        let a = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
        let b = Tensor::zeros(&[4, 5], DType::F32, Device::Cpu).unwrap();
        let err = matmul(&a, &b).unwrap_err().to_string();
        assert!(
            err.starts_with("matmul:") && err.contains("[2, 3]") && err.contains("[4, 5]"),
            "{err}"
        );
        let a = Tensor::zeros(&[2, 3, 4], DType::F32, Device::Cpu).unwrap();
        let b = Tensor::zeros(&[3, 4, 5], DType::F32, Device::Cpu).unwrap();
        let err = matmul(&a, &b).unwrap_err().to_string();
        assert!(
            err.contains("[2, 3, 4]") && err.contains("[3, 4, 5]"),
            "{err}"
        );
        let s = Tensor::scalar(1.0f32, Device::Cpu).unwrap();
        assert!(matmul(&s, &b).is_err());
        let c = Tensor::zeros(&[4, 5], DType::F64, Device::Cpu).unwrap();
        assert!(matmul(&a, &c).unwrap_err().to_string().contains("dtype"));
    }
}
