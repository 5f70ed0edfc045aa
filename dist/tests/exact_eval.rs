//! Exact distributed evaluation with real ranks (threads): one checkpoint evaluated on 1, 2, 3
//! and 4 ranks, each rank its `DistributedEvalSampler` part (uneven: 37 samples), gives the
//! identical correct count — the count a single process gets, and the one the labels were made
//! to give. The model is a ResNet-8 whose BatchNorms are `SyncBatchNorm`s: in eval mode they
//! use their running statistics and issue no collective, so ranks with different numbers of
//! batches (and a rank with no samples at all) finish without a join.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tandem_autograd::no_grad;
use tandem_core::rng::manual_seed;
use tandem_core::{Device, Tensor};
use tandem_dist::metrics::evaluate_across_ranks;
use tandem_dist::{convert_sync_batch_norm, DistributedEvalSampler, ProcessGroup};
use tandem_dist::{DistributedSampler, ThreadProcessGroup};
use tandem_nn::checkpoint::{load_checkpoint, load_state_dict, save_checkpoint};
use tandem_nn::data::{DataLoader, DataLoaderConfig, Dataset, Sampler, TensorDataset};
use tandem_nn::metrics::Accuracy;
use tandem_nn::models::resnet_cifar;
use tandem_nn::Module;

const SAMPLES: usize = 37;
const CLASSES: usize = 10;

/// Deterministic inputs `[n, 3, 32, 32]`.
fn inputs(n: usize) -> Tensor {
    let values: Vec<f32> = (0..n * 3 * 32 * 32)
        .map(|i| ((i as f32) * 0.37).sin() + ((i / 1024) as f32 * 0.11).cos())
        .collect();
    Tensor::from_vec(values, &[n, 3, 32, 32], Device::Cpu).unwrap()
}

/// A ResNet-8 whose BatchNorm running statistics have moved (a few training-mode forwards),
/// saved to a checkpoint.
fn write_checkpoint(dir: &Path) -> PathBuf {
    manual_seed(5);
    let model = resnet_cifar(8, CLASSES).unwrap();
    model.train();
    no_grad(|| {
        for _ in 0..3 {
            model.forward(&inputs(8)).unwrap();
        }
    });
    let path = dir.join("resnet8.safetensors");
    save_checkpoint(&path, &model, &[], &BTreeMap::new()).unwrap();
    path
}

/// The checkpoint's model, in eval mode.
fn load(path: &Path) -> Arc<dyn Module> {
    let model = resnet_cifar(8, CLASSES).unwrap();
    load_state_dict(&model, &load_checkpoint(path).unwrap(), true).unwrap();
    Arc::new(model)
}

/// `n` samples labelled so that the checkpoint's model gets exactly the samples with
/// `i % 3 != 0` right: the label is its prediction there and another class elsewhere.
fn test_set(path: &Path, n: usize) -> (Arc<dyn Dataset>, u64) {
    let model = load(path);
    model.eval();
    let x = inputs(n);
    let logits = no_grad(|| model.forward(&x)).unwrap();
    let predicted = tandem_ops::argmax(&logits, 1, false)
        .unwrap()
        .to_vec::<i64>()
        .unwrap();
    let labels: Vec<i64> = predicted
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            if i % 3 == 0 {
                (p + 1) % CLASSES as i64
            } else {
                p
            }
        })
        .collect();
    let correct = (0..n).filter(|i| i % 3 != 0).count() as u64;
    let targets = Tensor::from_vec(labels, &[n], Device::Cpu).unwrap();
    (Arc::new(TensorDataset::new(x, targets).unwrap()), correct)
}

/// Every rank's (local, summed) accuracy when `world` thread ranks evaluate `set`.
fn evaluate_on(world: usize, path: &Path, set: &Arc<dyn Dataset>) -> Vec<(usize, Accuracy)> {
    let handles: Vec<_> = ThreadProcessGroup::new_group(world)
        .unwrap()
        .into_iter()
        .map(|group| {
            let (path, set) = (path.to_path_buf(), set.clone());
            std::thread::spawn(move || {
                let rank = group.rank();
                let group: Arc<dyn ProcessGroup> = Arc::new(group);
                let model = convert_sync_batch_norm(load(&path), group.clone()).unwrap();
                let sampler = DistributedEvalSampler::new(set.len(), world, rank).unwrap();
                let mine = sampler.len();
                let config = DataLoaderConfig {
                    batch_size: 4,
                    ..Default::default()
                };
                let loader = DataLoader::with_sampler(set, Arc::new(sampler), config).unwrap();
                let all =
                    evaluate_across_ranks(Some(group.as_ref()), model.as_ref(), loader.epoch(0))
                        .unwrap();
                (mine, all)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn one_checkpoint_on_1_to_4_ranks_gives_the_identical_correct_count() {
    let dir = std::env::temp_dir().join(format!("tandem-exact-eval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = write_checkpoint(&dir);
    let (set, correct) = test_set(&path, SAMPLES);
    let alone = evaluate_across_ranks(None, load(&path).as_ref(), {
        let config = DataLoaderConfig {
            batch_size: 5,
            ..Default::default()
        };
        DataLoader::new(set.clone(), config).unwrap().epoch(0)
    })
    .unwrap();
    assert_eq!(alone, Accuracy::new(correct, SAMPLES as u64));
    for world in 1..=4 {
        let results = evaluate_on(world, &path, &set);
        let sizes: Vec<usize> = results.iter().map(|r| r.0).collect();
        assert_eq!(
            sizes.iter().sum::<usize>(),
            SAMPLES,
            "world {world}: {sizes:?}"
        );
        for (rank, (_, all)) in results.iter().enumerate() {
            assert_eq!(*all, alone, "world {world}, rank {rank}");
        }
    }
    // The training sampler pads 37 samples to 40 on 4 ranks: counted that way, the figure
    // would differ (the 3 repeated samples are counted twice).
    assert_eq!(
        DistributedSampler::new(SAMPLES, 4, 0, false, 0)
            .unwrap()
            .len()
            * 4,
        40
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_with_no_samples_still_takes_part() {
    let dir = std::env::temp_dir().join(format!("tandem-exact-eval-few-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = write_checkpoint(&dir);
    let (set, correct) = test_set(&path, 3);
    let results = evaluate_on(4, &path, &set);
    assert_eq!(
        results.iter().map(|r| r.0).collect::<Vec<_>>(),
        [1, 1, 1, 0]
    );
    for (_, all) in results {
        assert_eq!(all, Accuracy::new(correct, 3));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
