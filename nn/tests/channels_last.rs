//! A ResNet-20 training step on a channels-last batch gives the loss and gradients of the same
//! step on the row-major batch (the activations stay channels-last through conv, batch norm,
//! the residual joins and the pooling; the f32 kernels differ in summation order, hence the
//! tolerance).

use tandem_autograd::{backward, BackwardOptions};
use tandem_core::{DType, Device, Generator, MemoryFormat, Tensor};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::Module;

/// Loss and parameter gradients of one step of `model` on `x`.
fn step(model: &dyn Module, x: &Tensor, y: &Tensor) -> (f64, Vec<(String, Tensor)>) {
    for p in model.parameters() {
        p.set_grad(None).unwrap();
    }
    let logits = model.forward(x).unwrap();
    let loss = cross_entropy(&logits, y, Reduction::Mean).unwrap();
    backward(&loss, None, &BackwardOptions::default()).unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| (name, p.grad().unwrap()))
        .collect();
    (loss.item().unwrap(), grads)
}

#[test]
fn resnet20_step_on_channels_last_input_matches_the_row_major_step() {
    let model = tandem_nn::resnet::resnet20().unwrap();
    model.set_training(true);
    let mut g = Generator::new(5);
    let x = Tensor::randn(&[4, 3, 16, 16], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let y = Tensor::from_vec(vec![0i64, 3, 7, 9], &[4], Device::Cpu).unwrap();
    let x_cl = x.contiguous_in(MemoryFormat::ChannelsLast).unwrap();
    let (want_loss, want) = step(&model, &x, &y);
    // Running statistics moved in the first step; evaluate the second from the same state by
    // using training-mode batch statistics (running stats do not enter the training forward).
    let (got_loss, got) = step(&model, &x_cl, &y);
    assert!(
        (want_loss - got_loss).abs() <= 1e-5 * want_loss.abs().max(1.0),
        "loss {want_loss} vs {got_loss}"
    );
    for ((name, w), (_, gr)) in want.iter().zip(&got) {
        let (a, b) = (w.to_vec_f64().unwrap(), gr.to_vec_f64().unwrap());
        let scale = a.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-6);
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert!(
                (p - q).abs() <= 1e-3 * scale,
                "{name} element {i}: {p} vs {q} (scale {scale})"
            );
        }
    }
    // The activations stayed channels-last: the first convolution's output is.
    let conv1 = tandem_ops::conv2d(
        &x_cl,
        &model.named_parameters()[0].1,
        None,
        &tandem_ops::Conv2dParams {
            stride: (1, 1),
            padding: (1, 1),
            dilation: (1, 1),
        },
    )
    .unwrap();
    assert_eq!(conv1.memory_format(), MemoryFormat::ChannelsLast);
}

#[test]
fn to_memory_format_converts_the_4d_tensors_in_place_and_leaves_the_others() {
    let model = tandem_nn::resnet::resnet20().unwrap();
    let before: Vec<(String, tandem_core::TensorId, Vec<f64>)> = model
        .named_tensors()
        .into_iter()
        .map(|(n, _, t)| (n, t.id(), t.to_vec_f64().unwrap()))
        .collect();
    let held = model.parameters();
    model
        .to_memory_format(tandem_nn::MemoryFormat::ChannelsLast)
        .unwrap();
    let after = model.named_tensors();
    assert_eq!(after.len(), before.len());
    let mut converted = 0;
    for ((name, id, values), (name2, _, t)) in before.iter().zip(&after) {
        assert_eq!((name, *id), (name2, t.id()), "identity kept");
        assert_eq!(&t.to_vec_f64().unwrap(), values, "{name}: values kept");
        if t.rank() == 4 {
            assert!(t.layout().is_channels_last(), "{name}");
            converted += 1;
        } else {
            assert!(t.is_contiguous(), "{name} (rank {}) left alone", t.rank());
        }
    }
    // The 19 convolutions and 2 projection shortcuts of ResNet-20... every 4-D tensor.
    assert_eq!(
        converted,
        after.iter().filter(|(_, _, t)| t.rank() == 4).count()
    );
    assert!(converted >= 19, "{converted}");
    // Handles taken before the conversion see it (the optimizer's view of the model).
    assert!(held[0].layout().is_channels_last());

    model.to_memory_format(MemoryFormat::Contiguous).unwrap();
    assert!(model.parameters().iter().all(|p| p.is_contiguous()));
}

#[test]
fn to_memory_format_names_a_tensor_it_cannot_convert() {
    let model = tandem_nn::resnet::resnet20().unwrap();
    let (path, _, conv1) = model.named_tensors().swap_remove(0);
    let sharer = conv1.detach();
    let err = model
        .to_memory_format(MemoryFormat::ChannelsLast)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&path) && err.contains("shares its storage"),
        "{err}"
    );
    drop(sharer);
    model.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
}
