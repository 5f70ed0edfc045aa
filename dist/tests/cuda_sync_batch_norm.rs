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

/// The output and the gradients of the input, the residual, the weight and the bias of one
/// fused SyncBatchNorm (add + ReLU) forward and backward, as host vectors.
fn fused_run(
    layer: &dyn Fused,
    bn: &tandem_nn::BatchNorm2d,
    inputs: [&Tensor; 3],
) -> [Vec<f32>; 5] {
    let [x, r, g] = inputs;
    let (x, r) = (
        x.detach().with_requires_grad().unwrap(),
        r.detach().with_requires_grad().unwrap(),
    );
    let y = layer.forward_add_relu(&x, &r).unwrap();
    tandem_autograd::backward(&y, Some(g), &Default::default()).unwrap();
    let host = |t: Option<Tensor>| t.map_or(vec![], |t| t.to_vec::<f32>().unwrap());
    [
        host(Some(y)),
        host(x.grad()),
        host(r.grad()),
        host(bn.weight().unwrap().grad()),
        host(bn.bias().unwrap().grad()),
    ]
}

/// A joined rank's shadow step (`DistributedDataParallel::join`) runs SyncBatchNorm on a batch of
/// no samples: on the device it contributes zero statistics and zero gradient sums without
/// running a kernel over the empty batch, so the other rank's results are exactly those of its
/// own samples (a plain batch norm on the CPU), and its own gradients are zero.
#[test]
fn an_empty_batch_on_one_rank_contributes_nothing_on_the_device() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let shape = [3, 2, 2, 3];
    let mut gen = Generator::new(5);
    let mut randn = || Tensor::randn(&shape, 0.2, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
    let (x, r, g) = (randn(), randn(), randn());
    let cpu_bn = BatchNormConfig::new(2).init().unwrap();
    let want = fused_run(&cpu_bn, &cpu_bn, [&x, &r, &g]);
    let groups = DeviceThreadGroup::new_group(GPU, 2).unwrap();
    let got: Vec<[Vec<f32>; 5]> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let (x, r, g) = (&x, &r, &g);
                s.spawn(move || {
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let bn = Arc::new(BatchNormConfig::new(2).init().unwrap());
                    bn.to_device(GPU).unwrap();
                    let layer = SyncBatchNorm::new(bn.clone(), group);
                    let on_gpu = |t: &Tensor| match rank {
                        0 => t.to_device(GPU).unwrap(),
                        _ => Tensor::zeros(&[0, 2, 2, 3], DType::F32, GPU).unwrap(),
                    };
                    fused_run(&layer, &bn, [&on_gpu(x), &on_gpu(r), &on_gpu(g)])
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let names = [
        "output",
        "input grad",
        "residual grad",
        "weight grad",
        "bias grad",
    ];
    for (k, name) in names.iter().enumerate() {
        assert_eq!(got[0][k].len(), want[k].len(), "{name}");
        for (a, b) in got[0][k].iter().zip(&want[k]) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "rank 0 {name}: {a} vs {b}"
            );
        }
    }
    assert!(
        got[1][0].is_empty() && got[1][1].is_empty(),
        "rank 1's empty batch"
    );
    assert_eq!(got[1][3], vec![0.0; 2], "rank 1's weight grad");
    assert_eq!(got[1][4], vec![0.0; 2], "rank 1's bias grad");
}
