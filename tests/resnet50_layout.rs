//! tandem's ResNet-50 has torchvision's layout: the same tensors, by the same names, with the
//! same shapes, in the same order, as torchvision's own `state_dict` (the fixture was written by
//! torchvision: `tests/fixtures/make_resnet50_keys.py`), so a torchvision checkpoint loads by
//! name.

use tandem::nn::models::resnet50;
use tandem::nn::{Module, ParamKind};

#[test]
fn resnet50_matches_torchvisions_state_dict_name_for_name_and_shape_for_shape() {
    let fixture = include_str!("fixtures/resnet50_keys.txt");
    let expected: Vec<(String, String, String)> = fixture
        .lines()
        .map(|l| {
            let mut parts = l.split(' ');
            let name = parts.next().unwrap().to_string();
            let shape = parts.next().unwrap().to_string();
            let kind = parts.next().unwrap().to_string();
            (name, shape, kind)
        })
        .collect();
    let model = resnet50().unwrap();
    let ours: Vec<(String, String, String)> = model
        .named_tensors()
        .into_iter()
        .map(|(name, kind, t)| {
            let shape = if t.dims().is_empty() {
                "scalar".to_string()
            } else {
                t.dims()
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join("x")
            };
            let kind = match kind {
                ParamKind::Parameter => "param",
                ParamKind::Buffer => "buffer",
            };
            (name, shape, kind.to_string())
        })
        .collect();
    for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
        assert_eq!(a, b, "tensor {i}");
    }
    assert_eq!(ours.len(), expected.len());
    assert_eq!(model.num_parameters(), 25_557_032);
}
