//! A SyncBatchNorm forward on a GPU never blocks the host (issue 19, defect 7): the count of
//! the all-reduced statistics stays on the device, so no layer copies anything from the device
//! to the host. Two ranks as threads sharing `cuda:0` ([`DeviceThreadGroup`]); prints
//! runs on the CUDA emulator without a GPU.

use std::sync::Arc;

use tandem_core::cuda::device_to_host_copies;
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_dist::{DeviceThreadGroup, ProcessGroup, SyncBatchNorm};
use tandem_nn::{BatchNormConfig, Fused, Module};

const GPU: Device = Device::Cuda(0);

#[test]
fn a_sync_batch_norm_forward_copies_nothing_from_the_device_to_the_host() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let groups = DeviceThreadGroup::new_group(GPU, 2).unwrap();
    let copies: Vec<(u64, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                s.spawn(move || {
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let bn = Arc::new(BatchNormConfig::new(4).init().unwrap());
                    bn.to_device(GPU).unwrap();
                    let layer = SyncBatchNorm::new(bn, group);
                    let mut gen = Generator::new(10 + rank as u64);
                    let x =
                        Tensor::randn(&[3, 4, 6, 6], 0.5, 2.0, DType::F32, Device::Cpu, &mut gen)
                            .unwrap()
                            .to_device(GPU)
                            .unwrap();
                    // Once to compile the kernels, then counted.
                    layer.forward(&x).unwrap();
                    let before = device_to_host_copies();
                    let mut y = None;
                    for _ in 0..3 {
                        y = Some(layer.forward_relu(&x).unwrap());
                    }
                    let copies = device_to_host_copies() - before;
                    (copies, y.unwrap().to_vec::<f32>().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (n, y)) in copies.iter().enumerate() {
        assert_eq!(
            *n, 0,
            "rank {rank}: three SyncBatchNorm forwards copied {n} times from the device"
        );
        assert!(y.iter().all(|v| v.is_finite() && *v >= 0.0), "rank {rank}");
    }
}
