//! Deferred device errors (`tandem_core::cuda::deferred`) belong to the thread whose work
//! recorded them: two threads share `cuda:0` (and its compute stream) as the ranks of a
//! `DeviceThreadGroup` do; one runs `cross_entropy` with a label out of range, the other only
//! clean work. The clean thread's reads never see the other's error, the bad thread's next read
//! reports its own, and an error whose thread exited without reading it still surfaces (at the
//! next read on the device, naming that thread). One test, in phases: the last phase reports
//! an error at any thread's read, so nothing else may run in this process beside it.

mod common;

use std::sync::{Arc, Barrier};

use tandem_core::cuda;
use tandem_core::{DType, Device, Tensor};
use tandem_ops::Reduction;

const GPU: Device = Device::Cuda(0);

fn logits() -> Tensor {
    let v: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
    Tensor::from_vec(v, &[4, 3], Device::Cpu)
        .unwrap()
        .to_device(GPU)
        .unwrap()
}

fn targets(bad: i64) -> Tensor {
    Tensor::from_vec(vec![0i64, 2, bad, 1], &[4], Device::Cpu)
        .unwrap()
        .to_device(GPU)
        .unwrap()
}

/// The error a label of 7 at row 2 gives (the CPU op's words come first).
fn is_the_bad_label(err: &str) -> bool {
    (err.starts_with("cross_entropy:") || err.starts_with("nll_loss:"))
        && err.contains("target 7 at position 2")
}

#[test]
fn a_deferred_error_is_reported_to_the_thread_whose_kernel_found_it() {
    common::use_emulator();
    let dev = cuda::device(0).unwrap();
    let x = logits();
    dev.synchronize().unwrap();

    // Phase 1, many rounds: the bad thread issues a loss with label 7 (of 3 classes) and does
    // not read; then the clean thread reads its own work (the read waits for the bad kernel,
    // which ran before it on the shared stream); then the bad thread reads.
    let rounds = 20;
    let barrier = Arc::new(Barrier::new(2));
    let bad = {
        let (barrier, x) = (barrier.clone(), x.clone());
        std::thread::Builder::new()
            .name("bad-labels".into())
            .spawn(move || {
                for round in 0..rounds {
                    // Both losses that check labels, in turn.
                    let loss = if round % 2 == 0 {
                        tandem_ops::cross_entropy(&x, &targets(7), Reduction::Mean)
                    } else {
                        tandem_ops::nll_loss(&x, &targets(7), Reduction::Mean)
                    }
                    .unwrap_or_else(|e| panic!("round {round}: the op itself failed: {e}"));
                    barrier.wait(); // issued
                    barrier.wait(); // the clean thread has read
                    let err = loss
                        .item()
                        .expect_err("the bad thread's read reports its own bad label")
                        .to_string();
                    assert!(is_the_bad_label(&err), "round {round}: {err}");
                    // Reported once: the device is clean for this thread afterwards.
                    cuda::device(0)
                        .unwrap()
                        .synchronize()
                        .unwrap_or_else(|e| panic!("round {round}: reported twice: {e}"));
                }
            })
            .unwrap()
    };
    let clean = {
        let (barrier, x) = (barrier.clone(), x.clone());
        std::thread::Builder::new()
            .name("clean".into())
            .spawn(move || {
                for round in 0..rounds {
                    barrier.wait(); // the bad loss is issued
                    let loss = tandem_ops::cross_entropy(&x, &targets(1), Reduction::Sum)
                        .unwrap_or_else(|e| panic!("round {round}: the op itself failed: {e}"));
                    let v = loss.item().unwrap_or_else(|e| {
                        panic!("round {round}: the clean thread saw another's error: {e}")
                    });
                    assert!(v.is_finite(), "round {round}: {v}");
                    let sum = Tensor::full(&[8], 1.0, DType::F32, GPU)
                        .unwrap()
                        .to_vec::<f32>()
                        .unwrap_or_else(|e| panic!("round {round}: to_vec: {e}"));
                    assert_eq!(sum, vec![1.0; 8]);
                    cuda::device(0).unwrap().synchronize().unwrap_or_else(|e| {
                        panic!("round {round}: synchronize saw another's error: {e}")
                    });
                    barrier.wait(); // read
                }
            })
            .unwrap()
    };
    clean.join().expect("the clean thread");
    bad.join().expect("the bad thread");

    // Phase 2: a thread issues a bad loss and exits without reading it. The error is not lost:
    // the next read on the device reports it and names the thread.
    let x2 = x.clone();
    std::thread::Builder::new()
        .name("exits-unread".into())
        .spawn(move || {
            let _ = tandem_ops::cross_entropy(&x2, &targets(7), Reduction::None).unwrap();
        })
        .unwrap()
        .join()
        .unwrap();
    let err = dev
        .synchronize()
        .expect_err("an exited thread's error surfaces at the next read")
        .to_string();
    assert!(is_the_bad_label(&err), "{err}");
    assert!(err.contains("exits-unread"), "names the thread: {err}");
    dev.synchronize().expect("reported once");

    // Phase 3: many short-lived threads, each with its own bad label read by itself, more than
    // the device has records: records are reused, and every error reaches its own thread.
    for round in 0..300 {
        let x = x.clone();
        std::thread::spawn(move || {
            let loss = tandem_ops::cross_entropy(&x, &targets(7), Reduction::Mean).unwrap();
            let err = loss.item().expect_err("its own error").to_string();
            assert!(is_the_bad_label(&err), "round {round}: {err}");
        })
        .join()
        .unwrap_or_else(|_| panic!("round {round}"));
    }
    dev.synchronize().expect("nothing left over");
}
