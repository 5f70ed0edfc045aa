//! Random-number state as checkpoint extras, so that a resumed run draws what an
//! uninterrupted one would have drawn.
//!
//! Two kinds of generator feed a training run: this thread's default generator (layer
//! initialisation, [`manual_seed`](tandem_core::rng::manual_seed)) and the generator each
//! [`Dropout`] layer owns. [`rng_state`] returns both as U8 tensors of
//! [`GENERATOR_STATE_BYTES`] bytes — `thread` for the default generator and
//! `modules.{path}` for the dropout layer at `path` (found through
//! [`Module::children`]) — ready to be saved as extras under a prefix of the caller's
//! choice; [`load_rng_state`] puts them back. Data order and augmentation need no state of
//! their own in tandem: samplers and augmentations are seeded by `(seed, epoch, index)`.

use tandem_core::rng::{with_default_generator, GENERATOR_STATE_BYTES};
use tandem_core::{Device, Generator, Tensor};

use crate::{join_path, Dropout, Error, Module, Result};

/// Name of the thread's default generator in [`rng_state`].
const THREAD: &str = "thread";
/// Prefix of the dropout layers' generators in [`rng_state`].
const MODULES: &str = "modules.";

/// The state of this thread's default generator and of every dropout layer of `module`, as
/// named U8 tensors (see the module documentation).
pub fn rng_state(module: &dyn Module) -> Result<Vec<(String, Tensor)>> {
    let to_tensor = |state: [u8; GENERATOR_STATE_BYTES]| {
        Tensor::from_vec(state.to_vec(), &[GENERATOR_STATE_BYTES], Device::Cpu)
    };
    let mut states = vec![(THREAD.to_string(), with_default_generator(|g| g.state()))];
    for_each_dropout(module, "", &mut |path, layer| {
        states.push((format!("{MODULES}{path}"), layer.generator_state()));
    });
    states
        .into_iter()
        .map(|(name, state)| Ok((name, to_tensor(state)?)))
        .collect()
}

/// Restores state saved by [`rng_state`]: this thread's default generator and the generator
/// of every dropout layer of `module`. Every generator of `module` must have an entry of the
/// right size, and every entry a generator; otherwise nothing is restored and the error
/// names the entry.
pub fn load_rng_state(module: &dyn Module, state: &[(String, Tensor)]) -> Result<()> {
    let bad = |msg: String| Error::StateDict {
        origin: "random-number state".to_string(),
        msg,
    };
    let decode = |name: &str| -> Result<[u8; GENERATOR_STATE_BYTES]> {
        let Some((_, t)) = state.iter().find(|(n, _)| n == name) else {
            return Err(bad(format!("no entry `{name}`")));
        };
        let bytes = t
            .to_vec::<u8>()
            .map_err(|e| bad(format!("`{name}`: {e}")))?;
        bytes.as_slice().try_into().map_err(|_| {
            bad(format!(
                "`{name}` holds {} bytes, a generator's state is {GENERATOR_STATE_BYTES}",
                bytes.len()
            ))
        })
    };
    // Check everything before changing anything.
    let mut wanted = vec![THREAD.to_string()];
    for_each_dropout(module, "", &mut |path, _| {
        wanted.push(format!("{MODULES}{path}"));
    });
    let decoded = wanted
        .iter()
        .map(|name| decode(name))
        .collect::<Result<Vec<_>>>()?;
    let unknown: Vec<&str> = state
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !wanted.iter().any(|w| w == n))
        .collect();
    if !unknown.is_empty() {
        return Err(bad(format!(
            "entries for generators the model does not have: {}",
            unknown.join(", ")
        )));
    }
    with_default_generator(|g| *g = Generator::from_state(&decoded[0]));
    let mut next = decoded[1..].iter();
    for_each_dropout(module, "", &mut |_, layer| {
        if let Some(state) = next.next() {
            layer.set_generator_state(state);
        }
    });
    Ok(())
}

/// Calls `f` for every dropout layer under `module` (itself included) with its dotted path,
/// depth first in [`Module::children`] order.
fn for_each_dropout(module: &dyn Module, prefix: &str, f: &mut dyn FnMut(&str, &Dropout)) {
    if let Some(layer) = module.as_any().downcast_ref::<Dropout>() {
        f(prefix, layer);
    }
    for (name, child) in module.children() {
        for_each_dropout(child.as_ref(), &join_path(prefix, &name), f);
    }
}

#[cfg(test)]
mod tests {
    use tandem_core::rng::manual_seed;
    use tandem_core::DType;

    use super::*;
    use crate::{DropoutConfig, LinearConfig, Sequential};

    fn model() -> Sequential {
        Sequential::new()
            .add(LinearConfig::new(4, 8).init().unwrap())
            .add(DropoutConfig::new(0.5).init().unwrap())
            .add(Sequential::new().add(DropoutConfig::new(0.25).init().unwrap()))
    }

    /// Dropout masks of the model for one input, and a draw from the default generator.
    fn draws(m: &Sequential) -> (Vec<f32>, u64) {
        let x = Tensor::ones(&[3, 4], DType::F32, Device::Cpu).unwrap();
        let y = m.forward(&x).unwrap().to_vec::<f32>().unwrap();
        (y, with_default_generator(|g| g.next_u64()))
    }

    #[test]
    fn restored_state_repeats_the_dropout_masks_and_default_draws() {
        manual_seed(11);
        let m = model();
        draws(&m);
        let saved = rng_state(&m).unwrap();
        let names: Vec<&str> = saved.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["thread", "modules.1", "modules.2.0"]);
        let want = draws(&m);
        draws(&m);
        load_rng_state(&m, &saved).unwrap();
        assert_eq!(draws(&m), want);
    }

    #[test]
    fn missing_or_unknown_entries_are_errors_and_restore_nothing() {
        manual_seed(5);
        let m = model();
        let saved = rng_state(&m).unwrap();
        let err = load_rng_state(&m, &saved[..2]).unwrap_err().to_string();
        assert!(err.contains("`modules.2.0`"), "{err}");
        let mut extra = saved.clone();
        extra.push(("modules.9".into(), saved[0].1.clone()));
        let err = load_rng_state(&m, &extra).unwrap_err().to_string();
        assert!(err.contains("modules.9"), "{err}");
        let mut short = saved.clone();
        short[0].1 = Tensor::from_vec(vec![1u8; 3], &[3], Device::Cpu).unwrap();
        let err = load_rng_state(&m, &short).unwrap_err().to_string();
        assert!(err.contains("`thread`") && err.contains("3 bytes"), "{err}");
    }
}
