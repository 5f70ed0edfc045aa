//! The elementwise kernels of `ops/src/binary/binary.cu` and `ops/src/unary/unary.cu`, run on
//! the CPU by the host harness through the launch plans the CUDA ops use, against tandem's CPU
//! ops on the same inputs: every binary op (add, sub, mul, div, add_relu, add_scalar,
//! mul_scalar), every unary op forward (neg, exp, log, sqrt, relu, sigmoid, tanh, pow_scalar with
//! each of its exponent classes) and backward (against the CPU autograd gradient), in f32 and
//! f64, over odd sizes, several blocks, empty and 0-dim tensors, offset (unaligned), transposed,
//! permuted, narrowed and broadcast (stride 0) inputs, with the planned grid and with a grid of
//! two one-warp blocks (so that every thread goes round the grid-stride loop). Outputs start
//! poisoned and are guarded on both sides.
//!
//! Dropout (`ops/src/dropout/dropout.cu`) must draw the CPU's mask bit for bit for the same seed
//! (both devices use one counter-based generator) and produce the CPU op's output and gradient.
//!
//! Results must equal the CPU's bit for bit (NaN matching NaN), except for the ops that call a
//! math library function (exp, log, sigmoid, tanh, fractional powers), which must agree within
//! a few units in the last place.

mod common;

use common::*;
use tandem_core::cuda::launch::Launch;
use tandem_core::cuda::runtime_kernels::DeviceView;
use tandem_core::{DType, Element, FloatElement, Layout, Result, Tensor};
use tandem_ops::binary::cuda::launch::{add_relu_launch, binary_launch, scalar_launch};
use tandem_ops::binary::{BinaryKind, ScalarKind};
use tandem_ops::dropout::cuda::launch::{
    dropout_backward_launch, dropout_forward_channels_last_launch, dropout_forward_launch,
};
use tandem_ops::dropout::keep_threshold;
use tandem_ops::unary::cuda::launch::{unary_backward_launch, unary_launch};
use tandem_ops::unary::UnaryKind;

/// A dense output of `shape`.
fn dense(shape: &[usize]) -> View {
    let layout = Layout::contiguous(shape);
    let len = layout.numel();
    View {
        name: "dense output",
        len,
        layout,
    }
}

/// Whether `got` is within `ulps` units in the last place of `want` (NaN matches NaN, infinities
/// must match exactly); results below the smallest normal compare with that as the unit.
fn close<T: FloatElement>(got: T, want: T, ulps: f64) -> bool {
    if same(got, want) {
        return true;
    }
    let (g, w) = (got.to_f64(), want.to_f64());
    if !g.is_finite() || !w.is_finite() {
        return false;
    }
    let (eps, tiny) = if T::DTYPE == DType::F32 {
        (f32::EPSILON as f64, f32::MIN_POSITIVE as f64)
    } else {
        (f64::EPSILON, f64::MIN_POSITIVE)
    };
    (g - w).abs() <= ulps * eps * w.abs().max(tiny)
}

fn assert_close<T: FloatElement>(got: &[T], want: &[T], ulps: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| !close(**g, **w, ulps))
        .take(5)
        .map(|(i, (g, w))| format!("[{i}] got {g:?}, want {w:?}"))
        .collect();
    assert!(bad.is_empty(), "{what}: {}", bad.join("; "));
}

/// Runs `launch` (built over a fresh poisoned dense output) with its own grid and with a small
/// one, and returns the output both times (checked for writes outside it).
fn run_both<T: Element>(
    out: &View,
    build: &dyn Fn(DeviceView) -> Result<Launch>,
    what: &str,
) -> [Vec<T>; 2] {
    let mut results = Vec::with_capacity(2);
    for small in [false, true] {
        let what = format!("{what}{}", if small { " (small grid)" } else { "" });
        let mut buffer = HostBuffer::new(&vec![poison::<T>(); out.len]);
        let launch = build(buffer.view(&out.layout)).unwrap_or_else(|e| panic!("{what}: {e}"));
        let launch = if small { small_grid(&launch) } else { launch };
        run_launch(&launch, &what);
        results.push(buffer.storage(&what).to_vec());
    }
    let second = results.pop().expect("two runs");
    let first = results.pop().expect("two runs");
    [first, second]
}

// ---- binary ------------------------------------------------------------------------------------

type BinaryOp = fn(&Tensor, &Tensor) -> Result<Tensor>;

const BINARY: [(&str, Option<BinaryKind>, BinaryOp); 5] = [
    ("add", Some(BinaryKind::Add), tandem_ops::add),
    ("sub", Some(BinaryKind::Sub), tandem_ops::sub),
    ("mul", Some(BinaryKind::Mul), tandem_ops::mul),
    ("div", Some(BinaryKind::Div), tandem_ops::div),
    ("add_relu", None, tandem_ops::add_relu),
];

fn check_binary<T: FloatElement>(seed: u64) -> usize {
    let mut cases = 0;
    for family in families() {
        for (a, _) in &family {
            for (b, _) in &family {
                if a.layout.shape() != b.layout.shape() {
                    continue;
                }
                let out = dense(a.layout.shape().as_slice());
                let a_storage = values::<T>(a.len, seed);
                let b_storage = values::<T>(b.len, seed + 1);
                let (ta, tb) = (
                    cpu_view(&a_storage, &a.layout),
                    cpu_view(&b_storage, &b.layout),
                );
                for (name, kind, op) in BINARY {
                    let what = format!("{name} {} a: {}, b: {}", T::DTYPE, a.name, b.name);
                    let want = op(&ta, &tb).unwrap().to_vec::<T>().unwrap();
                    let mut ab = HostBuffer::new(&a_storage);
                    let mut bb = HostBuffer::new(&b_storage);
                    let (va, vb) = (ab.view(&a.layout), bb.view(&b.layout));
                    let build = |o: DeviceView| match kind {
                        Some(kind) => binary_launch(kind, o, va, vb),
                        None => add_relu_launch(o, va, vb),
                    };
                    for got in run_both::<T>(&out, &build, &what) {
                        assert_same(&got, &want, &what);
                    }
                    // The inputs are read, never written.
                    assert_same(ab.storage(&what), &a_storage, &format!("{what}: input a"));
                    assert_same(bb.storage(&what), &b_storage, &format!("{what}: input b"));
                    cases += 1;
                }
            }
        }
    }
    cases
}

#[test]
fn binary_kernels_match_the_cpu_ops_bit_for_bit_over_every_layout_pair() {
    let cases = check_binary::<f32>(1) + check_binary::<f64>(2);
    assert!(cases > 300, "only {cases} cases ran");
}

fn check_scalar<T: FloatElement>(seed: u64) -> usize {
    let mut cases = 0;
    for (x, _) in families().into_iter().flatten() {
        let out = dense(x.layout.shape().as_slice());
        let storage = values::<T>(x.len, seed);
        let tx = cpu_view(&storage, &x.layout);
        for (kind, c) in [
            (ScalarKind::Add, 0.3),
            (ScalarKind::Add, -1.7e10),
            (ScalarKind::Mul, 0.1),
            (ScalarKind::Mul, -3.0),
            (ScalarKind::Mul, f64::INFINITY),
        ] {
            let what = format!("{} {c} {} x: {}", kind.name(), T::DTYPE, x.name);
            let want = match kind {
                ScalarKind::Add => tandem_ops::add_scalar(&tx, c),
                ScalarKind::Mul => tandem_ops::mul_scalar(&tx, c),
            }
            .unwrap()
            .to_vec::<T>()
            .unwrap();
            let mut xb = HostBuffer::new(&storage);
            let vx = xb.view(&x.layout);
            for got in run_both::<T>(&out, &|o| scalar_launch(kind, o, vx, c), &what) {
                assert_same(&got, &want, &what);
            }
            cases += 1;
        }
    }
    cases
}

#[test]
fn scalar_kernels_round_once_from_f64_as_the_cpu_does() {
    let cases = check_scalar::<f32>(3) + check_scalar::<f64>(4);
    assert!(cases > 100, "only {cases} cases ran");
}

// ---- unary -------------------------------------------------------------------------------------

/// Every unary op the kernels implement, with the pow_scalar exponents that take each of its
/// paths (square, square root, small integers of both signs, zero, one, fractional).
fn unary_kinds() -> Vec<UnaryKind> {
    let mut kinds = vec![
        UnaryKind::Neg,
        UnaryKind::Exp,
        UnaryKind::Log,
        UnaryKind::Sqrt,
        UnaryKind::Relu,
        UnaryKind::Sigmoid,
        UnaryKind::Tanh,
    ];
    for p in [2.0, 0.5, 3.0, -2.0, 0.0, 1.0, 1.7, -0.3, 65.0, 2.5] {
        kinds.push(UnaryKind::Pow(p));
    }
    kinds
}

/// The CPU op for `kind`.
fn cpu_unary(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    match kind {
        UnaryKind::Neg => tandem_ops::neg(x),
        UnaryKind::Exp => tandem_ops::exp(x),
        UnaryKind::Log => tandem_ops::log(x),
        UnaryKind::Sqrt => tandem_ops::sqrt(x),
        UnaryKind::Pow(p) => tandem_ops::pow_scalar(x, p),
        UnaryKind::Relu => tandem_ops::relu(x),
        UnaryKind::Sigmoid => tandem_ops::sigmoid(x),
        UnaryKind::Tanh => tandem_ops::tanh(x),
    }
}

/// How far the forward may be from the CPU's, in units in the last place: 0 for the ops that
/// are the same IEEE operations on both sides, a few for those that call a math library
/// (tandem's CPU exp is its own polynomial; the kernels use CUDA's, here the host's, libm).
fn forward_ulps(kind: UnaryKind) -> f64 {
    match kind {
        UnaryKind::Exp | UnaryKind::Sigmoid | UnaryKind::Log | UnaryKind::Tanh => 4.0,
        UnaryKind::Pow(p) if p != 2.0 && p != 0.5 && p.fract() != 0.0 => 4.0,
        _ => 0.0,
    }
}

fn check_unary_forward<T: FloatElement>(seed: u64) -> usize {
    let mut cases = 0;
    for (x, _) in families().into_iter().flatten() {
        let out = dense(x.layout.shape().as_slice());
        let storage = values::<T>(x.len, seed);
        let tx = cpu_view(&storage, &x.layout);
        for kind in unary_kinds() {
            let what = format!("{kind:?} {} x: {}", T::DTYPE, x.name);
            let want = cpu_unary(kind, &tx).unwrap().to_vec::<T>().unwrap();
            let mut xb = HostBuffer::new(&storage);
            let vx = xb.view(&x.layout);
            for got in run_both::<T>(&out, &|o| unary_launch(kind, o, vx), &what) {
                assert_close(&got, &want, forward_ulps(kind), &what);
            }
            assert_same(xb.storage(&what), &storage, &format!("{what}: input"));
            cases += 1;
        }
    }
    cases
}

#[test]
fn unary_forward_kernels_match_the_cpu_ops() {
    let cases = check_unary_forward::<f32>(5) + check_unary_forward::<f64>(6);
    assert!(cases > 300, "only {cases} cases ran");
}

/// The CPU autograd gradient of `kind` at the logical values of `x` for the output gradient
/// `g`, and the tensor the forward saves (its output or its input).
fn cpu_gradient(kind: UnaryKind, x: &Tensor, g: &Tensor) -> (Vec<f64>, Tensor) {
    let leaf = x
        .contiguous_detached()
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let y = cpu_unary(kind, &leaf).unwrap();
    let g = g.contiguous_detached().unwrap();
    tandem_autograd::backward(&y, Some(&g), &Default::default()).unwrap();
    let grad = leaf.grad().expect("the leaf has a gradient");
    let saved = if kind.saves_output() {
        y.detach()
    } else {
        x.contiguous_detached().unwrap()
    };
    (
        grad.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(),
        saved,
    )
}

fn check_unary_backward<T: FloatElement>(seed: u64) -> usize {
    let mut cases = 0;
    for family in families() {
        for (gv, _) in &family {
            // The saved tensor is written through its layout, so it may not be a broadcast view.
            for (sv, s_expanded) in &family {
                if *s_expanded || gv.layout.shape() != sv.layout.shape() {
                    continue;
                }
                let out = dense(gv.layout.shape().as_slice());
                let x_storage = values::<T>(sv.len, seed);
                let g_storage = values::<T>(gv.len, seed + 7);
                let tx = cpu_view(&x_storage, &sv.layout);
                let tg = cpu_view(&g_storage, &gv.layout);
                for kind in unary_kinds() {
                    let what = format!(
                        "{kind:?} backward {} g: {}, saved: {}",
                        T::DTYPE,
                        gv.name,
                        sv.name
                    );
                    let (want, saved) = cpu_gradient(kind, &tx, &tg);
                    let want: Vec<T> = want.into_iter().map(T::from_f64).collect();
                    // The saved tensor's values, placed in a storage through the saved view.
                    let holder = cpu_view(&vec![poison::<T>(); sv.len], &sv.layout);
                    holder.copy_(&saved).unwrap();
                    let saved_storage = cpu_storage::<T>(&holder, sv.len);
                    let mut gb = HostBuffer::new(&g_storage);
                    let mut sb = HostBuffer::new(&saved_storage);
                    let (vg, vs) = (gb.view(&gv.layout), sb.view(&sv.layout));
                    let build = |o: DeviceView| unary_backward_launch(kind, o, vg, vs);
                    let ulps = match kind {
                        UnaryKind::Pow(p) if (p - 1.0).fract() != 0.0 => 4.0,
                        _ => 0.0,
                    };
                    for got in run_both::<T>(&out, &build, &what) {
                        assert_close(&got, &want, ulps, &what);
                    }
                    cases += 1;
                }
            }
        }
    }
    cases
}

#[test]
fn unary_backward_kernels_match_the_cpu_autograd_gradients() {
    let cases = check_unary_backward::<f32>(8) + check_unary_backward::<f64>(9);
    assert!(cases > 300, "only {cases} cases ran");
}

// ---- dropout -----------------------------------------------------------------------------------

fn check_dropout<T: FloatElement>(seed: u64) -> usize {
    let mut cases = 0;
    for (x, _) in families().into_iter().flatten() {
        let shape = x.layout.shape().as_slice().to_vec();
        let out = dense(&shape);
        let storage = values::<T>(x.len, seed);
        let tx = cpu_view(&storage, &x.layout);
        for (p, generator_seed) in [(0.3, 11u64), (0.5, 12), (0.9, 13), (1e-9, 14)] {
            let what = format!("dropout p {p} {} x: {}", T::DTYPE, x.name);
            // The CPU op with a leaf input, its output and its gradient for an output gradient.
            let leaf = tx
                .contiguous_detached()
                .unwrap()
                .with_requires_grad()
                .unwrap();
            let mut generator = tandem_core::Generator::new(generator_seed);
            let y = tandem_ops::dropout(&leaf, p, true, &mut generator).unwrap();
            let g_storage = values::<T>(out.len, seed + 3);
            let tg = Tensor::from_vec(g_storage.clone(), &shape, tandem_core::Device::Cpu).unwrap();
            tandem_autograd::backward(&y, Some(&tg), &Default::default()).unwrap();
            let want_out = y.to_vec::<T>().unwrap();
            let want_grad = leaf.grad().unwrap().to_vec::<T>().unwrap();
            // The seed the op drew: the generator's first draw.
            let kernel_seed = tandem_core::Generator::new(generator_seed).next_u64();
            let scale = 1.0 / (1.0 - p);
            let threshold = keep_threshold(p);
            for small in [false, true] {
                let what = format!("{what}{}", if small { " (small grid)" } else { "" });
                let mut xb = HostBuffer::new(&storage);
                let mut ob = HostBuffer::new(&vec![poison::<T>(); out.len]);
                let mut mb = HostBuffer::new(&vec![0xa5u8; out.len]);
                let launch = dropout_forward_launch(
                    ob.view(&out.layout),
                    mb.view(&out.layout),
                    xb.view(&x.layout),
                    kernel_seed,
                    threshold,
                    scale,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                let launch = if small { small_grid(&launch) } else { launch };
                run_launch(&launch, &what);
                assert_same(ob.storage(&what), &want_out, &format!("{what}: output"));
                let mask = mb.storage(&what).to_vec();
                // (That the mask is the CPU's bit for bit is checked on inputs without zeros
                // below; here the output and the gradient through it must be the CPU's.)
                assert!(mask.iter().all(|&m| m <= 1), "{what}: mask {mask:?}");
                // Backward through the kernel's mask, with the gradient read through each layout.
                let mut gb = HostBuffer::new(&g_storage);
                let mut db = HostBuffer::new(&vec![poison::<T>(); out.len]);
                let mut mb2 = HostBuffer::new(&mask);
                let launch = dropout_backward_launch(
                    db.view(&out.layout),
                    gb.view(&out.layout),
                    mb2.view(&out.layout),
                    scale,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                let launch = if small { small_grid(&launch) } else { launch };
                run_launch(&launch, &what);
                assert_same(db.storage(&what), &want_grad, &format!("{what}: gradient"));
            }
            cases += 1;
        }
    }
    cases
}

#[test]
fn dropout_kernels_draw_the_cpu_mask_and_match_the_cpu_op_forward_and_backward() {
    let cases = check_dropout::<f32>(21) + check_dropout::<f64>(22);
    assert!(cases > 50, "only {cases} cases ran");
}

/// The mask as bits: for inputs with no zero, the CPU output is zero exactly where the element
/// was dropped, so the kernel's mask must be 1 exactly where the CPU output is nonzero.
#[test]
fn dropout_mask_equals_the_cpu_mask_over_several_blocks() {
    let n = 3001;
    let ones = vec![1.0f32; n];
    let layout = Layout::contiguous(&[n]);
    for (p, generator_seed) in [(0.2, 1u64), (0.5, 2), (0.75, 3)] {
        let x = Tensor::from_vec(ones.clone(), &[n], tandem_core::Device::Cpu).unwrap();
        let y = tandem_ops::dropout(
            &x,
            p,
            true,
            &mut tandem_core::Generator::new(generator_seed),
        )
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
        let want: Vec<u8> = y.iter().map(|&v| (v != 0.0) as u8).collect();
        let mut xb = HostBuffer::new(&ones);
        let mut ob = HostBuffer::new(&vec![poison::<f32>(); n]);
        let mut mb = HostBuffer::new(&vec![0xa5u8; n]);
        let launch = dropout_forward_launch(
            ob.view(&layout),
            mb.view(&layout),
            xb.view(&layout),
            tandem_core::Generator::new(generator_seed).next_u64(),
            keep_threshold(p),
            1.0 / (1.0 - p),
        )
        .unwrap();
        let what = format!("dropout mask p {p}");
        run_launch(&launch, &what);
        assert_eq!(mb.storage(&what), &want[..], "{what}");
        let kept = want.iter().filter(|&&m| m == 1).count() as f64 / n as f64;
        assert!((kept - (1.0 - p)).abs() < 0.05, "{what}: kept {kept}");
    }
}

/// The channels-last forward: a dense NHWC input gives the CPU's channels-last output and mask
/// (the row-major draws laid out NHWC), bit for bit, over several blocks and with a grid that
/// loops.
#[test]
fn dropout_channels_last_forward_matches_the_cpu_op() {
    let cl = tandem_core::MemoryFormat::ChannelsLast;
    for dims in [[2usize, 5, 3, 7], [3, 8, 9, 5], [1, 3, 1, 1]] {
        let n: usize = dims.iter().product();
        let values: Vec<f32> = (0..n).map(|i| 1.0 + (i % 97) as f32 * 0.125).collect();
        let x = Tensor::from_vec(values, &dims, tandem_core::Device::Cpu)
            .unwrap()
            .contiguous_in(cl)
            .unwrap();
        let p = 0.3;
        let y = tandem_ops::dropout(&x, p, true, &mut tandem_core::Generator::new(9)).unwrap();
        assert_eq!(y.memory_format(), cl, "the CPU output is channels-last");
        // Both in NHWC storage order.
        let want_y = y.read_dense_slice::<f32>().unwrap().to_vec();
        let x_nhwc = x.read_dense_slice::<f32>().unwrap().to_vec();
        let want_mask: Vec<u8> = want_y.iter().map(|&v| (v != 0.0) as u8).collect();
        let layout = cl.layout("harness", &dims).unwrap();
        let mut xb = HostBuffer::new(&x_nhwc);
        let mut ob = HostBuffer::new(&vec![poison::<f32>(); n]);
        let mut mb = HostBuffer::new(&vec![0xa5u8; n]);
        let launch = dropout_forward_channels_last_launch(
            ob.view(&layout),
            mb.view(&layout),
            xb.view(&layout),
            tandem_core::Generator::new(9).next_u64(),
            keep_threshold(p),
            1.0 / (1.0 - p),
        )
        .unwrap();
        assert_eq!(launch.kernel, "dropout_forward_channels_last_f32");
        for (small, launch) in [(false, launch.clone()), (true, small_grid(&launch))] {
            let what = format!("channels-last dropout {dims:?} small grid {small}");
            run_launch(&launch, &what);
            assert_same(ob.storage(&what), &want_y, &what);
            assert_eq!(mb.storage(&what), &want_mask[..], "{what}: mask");
        }
        // A row-major view is refused.
        let row = Layout::contiguous(&dims);
        let err = dropout_forward_channels_last_launch(
            ob.view(&row),
            mb.view(&layout),
            xb.view(&layout),
            1,
            keep_threshold(p),
            2.0,
        );
        if dims[1] > 1 && dims[2] * dims[3] > 1 {
            let err = err.unwrap_err().to_string();
            assert!(
                err.contains("dropout") && err.contains("channels-last"),
                "{err}"
            );
        }
    }
}

// ---- what the builders refuse -----------------------------------------------------------------

#[test]
fn builders_refuse_strided_outputs_mixed_dtypes_shape_mismatches_and_overlaps() {
    let mut a = HostBuffer::new(&[1.0f32; 30]);
    let mut b = HostBuffer::new(&[2.0f32; 30]);
    let mut d = HostBuffer::new(&[3.0f64; 30]);
    let mut o = HostBuffer::new(&[0.0f32; 30]);
    let c65 = Layout::contiguous(&[6, 5]);
    let c56 = Layout::contiguous(&[5, 6]);
    let t65 = c56.transpose("t", 0, 1).unwrap();
    let message = |r: Result<Launch>| match r {
        Ok(_) => panic!("the builder accepted a bad launch"),
        Err(e) => e.to_string(),
    };
    // A transposed output.
    let err = message(binary_launch(
        BinaryKind::Add,
        o.view(&t65),
        a.view(&c65),
        b.view(&c65),
    ));
    assert!(err.starts_with("add:") && err.contains("dense"), "{err}");
    // f32 and f64 inputs.
    let err = message(binary_launch(
        BinaryKind::Mul,
        o.view(&c65),
        a.view(&c65),
        d.view(&c65),
    ));
    assert!(err.starts_with("mul:") && err.contains("f64"), "{err}");
    // An input of another shape.
    let err = message(unary_launch(UnaryKind::Exp, o.view(&c65), a.view(&c56)));
    assert!(err.starts_with("exp:") && err.contains("[5, 6]"), "{err}");
    // The output overlapping an input as another view.
    let shifted = c65.narrow("t", 1, 1, 4).unwrap();
    let c64 = Layout::contiguous(&[6, 4]);
    let out_view = o.view(&c64);
    let in_view = DeviceView {
        ptr: out_view.ptr,
        dtype: out_view.dtype,
        layout: &shifted,
    };
    let err = message(unary_launch(UnaryKind::Relu, out_view, in_view));
    assert!(
        err.starts_with("relu:") && err.contains("overlaps"),
        "{err}"
    );
    // Integer dtypes.
    let mut l = HostBuffer::new(&[1i64; 30]);
    let err = message(scalar_launch(
        ScalarKind::Add,
        l.view(&c65),
        l.view(&c65),
        1.0,
    ));
    assert!(
        err.starts_with("add_scalar:") && err.contains("i64"),
        "{err}"
    );
}
