//! GPU conformance of `Normalize::normalize_batch`: a `u8` image batch copied to `cuda:0` (as
//! the data loader delivers it) and normalised there must equal the same batch normalised on
//! the CPU, stay on the device, and be `f32`.
//!
//! Runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).

use tandem_core::{DType, Device, Tensor};
use tandem_nn::data::Normalize;

const GPU: Device = Device::Cuda(0);

#[test]
fn normalize_batch_on_cuda_matches_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let (b, h, w) = (3, 5, 7);
    let bytes: Vec<u8> = (0..b * 3 * h * w).map(|i| (i * 53 % 256) as u8).collect();
    let cpu_batch = Tensor::from_vec(bytes, &[b, 3, h, w], Device::Cpu).unwrap();
    let norm = Normalize::imagenet();
    let want = norm.normalize_batch(&cpu_batch).unwrap();
    let gpu_batch = cpu_batch.to_device(GPU).unwrap();
    for input in [gpu_batch.clone(), gpu_batch.to_dtype(DType::F32).unwrap()] {
        let got = norm.normalize_batch(&input).unwrap();
        assert_eq!(got.device(), GPU);
        assert_eq!((got.dims(), got.dtype()), (want.dims(), DType::F32));
        let (g, e) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        for (i, (g, e)) in g.iter().zip(&e).enumerate() {
            assert!(
                (g - e).abs() <= 1e-6 * (1.0 + e.abs()),
                "element {i} of {:?} {:?}: cuda {g}, cpu {e}",
                input.dtype(),
                want.dims()
            );
        }
    }
}

/// The path of an image batch in training: the loader copies `u8` batches to the GPU on its copy
/// stream, the compute stream waits for each copy and normalises there. Under the emulator's
/// stream sanitizer this also checks that the normalisation reads the copy only after it.
#[test]
fn loader_delivered_u8_batches_normalise_on_the_gpu() {
    use std::sync::Arc;
    use tandem_nn::data::{DataLoader, DataLoaderConfig, TensorDataset};
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let (n, h, w) = (10, 4, 3);
    let bytes: Vec<u8> = (0..n * 3 * h * w).map(|i| (i * 29 % 256) as u8).collect();
    let images = Tensor::from_vec(bytes, &[n, 3, h, w], Device::Cpu).unwrap();
    let labels = Tensor::from_vec((0..n as i64).collect(), &[n], Device::Cpu).unwrap();
    let dataset = Arc::new(TensorDataset::new(images.clone(), labels).unwrap());
    let config = DataLoaderConfig {
        batch_size: 4,
        device: GPU,
        ..Default::default()
    };
    let loader = DataLoader::new(dataset, config).unwrap();
    let norm = Normalize::imagenet();
    let mut seen = 0;
    for batch in loader.iter() {
        let batch = batch.unwrap();
        assert_eq!(
            (batch.inputs.device(), batch.inputs.dtype()),
            (GPU, DType::U8)
        );
        let got = norm
            .normalize_batch(&batch.inputs)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let rows = batch.inputs.dims()[0];
        let cpu_rows = tandem_ops::narrow(&images, 0, seen, rows).unwrap();
        let want = norm
            .normalize_batch(&cpu_rows)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(got.len(), want.len());
        for (g, e) in got.iter().zip(&want) {
            assert!(
                (g - e).abs() <= 1e-6 * (1.0 + e.abs()),
                "rows {seen}..: {g} vs {e}"
            );
        }
        seen += rows;
    }
    assert_eq!(seen, n);
}

/// `DataLoaderConfig::memory_format` for a CUDA loader: each f32 batch arrives on the device
/// dense channels-last with the CPU batch's values, and the ops of a ResNet step after the
/// convolution (batch norm + ReLU, max pool, the residual add) keep it channels-last there.
#[test]
fn channels_last_loader_delivers_nhwc_batches_on_the_gpu() {
    use std::sync::Arc;
    use tandem_core::MemoryFormat;
    use tandem_nn::data::{DataLoader, DataLoaderConfig, TensorDataset};
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let (n, c, h, w) = (6, 3, 4, 5);
    let values: Vec<f32> = (0..n * c * h * w)
        .map(|i| (i * 37 % 101) as f32 / 10.0)
        .collect();
    let images = Tensor::from_vec(values, &[n, c, h, w], Device::Cpu).unwrap();
    let labels = Tensor::from_vec((0..n as i64).collect(), &[n], Device::Cpu).unwrap();
    let dataset = Arc::new(TensorDataset::new(images.clone(), labels).unwrap());
    let config = DataLoaderConfig {
        batch_size: 4,
        device: GPU,
        memory_format: MemoryFormat::ChannelsLast,
        ..Default::default()
    };
    let loader = DataLoader::new(dataset, config).unwrap();
    let mut seen = 0;
    for batch in loader.iter() {
        let x = batch.unwrap().inputs;
        assert_eq!(x.device(), GPU);
        assert_eq!(x.memory_format(), MemoryFormat::ChannelsLast);
        assert!(x.is_contiguous_in(MemoryFormat::ChannelsLast));
        let rows = x.dims()[0];
        let want = tandem_ops::narrow(&images, 0, seen, rows).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        seen += rows;
        let y = tandem_ops::batch_norm_relu(&x, None, None, None, None, true, 0.1, 1e-5).unwrap();
        let z = tandem_ops::add(&y, &x).unwrap();
        let p = tandem_ops::max_pool2d(&z, (2, 2), (2, 2), (0, 0)).unwrap();
        for (t, what) in [(&y, "batch_norm_relu"), (&z, "add"), (&p, "max_pool2d")] {
            assert_eq!(t.memory_format(), MemoryFormat::ChannelsLast, "{what}");
        }
    }
    assert_eq!(seen, n);
}
