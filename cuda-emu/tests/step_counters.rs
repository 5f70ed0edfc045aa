//! A training step on the emulated GPU, counted (the emulator's counters, `src/counters.rs`):
//! ResNet-20 and LeNet-5, forward, cross entropy, backward and SGD with momentum, after warm-up
//! steps. The step must never make the host wait for the device — the host has to stay ahead
//! of the GPU, or every wait leaves the GPU idle for a launch's latency and the host's time to
//! refill the queue — except where the user asks: reading the loss, one synchronisation.
//!
//! Each test prints the step's launches, copies and bytes, memsets, pool allocations and misses,
//! cuBLAS products and cuDNN convolutions (`cargo test -p tandem-cuda-emu --test step_counters -- --nocapture`);
//! BENCHMARKS.md records them. A failure names the synchronisations; rerun with
//! `TANDEM_TRACE_HOST_SYNCS=1` to print the call stack of each.

mod common;

use std::sync::Mutex;

use tandem_autograd::TensorBackward;
use tandem_core::rng::manual_seed;
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_cuda_emu::counters::Counters;
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::Module;
use tandem_optim::{Optimizer, Sgd, SgdConfig};

const GPU: Device = Device::Cuda(0);

/// The counters are process-wide: one measured step at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// What one training step asked of the device, and what reading its loss did.
struct StepCounts {
    /// From the first op of the step to the end of the optimizer's step.
    step: Counters,
    /// `loss.item()` after the step.
    read: Counters,
}

/// Something a step may do besides training, to check that the counters see it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Extra {
    Nothing,
    /// Reads the logits on the host inside the step (a `to_vec`, as an op that peeks would).
    ReadLogits,
}

/// Trains `model` (inputs `batch × sample`, `classes` classes) for `warmup` steps, then counts
/// one more step and the read of its loss.
fn count_a_step(
    model: &dyn Module,
    sample: &[usize],
    classes: usize,
    batch: usize,
    warmup: usize,
    extra: Extra,
) -> StepCounts {
    common::use_emulator();
    let dev = tandem_core::cuda::device(0).expect("the emulated cuda:0");
    if std::env::var_os("TANDEM_TRACE_HOST_SYNCS").is_some() {
        common::trace_host_syncs(true);
    }
    model.to_device(GPU).unwrap();
    model.train();
    let mut optimizer =
        Sgd::new(model.parameters(), SgdConfig::new(0.01).with_momentum(0.9)).unwrap();
    let mut generator = Generator::new(7);
    let mut shape = vec![batch];
    shape.extend(sample);
    let inputs = Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut generator)
        .unwrap()
        .to_device(GPU)
        .unwrap();
    let labels: Vec<i64> = (0..batch)
        .map(|_| generator.below(classes) as i64)
        .collect();
    let targets = Tensor::from_vec(labels, &[batch], Device::Cpu)
        .unwrap()
        .to_device(GPU)
        .unwrap();
    let mut step = |extra: Extra| -> Tensor {
        let logits = model.forward(&inputs).unwrap();
        if extra == Extra::ReadLogits {
            let _ = logits.to_vec::<f32>().unwrap();
        }
        let loss = cross_entropy(&logits, &targets, Reduction::Mean).unwrap();
        optimizer.zero_grad().unwrap();
        loss.backward().unwrap();
        optimizer.step().unwrap();
        loss
    };
    // Warm-up: kernels compiled, optimizer state created, the pool filled.
    for _ in 0..warmup {
        let loss = step(Extra::Nothing);
        assert!(loss.item().unwrap().is_finite());
    }
    dev.synchronize().unwrap();

    let before = common::counters();
    let loss = step(extra);
    let stepped = common::counters();
    let value = loss.item().unwrap();
    let read = common::counters();
    assert!(value.is_finite(), "loss {value}");
    common::trace_host_syncs(false);
    StepCounts {
        step: stepped.since(&before),
        read: read.since(&stepped),
    }
}

/// One line per counter that moved, for the test's output and failure messages.
fn table(c: &Counters) -> String {
    c.fields()
        .into_iter()
        .filter(|&(_, v)| v > 0)
        .map(|(name, v)| format!("  {name:<20} {v:>10}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The step must not synchronise, and reading the loss must be one synchronisation.
fn check(name: &str, counts: &StepCounts) {
    println!(
        "{name}: one training step on the emulated GPU\n{}\nreading the loss:\n{}",
        table(&counts.step),
        table(&counts.read)
    );
    let s = &counts.step;
    assert_eq!(
        s.host_syncs,
        0,
        "{name}: the training step made the host wait for the device {} time(s) (stream {}, \
         event {}, context {}, blocking copies {}, blocking frees {}); rerun with \
         TANDEM_TRACE_HOST_SYNCS=1 to see where\n{}",
        s.host_syncs,
        s.stream_syncs,
        s.event_syncs,
        s.context_syncs,
        s.blocking_copies,
        s.blocking_frees,
        table(s)
    );
    assert_eq!(
        (s.driver_allocations, s.pinned_allocations),
        (0, 0),
        "{name}: the step allocated outside the pool (cuMemAlloc, pinned memory)"
    );
    assert!(
        s.launches > 0,
        "{name}: no kernel launched: not on the GPU?"
    );
    assert_eq!(
        counts.read.host_syncs,
        1,
        "{name}: reading the loss is one synchronisation\n{}",
        table(&counts.read)
    );
}

#[test]
fn a_resnet20_training_step_never_waits_for_the_device() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    manual_seed(0);
    let model = tandem_nn::models::resnet20().unwrap();
    let counts = count_a_step(&model, &[3, 32, 32], 10, 2, 2, Extra::Nothing);
    check("ResNet-20, batch 2×3×32×32", &counts);
    // The emulator has cuDNN: the convolutions run through it, the classifier through cuBLAS.
    assert!(
        counts.step.convolutions > 0,
        "convolutions run through cuDNN:\n{}",
        table(&counts.step)
    );
    assert!(counts.step.gemms > 0, "the classifier runs through cuBLAS");
}

#[test]
fn a_lenet5_training_step_never_waits_for_the_device() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    manual_seed(0);
    let model = tandem_nn::models::lenet5().unwrap();
    let counts = count_a_step(&model, &[1, 28, 28], 10, 64, 2, Extra::Nothing);
    check("LeNet-5, batch 64×1×28×28", &counts);
}

/// The check itself: a host read of the logits inside the step is caught.
#[test]
fn a_host_read_inside_the_step_is_counted() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    manual_seed(0);
    let model = tandem_nn::models::lenet5().unwrap();
    let counts = count_a_step(&model, &[1, 28, 28], 10, 4, 1, Extra::ReadLogits);
    assert!(
        counts.step.host_syncs >= 1,
        "a to_vec inside the step is a host synchronisation:\n{}",
        table(&counts.step)
    );
    assert!(counts.step.copies_dtoh >= 1 && counts.step.bytes_dtoh >= 4 * 10 * 4);
}
