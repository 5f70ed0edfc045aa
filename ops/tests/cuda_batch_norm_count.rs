//! GPU checks of batch norm's count of all-reduced statistics staying on the device (issue 19,
//! defect 7); each prints runs on the CUDA emulator without a GPU.
//!
//! SyncBatchNorm's phases — statistics, sums, (all-reduce), `from_sums`, running update,
//! normalization, apply, and in backward the reduce and apply with the reduced count — must not
//! copy anything from the device to the host: such a copy blocks the host on the all-reduce in
//! every layer of every forward. A bad reduced count is found by the kernel and reported, with
//! the CPU's message, at the next host read.
//!
//! One test in its own binary: the deferred-error record is per device, and another test's
//! read of the device could report the bad count this test provokes.

use tandem_core::cuda::device_to_host_copies;
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_ops::batch_norm::phases::{
    self, ApplyArgs, BackwardApplyArgs, BackwardReduceArgs, GradMask, NormalizationArgs,
    RunningUpdate, Statistics,
};
use tandem_ops::batch_norm::Epilogue;

const GPU: Device = Device::Cuda(0);

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn(shape, 0.2, 1.0, DType::F32, Device::Cpu, &mut g).unwrap()
}

/// The phases of a SyncBatchNorm forward and backward on `x` (the "all-reduce" doubles the
/// sums, as two ranks with the same batch would), on `x`'s device; returns the output, the
/// input gradient and the running variance.
fn sync_phases(x: &Tensor, g: &Tensor, running_var: &Tensor) -> (Tensor, Tensor) {
    let sums = phases::statistics(x).unwrap().to_sums().unwrap();
    sums.scale_(2.0).unwrap();
    let stats = Statistics::from_sums(&sums).unwrap();
    phases::update_running(&RunningUpdate {
        running_mean: None,
        running_var: Some(running_var),
        stats: &stats,
        momentum: 0.1,
    })
    .unwrap();
    let norm = phases::normalization(&NormalizationArgs {
        mean: &stats.mean,
        var: &stats.var,
        weight: None,
        bias: None,
        eps: 1e-5,
    })
    .unwrap();
    let y = phases::apply(&ApplyArgs {
        x,
        norm: &norm,
        epilogue: Epilogue::Plain,
    })
    .unwrap();
    let reduced = phases::backward_reduce(&BackwardReduceArgs {
        grad: g,
        x,
        norm: &norm,
        mask: GradMask::None,
    })
    .unwrap();
    reduced.sums.scale_(2.0).unwrap();
    let gx = phases::backward_apply(&BackwardApplyArgs {
        grad: g,
        x,
        norm: &norm,
        sums: &reduced.sums,
        count: &stats.count,
        training: true,
        relu_mask: false,
    })
    .unwrap();
    (y, gx)
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    let (a, b) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
        assert!(
            (p - q).abs() <= 1e-4 * (1.0 + q.abs()),
            "{what}[{i}]: {p} on cuda:0, {q} on the cpu"
        );
    }
}

#[test]
fn sync_batch_norm_phases_keep_the_count_on_the_device_and_check_it_there() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let (x, g) = (randn(&[4, 3, 5, 5], 1), randn(&[4, 3, 5, 5], 2));
    let rv = Tensor::ones(&[3], DType::F32, Device::Cpu).unwrap();
    let (xg, gg, rvg) = (
        x.to_device(GPU).unwrap(),
        g.to_device(GPU).unwrap(),
        rv.to_device(GPU).unwrap(),
    );
    // Once to compile the kernels, then counted.
    sync_phases(&xg, &gg, &rvg);
    let before = device_to_host_copies();
    let (y, gx) = sync_phases(&xg, &gg, &rvg);
    assert_eq!(
        device_to_host_copies(),
        before,
        "the phases of a SyncBatchNorm step copied from the device to the host"
    );
    // And the results are the CPU's (whose count is read on the host).
    let rv_cpu = Tensor::ones(&[3], DType::F32, Device::Cpu).unwrap();
    sync_phases(&x, &g, &rv_cpu);
    let (y_cpu, gx_cpu) = sync_phases(&x, &g, &rv_cpu);
    assert_close("output", &y, &y_cpu);
    assert_close("input gradient", &gx, &gx_cpu);
    assert_close("running variance", &rvg, &rv_cpu);

    // Sums whose count is 1: the CPU's error, from the kernel, at the next read.
    let one = Tensor::from_vec(vec![1.0f64, 0.5, 0.25], &[3], Device::Cpu).unwrap();
    let cpu = Statistics::from_sums(&one)
        .expect_err("a count of 1 on the cpu")
        .to_string();
    let stats = Statistics::from_sums(&one.to_device(GPU).unwrap())
        .expect("on cuda the count is checked on the device");
    assert!(stats.count.on_host().is_none());
    let gpu = stats
        .mean
        .to_vec::<f64>()
        .expect_err("a count of 1 on cuda, reported at the next read")
        .to_string();
    assert!(
        gpu.starts_with(&cpu),
        "from_sums with a count of 1: {gpu} vs {cpu}"
    );
    // Reported once: the device is usable again.
    assert_eq!(stats.var.to_vec::<f64>().unwrap().len(), 1);
}
