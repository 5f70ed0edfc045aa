//! Batch norm's kernels (`ops/src/batch_norm/batch_norm.cu`), run on the CPU by the host
//! harness through the launch plans the CUDA path uses (`tandem_ops::batch_norm::cuda::launch`),
//! against the CPU phases (`tandem_ops::batch_norm::phases` on CPU tensors).
//!
//! Every output starts poisoned inside guard elements: a value left unwritten or a write
//! outside a buffer shows. Shapes cover odd run lengths (scalar loads), run lengths that are
//! whole vectors (16-byte loads, and the same again from a misaligned buffer), `[N, C]`
//! inputs, a single sample and an empty batch. The reductions run with tandem's split, with
//! forced splits of 3 and 7 blocks per channel (partial sums and the finishing kernel, chunks
//! ending mid-run), and with a grid shrunk to two one-warp blocks (blocks loop over channels
//! and splits). Reductions must agree with the CPU within rounding; every pass that maps
//! elements with per-channel constants (apply and its epilogues, the masked gradient, the
//! input gradient) and every per-channel formula (sums, running update, normalization table,
//! parameter gradients) must equal the CPU's bit for bit given the same inputs.

mod common;

use common::{assert_same, poison, small_grid, HostBuffer};
use rand::{Rng, SeedableRng};
use tandem_core::cuda::deferred::DeferredSlot;
use tandem_core::cuda::launch::Launch;
use tandem_core::{DType, Device, Element, Layout, Tensor};
use tandem_ops::batch_norm::cuda::launch::{
    apply_launch, backward_apply_launches, backward_reduce_launches, count_batch_launch,
    from_sums_launch, normalization_launch, parameter_gradients_launch, statistics_launches,
    to_sums_launch, update_running_launch, ApplyEpilogue, ChannelArg, CountArg, ReduceMask, Split,
    SumsArg,
};
use tandem_ops::batch_norm::phases::{
    self, ApplyArgs, BackwardApplyArgs, BackwardReduceArgs, Count, GradMask, Normalization,
    NormalizationArgs, RunningUpdate, Statistics,
};
use tandem_ops::batch_norm::{Dims, Epilogue};

const OP: &str = "batch_norm test";

/// `[N, C, L]` shapes: odd runs, whole vectors, `[N, C]`, one sample, many runs per channel,
/// an empty batch, and the view the CUDA path takes of a channels-last `[N, C, H, W]` input,
/// `[N·H·W, C, 1]` (the channel innermost; here N = 2, H = 4, W = 5 with 6 channels).
const SHAPES: [[usize; 3]; 8] = [
    [2, 3, 5],
    [4, 3, 8],
    [5, 4, 1],
    [40, 6, 1],
    [1, 2, 12],
    [3, 2, 64],
    [6, 1, 300],
    [0, 3, 4],
];

/// A guarded host buffer standing in for a device buffer; `misaligned` shifts its first
/// element by one element, so 16-byte vectors cannot be used.
struct Buf<T: Element> {
    host: HostBuffer<T>,
    len: usize,
    shift: usize,
}

impl<T: Element> Buf<T> {
    fn new(values: &[T], misaligned: bool) -> Self {
        let shift = usize::from(misaligned);
        let mut storage = vec![poison::<T>(); shift];
        storage.extend_from_slice(values);
        Buf {
            host: HostBuffer::new(&storage),
            len: values.len(),
            shift,
        }
    }

    fn poisoned(len: usize) -> Self {
        Buf::new(&vec![poison::<T>(); len], false)
    }

    fn at(&mut self) -> u64 {
        let layout = Layout::contiguous(&[self.len + self.shift]);
        self.host.view(&layout).ptr + (self.shift * std::mem::size_of::<T>()) as u64
    }

    /// The values, after checking the guards (and the misaligned buffer's spare element).
    fn values(&self, what: &str) -> Vec<T> {
        let storage = self.host.storage(what);
        assert!(
            storage[..self.shift]
                .iter()
                .all(|&v| common::same(v, poison::<T>())),
            "{what}: wrote before the buffer"
        );
        storage[self.shift..].to_vec()
    }

    fn channel(&mut self, stride: usize) -> ChannelArg {
        ChannelArg::new(OP, "test vector", self.at(), stride, T::DTYPE).unwrap()
    }
}

/// Runs launches in order, as `cuda.rs` does (nothing for no work), optionally on the shrunk
/// grid.
fn run_all(launches: &[Launch], work: usize, small: bool, what: &str) {
    if work == 0 {
        return;
    }
    for launch in launches {
        let launch = if small {
            small_grid(launch)
        } else {
            launch.clone()
        };
        // SAFETY: every address in the launch points into a live Buf of the size the builder
        // was told.
        unsafe { tandem_cuda_harness::run(&launch) }.unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

/// Values around `offset` with spread `scale`, some exactly zero.
fn values<T: Element>(n: usize, offset: f64, scale: f64, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            if i % 13 == 7 {
                T::from_f64(0.0)
            } else {
                T::from_f64(offset + scale * (rng.gen::<f64>() * 2.0 - 1.0))
            }
        })
        .collect()
}

fn cpu<T: Element>(values: &[T], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.to_vec(), shape, Device::Cpu).unwrap()
}

fn host<T: Element>(t: &Tensor) -> Vec<T> {
    t.to_vec::<T>().unwrap()
}

/// The split variants of a reduction: tandem's, and forced splits of 3 and 7.
fn splits(dims: Dims) -> Vec<(&'static str, Split)> {
    vec![
        ("tandem's split", Split::for_dims(dims)),
        ("3 splits", Split::with_splits(dims, 3)),
        ("7 splits", Split::with_splits(dims, 7)),
    ]
}

/// Per-channel values agree within `tol` relative to `scale[c]`, or are both NaN.
fn assert_close(got: &[f64], want: &[f64], scale: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (c, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || (g - w).abs() <= tol * scale[c].max(1e-300);
        assert!(
            ok,
            "{what}: channel {c}: got {g}, want {w} (tolerance {tol} × {})",
            scale[c]
        );
    }
}

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        1e-12
    } else {
        1e-5
    }
}

// ---- statistics --------------------------------------------------------------------------

fn check_statistics<T: Element>(shape: [usize; 3], misaligned: bool, seed: u64) {
    let dims = Dims::of(&shape);
    let x = values::<T>(dims.numel(), 3.0, 2.0, seed);
    let want = phases::statistics(&cpu(&x, &shape)).unwrap();
    let (want_mean, want_var) = (host::<f64>(&want.mean), host::<f64>(&want.var));
    let scale: Vec<f64> = (0..dims.c)
        .map(|c| want_mean[c].abs() + want_var[c].sqrt())
        .collect();
    let var_scale: Vec<f64> = (0..dims.c).map(|c| scale[c] * scale[c]).collect();
    for (name, split) in splits(dims) {
        for small in [false, true] {
            let what = format!(
                "statistics {} {shape:?} {name}{}{}",
                T::DTYPE,
                if small { ", small grid" } else { "" },
                if misaligned { ", misaligned" } else { "" }
            );
            let mut xb = Buf::new(&x, misaligned);
            let mut mean = Buf::<f64>::poisoned(dims.c);
            let mut var = Buf::<f64>::poisoned(dims.c);
            let mut partials = Buf::<f64>::poisoned(split.partials_len(dims));
            let partials_at = if split.splits > 1 { partials.at() } else { 0 };
            let launches = statistics_launches(
                OP,
                xb.at(),
                T::DTYPE,
                dims,
                split,
                partials_at,
                mean.at(),
                var.at(),
            )
            .unwrap();
            run_all(&launches, dims.c, small, &what);
            let tol = tolerance(T::DTYPE);
            assert_close(
                &mean.values(&what),
                &want_mean,
                &scale,
                tol,
                &format!("{what}: mean"),
            );
            assert_close(
                &var.values(&what),
                &want_var,
                &var_scale,
                tol,
                &format!("{what}: var"),
            );
            partials.values(&what);
            assert_same(&xb.values(&what), &x, &format!("{what}: input changed"));
        }
    }
}

#[test]
fn statistics_match_the_cpu_for_every_shape_split_and_grid() {
    for (i, shape) in SHAPES.into_iter().enumerate() {
        for misaligned in [false, true] {
            check_statistics::<f32>(shape, misaligned, i as u64);
            check_statistics::<f64>(shape, misaligned, 50 + i as u64);
        }
    }
}

#[test]
fn statistics_of_data_far_from_zero_keep_their_variance() {
    // Mean 1e4, spread 1e-2: plain sums of squares in f32 would lose the variance entirely.
    let shape = [8, 2, 100];
    let dims = Dims::of(&shape);
    let x = values::<f32>(dims.numel(), 1e4, 1e-2, 7);
    let want = phases::statistics(&cpu(&x, &shape)).unwrap();
    let mut xb = Buf::new(&x, false);
    let mut mean = Buf::<f64>::poisoned(2);
    let mut var = Buf::<f64>::poisoned(2);
    let split = Split::with_splits(dims, 3);
    let mut partials = Buf::<f64>::poisoned(split.partials_len(dims));
    let launches = statistics_launches(
        OP,
        xb.at(),
        DType::F32,
        dims,
        split,
        partials.at(),
        mean.at(),
        var.at(),
    )
    .unwrap();
    run_all(&launches, 2, false, "offset data");
    let want_var = host::<f64>(&want.var);
    for (c, got) in var.values("offset data").iter().enumerate() {
        assert!(
            (got - want_var[c]).abs() <= 1e-3 * want_var[c],
            "channel {c}: variance {got}, CPU {}",
            want_var[c]
        );
    }
}

/// The deferred-error record in host memory (claim word and four record words), as the
/// device's record is laid out (`tandem_core::cuda::deferred`).
struct Record {
    claim: Vec<u32>,
    words: Vec<i64>,
}

impl Record {
    fn new() -> Self {
        Record {
            claim: vec![0],
            words: vec![0; 4],
        }
    }

    fn slot(&mut self) -> DeferredSlot {
        DeferredSlot {
            claim: self.claim.as_mut_ptr() as u64,
            record: self.words.as_mut_ptr() as u64,
            code: 5,
        }
    }
}

/// A count both ways the kernels take it: from the host, and from "device" memory (`buf`).
fn count_args(n: usize, buf: &mut Buf<f64>) -> [(&'static str, CountArg); 2] {
    [
        ("host count", CountArg::Host(n)),
        ("device count", CountArg::Device(buf.at())),
    ]
}

// ---- per-channel formulas ----------------------------------------------------------------

fn cpu_stats(c: usize, count: usize, seed: u64) -> Statistics {
    let mean = values::<f64>(c, 0.5, 2.0, seed);
    let var: Vec<f64> = values::<f64>(c, 1.5, 1.0, seed + 1)
        .into_iter()
        .map(|v| v.abs())
        .collect();
    Statistics {
        count: Count::Host(count),
        mean: cpu(&mean, &[c]),
        var: cpu(&var, &[c]),
    }
}

#[test]
fn sums_round_trip_like_the_cpu_bit_for_bit() {
    for c in [0usize, 1, 5, 300] {
        let stats = cpu_stats(c, 77, c as u64);
        let want = host::<f64>(&stats.to_sums().unwrap());
        let what = format!("to_sums of {c} channels");
        let mut mean = Buf::new(&host::<f64>(&stats.mean), false);
        let mut var = Buf::new(&host::<f64>(&stats.var), false);
        let mut count = Buf::new(&[77.0f64], false);
        let mut got = Vec::new();
        for (how, count) in count_args(77, &mut count) {
            let what = format!("{what}, {how}");
            let mut sums = Buf::<f64>::poisoned(1 + 2 * c);
            let launch =
                to_sums_launch(OP, mean.channel(1), var.channel(1), c, count, sums.at()).unwrap();
            run_all(&[launch], c + 1, false, &what);
            got = sums.values(&what);
            assert_same(&got, &want, &what);
        }

        // Summed over three "processes", then back.
        let summed: Vec<f64> = got.iter().map(|v| 3.0 * v).collect();
        let back = Statistics::from_sums(&cpu(&summed, &[1 + 2 * c])).unwrap();
        let what = format!("from_sums of {c} channels");
        let mut sums = Buf::new(&summed, false);
        let mut mean = Buf::<f64>::poisoned(c);
        let mut var = Buf::<f64>::poisoned(c);
        let mut record = Record::new();
        let launch =
            from_sums_launch(OP, sums.channel(1), c, mean.at(), var.at(), record.slot()).unwrap();
        for small in [false, true] {
            run_all(std::slice::from_ref(&launch), c + 1, small, &what);
            assert_same(&mean.values(&what), &host::<f64>(&back.mean), &what);
            assert_same(&var.values(&what), &host::<f64>(&back.var), &what);
        }
        assert_eq!(record.claim[0], 0, "{what}: a good count recorded an error");
        assert_eq!(record.words, vec![0; 4], "{what}");
    }
}

#[test]
fn from_sums_checks_the_count_on_the_device_as_the_cpu_does() {
    // The CPU's verdict on each count against the kernel's record (the count stays on the
    // device on a GPU, so the kernel is where a bad one is found).
    let counts = [
        2.0,
        3.0,
        1e15,
        1.0,
        0.0,
        -4.0,
        2.5,
        f64::NAN,
        f64::INFINITY,
        2f64.powi(53),
    ];
    for c in [0usize, 3] {
        for count in counts {
            let what = format!("from_sums of {c} channels with a count of {count}");
            let mut values = vec![count];
            values.extend((0..2 * c).map(|i| 1.0 + i as f64));
            let cpu_ok = Statistics::from_sums(&cpu(&values, &[1 + 2 * c])).is_ok();
            assert_eq!(cpu_ok, phases::check_count(count).is_ok(), "{what}");
            let mut sums = Buf::new(&values, false);
            let mut mean = Buf::<f64>::poisoned(c);
            let mut var = Buf::<f64>::poisoned(c);
            let mut record = Record::new();
            let launch =
                from_sums_launch(OP, sums.channel(1), c, mean.at(), var.at(), record.slot())
                    .unwrap();
            run_all(&[launch], c + 1, false, &what);
            mean.values(&what);
            var.values(&what);
            if cpu_ok {
                assert_eq!(record.claim[0], 0, "{what}: recorded");
                assert_eq!(record.words, vec![0; 4], "{what}");
            } else {
                assert_eq!(record.claim[0], 1, "{what}: not recorded");
                assert_eq!(record.words[0], 5, "{what}: code");
                assert_eq!(record.words[1], 0, "{what}: position");
                assert_eq!(
                    f64::from_bits(record.words[2] as u64).to_bits(),
                    count.to_bits(),
                    "{what}: the count's bits"
                );
                assert_eq!(record.words[3], 2, "{what}: bound");
            }
        }
    }
}

fn check_update_running<R: Element>(c: usize, stride: usize, with_var: bool) {
    let stats = cpu_stats(c, 9, 40 + c as u64);
    let start_mean = values::<R>(c, 0.1, 1.0, 1);
    let start_var: Vec<R> = values::<f64>(c, 1.0, 0.5, 2)
        .into_iter()
        .map(R::from_f64)
        .collect();
    let (rm, rv) = (cpu(&start_mean, &[c]), cpu(&start_var, &[c]));
    phases::update_running(&RunningUpdate {
        running_mean: Some(&rm),
        running_var: with_var.then_some(&rv),
        stats: &stats,
        momentum: 0.1,
    })
    .unwrap();
    let what = format!(
        "update_running {} {c} channels, stride {stride}, var {with_var}",
        R::DTYPE
    );
    // Strided running vectors: every other element belongs to them.
    let spread = |v: &[R]| -> Vec<R> {
        v.iter()
            .flat_map(|&e| std::iter::once(e).chain(std::iter::repeat_n(poison::<R>(), stride - 1)))
            .collect()
    };
    let mut mean = Buf::new(&host::<f64>(&stats.mean), false);
    let mut var = Buf::new(&host::<f64>(&stats.var), false);
    let mut count = Buf::new(&[9.0f64], false);
    for (how, count) in count_args(9, &mut count) {
        let what = format!("{what}, {how}");
        let mut running_mean = Buf::new(&spread(&start_mean), false);
        let mut running_var = Buf::new(&spread(&start_var), false);
        let rv_arg = if with_var {
            running_var.channel(stride)
        } else {
            ChannelArg::absent()
        };
        let launch = update_running_launch(
            OP,
            running_mean.channel(stride),
            rv_arg,
            mean.channel(1),
            var.channel(1),
            c,
            0.1,
            count,
        )
        .unwrap();
        run_all(&[launch], c, false, &what);
        assert_same(&running_mean.values(&what), &spread(&host::<R>(&rm)), &what);
        let want_var = if with_var {
            host::<R>(&rv)
        } else {
            start_var.clone()
        };
        assert_same(&running_var.values(&what), &spread(&want_var), &what);
    }
}

#[test]
fn the_running_update_matches_the_cpu_bit_for_bit() {
    for c in [1usize, 3, 300] {
        for stride in [1, 2] {
            check_update_running::<f32>(c, stride, true);
            check_update_running::<f64>(c, stride, true);
        }
        check_update_running::<f32>(c, 1, false);
    }
}

fn check_normalization<P: Element>(c: usize, affine: bool, stride: usize) {
    let stats = cpu_stats(c, 9, 60 + c as u64);
    let weight = values::<P>(c, 1.0, 0.5, 3);
    let bias = values::<P>(c, 0.0, 0.5, 4);
    let (w, b) = (cpu(&weight, &[c]), cpu(&bias, &[c]));
    let eps = 1e-5;
    let want = phases::normalization(&NormalizationArgs {
        mean: &stats.mean,
        var: &stats.var,
        weight: affine.then_some(&w),
        bias: affine.then_some(&b),
        eps,
    })
    .unwrap();
    let what = format!(
        "normalization {} {c} channels, affine {affine}, stride {stride}",
        P::DTYPE
    );
    let spread = |v: &[P]| -> Vec<P> {
        v.iter()
            .flat_map(|&e| {
                std::iter::once(e).chain(std::iter::repeat_n(P::from_f64(99.0), stride - 1))
            })
            .collect()
    };
    let mut mean = Buf::new(&host::<f64>(&stats.mean), false);
    let mut var = Buf::new(&host::<f64>(&stats.var), false);
    let mut wb = Buf::new(&spread(&weight), false);
    let mut bb = Buf::new(&spread(&bias), false);
    let (w_arg, b_arg) = if affine {
        (wb.channel(stride), bb.channel(stride))
    } else {
        (ChannelArg::absent(), ChannelArg::absent())
    };
    let mut table = Buf::<f64>::poisoned(4 * c);
    let launch = normalization_launch(
        OP,
        mean.channel(1),
        var.channel(1),
        w_arg,
        b_arg,
        c,
        eps,
        table.at(),
    )
    .unwrap();
    run_all(&[launch], c, false, &what);
    assert_same(&table.values(&what), &host::<f64>(want.table()), &what);
}

#[test]
fn the_normalization_table_matches_the_cpu_bit_for_bit() {
    for c in [1usize, 4, 300] {
        for affine in [false, true] {
            check_normalization::<f32>(c, affine, 1);
            check_normalization::<f64>(c, affine, 1);
        }
        check_normalization::<f32>(c, true, 3);
    }
}

// ---- elementwise passes ------------------------------------------------------------------

/// A CPU normalization for an input of `dims` in `T`, from its own batch statistics (or
/// made-up ones for an empty batch).
fn cpu_norm<T: Element>(x: &Tensor, dims: Dims, seed: u64) -> Normalization {
    let stats = if dims.per_channel() > 1 {
        phases::statistics(x).unwrap()
    } else {
        cpu_stats(dims.c, 2, seed)
    };
    let weight = cpu(&values::<T>(dims.c, 0.5, 1.0, seed + 5), &[dims.c]);
    let bias = cpu(&values::<T>(dims.c, 0.0, 0.7, seed + 6), &[dims.c]);
    phases::normalization(&NormalizationArgs {
        mean: &stats.mean,
        var: &stats.var,
        weight: Some(&weight),
        bias: Some(&bias),
        eps: 1e-5,
    })
    .unwrap()
}

fn check_apply<T: Element>(shape: [usize; 3], misaligned: bool, seed: u64) {
    let dims = Dims::of(&shape);
    let x = values::<T>(dims.numel(), 0.3, 2.0, seed);
    let r = values::<T>(dims.numel(), 0.0, 1.0, seed + 1);
    let (xt, rt) = (cpu(&x, &shape), cpu(&r, &shape));
    let norm = cpu_norm::<T>(&xt, dims, seed);
    let table = host::<f64>(norm.table());
    for (name, epilogue) in [
        ("plain", Epilogue::Plain),
        ("relu", Epilogue::Relu),
        ("add+relu", Epilogue::AddRelu(&rt)),
    ] {
        let want = host::<T>(
            &phases::apply(&ApplyArgs {
                x: &xt,
                norm: &norm,
                epilogue,
            })
            .unwrap(),
        );
        for small in [false, true] {
            let what = format!(
                "apply {name} {} {shape:?}{}{}",
                T::DTYPE,
                if small { ", small grid" } else { "" },
                if misaligned { ", misaligned" } else { "" }
            );
            let mut xb = Buf::new(&x, false);
            let mut rb = Buf::new(&r, misaligned);
            let mut out = Buf::<T>::poisoned(dims.numel());
            let mut tb = Buf::new(&table, false);
            let ep = match epilogue {
                Epilogue::Plain => ApplyEpilogue::Plain,
                Epilogue::Relu => ApplyEpilogue::Relu,
                Epilogue::AddRelu(_) => ApplyEpilogue::AddRelu(rb.at()),
            };
            let launch = apply_launch(OP, xb.at(), ep, out.at(), T::DTYPE, dims, tb.at()).unwrap();
            run_all(&[launch], dims.numel(), small, &what);
            assert_same(&out.values(&what), &want, &what);
            assert_same(&rb.values(&what), &r, &format!("{what}: residual changed"));
        }
    }
}

#[test]
fn apply_and_its_epilogues_match_the_cpu_bit_for_bit() {
    for (i, shape) in SHAPES.into_iter().enumerate() {
        for misaligned in [false, true] {
            check_apply::<f32>(shape, misaligned, 100 + i as u64);
            check_apply::<f64>(shape, misaligned, 150 + i as u64);
        }
    }
}

// ---- backward ----------------------------------------------------------------------------

fn mask_name(mask: GradMask<'_>) -> &'static str {
    match mask {
        GradMask::None => "no mask",
        GradMask::Relu => "relu mask",
        GradMask::Output(_) => "output mask",
    }
}

fn check_backward<T: Element>(shape: [usize; 3], misaligned: bool, seed: u64) {
    let dims = Dims::of(&shape);
    let x = values::<T>(dims.numel(), 0.3, 2.0, seed);
    let g = values::<T>(dims.numel(), 0.1, 1.0, seed + 1);
    let r = values::<T>(dims.numel(), 0.0, 1.0, seed + 2);
    let (xt, gt, rt) = (cpu(&x, &shape), cpu(&g, &shape), cpu(&r, &shape));
    let norm = cpu_norm::<T>(&xt, dims, seed);
    let table = host::<f64>(norm.table());
    let y = phases::apply(&ApplyArgs {
        x: &xt,
        norm: &norm,
        epilogue: Epilogue::AddRelu(&rt),
    })
    .unwrap();
    let yv = host::<T>(&y);
    let tol = tolerance(T::DTYPE);
    for mask in [GradMask::None, GradMask::Relu, GradMask::Output(&y)] {
        let want = phases::backward_reduce(&BackwardReduceArgs {
            grad: &gt,
            x: &xt,
            norm: &norm,
            mask,
        })
        .unwrap();
        let want_sums = host::<f64>(&want.sums);
        // Σ|g|·(|x| + |mean|) bounds the rounding of both sums.
        let scale: Vec<f64> = (0..2 * dims.c)
            .map(|_| {
                g.iter()
                    .zip(&x)
                    .map(|(g, x)| g.to_f64().abs() * (1.0 + x.to_f64().abs()))
                    .sum::<f64>()
                    + 1.0
            })
            .collect();
        for (name, split) in splits(dims) {
            for small in [false, true] {
                let what = format!(
                    "backward_reduce {} {} {shape:?} {name}{}{}",
                    mask_name(mask),
                    T::DTYPE,
                    if small { ", small grid" } else { "" },
                    if misaligned { ", misaligned" } else { "" }
                );
                let mut gb = Buf::new(&g, misaligned);
                let mut xb = Buf::new(&x, false);
                let mut yb = Buf::new(&yv, false);
                let mut masked = Buf::<T>::poisoned(dims.numel());
                let mut tb = Buf::new(&table, false);
                let mut partials = Buf::<f64>::poisoned(split.partials_len(dims));
                let mut sums = Buf::<f64>::poisoned(2 * dims.c);
                let reduce_mask = match mask {
                    GradMask::None => ReduceMask::None,
                    GradMask::Relu => ReduceMask::Relu,
                    GradMask::Output(_) => ReduceMask::Output {
                        output: yb.at(),
                        masked: masked.at(),
                    },
                };
                let partials_at = if split.splits > 1 { partials.at() } else { 0 };
                let launches = backward_reduce_launches(
                    OP,
                    gb.at(),
                    xb.at(),
                    reduce_mask,
                    T::DTYPE,
                    dims,
                    split,
                    tb.at(),
                    partials_at,
                    sums.at(),
                )
                .unwrap();
                run_all(&launches, dims.c, small, &what);
                assert_close(
                    &sums.values(&what),
                    &want_sums,
                    &scale,
                    tol,
                    &format!("{what}: sums"),
                );
                let want_masked = match &want.grad {
                    Some(m) => host::<T>(m),
                    None => vec![poison::<T>(); dims.numel()],
                };
                assert_same(
                    &masked.values(&what),
                    &want_masked,
                    &format!("{what}: masked gradient"),
                );
                partials.values(&what);
                assert_same(&gb.values(&what), &g, &format!("{what}: gradient changed"));
            }
        }

        // The input and parameter gradients from the CPU's sums.
        let g_bn = want.grad.as_ref().unwrap_or(&gt);
        let g_bn_values = host::<T>(g_bn);
        let relu_mask = matches!(mask, GradMask::Relu);
        for training in [true, false] {
            let count = dims.per_channel();
            if training && count == 0 {
                continue;
            }
            let want_gx = host::<T>(
                &phases::backward_apply(&BackwardApplyArgs {
                    grad: g_bn,
                    x: &xt,
                    norm: &norm,
                    sums: &want.sums,
                    count: &Count::Host(count),
                    training,
                    relu_mask,
                })
                .unwrap(),
            );
            let mut count_buf = Buf::new(&[count as f64], false);
            for (small, (how, count)) in [false, true]
                .into_iter()
                .flat_map(|small| count_args(count, &mut count_buf).map(|c| (small, c)))
            {
                let what = format!(
                    "backward_apply {} training {training} {} {shape:?}{}{}, {how}",
                    mask_name(mask),
                    T::DTYPE,
                    if small { ", small grid" } else { "" },
                    if misaligned { ", misaligned" } else { "" }
                );
                let mut gb = Buf::new(&g_bn_values, false);
                let mut xb = Buf::new(&x, misaligned);
                let mut out = Buf::<T>::poisoned(dims.numel());
                let mut tb = Buf::new(&table, false);
                let mut sb = Buf::new(&want_sums, false);
                let sums_at = sb.at();
                let sums_arg = SumsArg {
                    sum_g: ChannelArg::new(OP, "sum_g", sums_at, 1, DType::F64).unwrap(),
                    sum_centered: ChannelArg::new(
                        OP,
                        "sum_centered",
                        sums_at + (8 * dims.c) as u64,
                        1,
                        DType::F64,
                    )
                    .unwrap(),
                };
                let mut coefficients = Buf::<T>::poisoned(4 * dims.c);
                let [coefs, apply] = backward_apply_launches(
                    OP,
                    gb.at(),
                    xb.at(),
                    out.at(),
                    T::DTYPE,
                    dims,
                    tb.at(),
                    sums_arg,
                    count,
                    training,
                    relu_mask,
                    coefficients.at(),
                )
                .unwrap();
                run_all(&[coefs], dims.c, small, &what);
                run_all(&[apply], dims.numel(), small, &what);
                assert_same(&out.values(&what), &want_gx, &what);
                coefficients.values(&what);
            }
        }
    }
}

#[test]
fn backward_reduce_and_apply_match_the_cpu_for_every_mask() {
    for (i, shape) in SHAPES.into_iter().enumerate() {
        for misaligned in [false, true] {
            check_backward::<f32>(shape, misaligned, 200 + i as u64);
            check_backward::<f64>(shape, misaligned, 250 + i as u64);
        }
    }
}

fn check_parameter_gradients<T: Element>(c: usize, sums_stride: usize) {
    let x = cpu(&values::<f64>(3 * c * 4, 0.2, 1.0, 5), &[3, c, 4]);
    let norm = cpu_norm::<f64>(&x, Dims { n: 3, c, l: 4 }, 8);
    let sums_values = values::<f64>(2 * c, 0.5, 10.0, 9);
    let sums = cpu(&sums_values, &[2, c]);
    let (want_w, want_b) = phases::parameter_gradients(&sums, &norm, T::DTYPE).unwrap();
    let what = format!(
        "parameter_gradients {} {c} channels, sums stride {sums_stride}",
        T::DTYPE
    );
    // The sums as a [2, C] view with column stride `sums_stride`.
    let mut spread = vec![f64::NAN; 2 * c * sums_stride];
    for (i, v) in sums_values.iter().enumerate() {
        spread[i * sums_stride] = *v;
    }
    let mut sb = Buf::new(&spread, false);
    let at = sb.at();
    let sums_arg = SumsArg {
        sum_g: ChannelArg::new(OP, "sum_g", at, sums_stride, DType::F64).unwrap(),
        sum_centered: ChannelArg::new(
            OP,
            "sum_centered",
            at + (8 * c * sums_stride) as u64,
            sums_stride,
            DType::F64,
        )
        .unwrap(),
    };
    let mut tb = Buf::new(&host::<f64>(norm.table()), false);
    let mut gw = Buf::<T>::poisoned(c);
    let mut gb = Buf::<T>::poisoned(c);
    let launch =
        parameter_gradients_launch(OP, sums_arg, tb.at(), c, T::DTYPE, gw.at(), gb.at()).unwrap();
    run_all(&[launch], c, false, &what);
    assert_same(
        &gw.values(&what),
        &host::<T>(&want_w),
        &format!("{what}: weight"),
    );
    assert_same(
        &gb.values(&what),
        &host::<T>(&want_b),
        &format!("{what}: bias"),
    );
}

#[test]
fn parameter_gradients_match_the_cpu_bit_for_bit() {
    for c in [1usize, 5, 300] {
        for stride in [1, 2] {
            check_parameter_gradients::<f32>(c, stride);
            check_parameter_gradients::<f64>(c, stride);
        }
    }
}

#[test]
fn count_batch_adds_one_in_place() {
    let mut counter = Buf::new(&[41i64], false);
    let launch = count_batch_launch(OP, counter.at()).unwrap();
    run_all(std::slice::from_ref(&launch), 1, false, "count_batch");
    run_all(&[launch], 1, false, "count_batch");
    assert_eq!(counter.values("count_batch"), vec![43]);
}
