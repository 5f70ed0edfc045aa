//! Autocast: a per-thread scope inside which the matrix ops (matmul, linear, conv2d) run in a
//! lower-precision float dtype (bf16 or f16) while the parameters stay f32, like PyTorch's
//! `torch.autocast`.
//!
//! This module holds the scope's state; the policy (which op casts what) lives at the entry of
//! each op in `tandem-ops` (its `autocast` module lists the ops):
//!
//! ```
//! use tandem_autograd::autocast::{autocast, autocast_dtype, AutocastGuard};
//! use tandem_core::DType;
//!
//! autocast(DType::BF16, || {
//!     assert_eq!(autocast_dtype(), Some(DType::BF16));
//!     let _f32_region = AutocastGuard::disabled();
//!     assert_eq!(autocast_dtype(), None);
//! })?;
//! assert_eq!(autocast_dtype(), None);
//! # let _ = AutocastGuard::new(DType::F16)?;
//! # Ok::<(), tandem_core::Error>(())
//! ```
//!
//! # The weight cache
//!
//! The low-precision copy of a parameter (an f32 leaf that requires grad) is made once and
//! reused by every op that uses the parameter afterwards (PyTorch's autocast weight cache): a
//! weight shared by several layers, or used in every step of an unrolled loop, is cast once.
//! Only such leaves are cached — never an activation (a non-leaf) or a tensor that does not
//! require grad, whose values may change from one use to the next. The cached copy is
//! recorded by autograd (its backward casts the gradient back to f32), so the parameter
//! receives one f32 gradient summed over all its uses.
//!
//! A cached copy lives until the **outermost** enabled scope of the thread ends, or until a
//! backward pass runs on this thread, whichever comes first. The backward frees the graph the
//! copies belong to (a second backward through them would fail) and is what precedes the
//! optimizer's in-place update of the parameters, so a scope wrapping whole training steps
//! (forward, backward, step, forward, ...) casts each parameter once per step and always sees
//! the updated values.
//!
//! **In-place updates inside one forward.** The cache is keyed by the tensor's identity, as
//! PyTorch's is, and tensors carry no version counter: a parameter modified in place *after*
//! its first use in a scope and before the next backward (say, by `fill_` or `copy_` in the
//! middle of a forward) keeps the stale copy for the rest of that forward. PyTorch behaves the
//! same way; update parameters outside the forward (the optimizer's step, after backward), or
//! end the scope first.
//!
//! # Threads
//!
//! The state is per thread: ranks that run as threads of one process never see each other's
//! scope or cache, and a thread started inside a scope starts outside any scope. A backward
//! pass runs with autocast off (the gradients follow the dtypes the forward chose).

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;

use tandem_core::{DType, Error, Result, Tensor, TensorId};

use crate::grad_mode::is_grad_enabled;

/// One thread's autocast state.
#[derive(Default)]
struct State {
    /// The dtype the matrix ops cast to, `None` outside a scope or in a disabled region.
    dtype: Option<DType>,
    /// How many enabled scopes are open; the cache is freed when this drops back to 0.
    enabled_scopes: usize,
    /// Low-precision copies of parameters, by parameter, target dtype and whether the copy
    /// was recorded by autograd (a copy made under `no_grad` has no gradient path).
    cache: HashMap<(TensorId, DType, bool), Tensor>,
    /// Copies made for the cache on this thread, ever.
    casts: u64,
    /// Uses served from the cache on this thread, ever.
    hits: u64,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// The dtype autocast casts the matrix ops' f32 inputs to on this thread, or `None` outside
/// any scope (and inside a [`AutocastGuard::disabled`] region).
pub fn autocast_dtype() -> Option<DType> {
    STATE.with(|s| s.borrow().dtype)
}

/// An open autocast scope (or an f32 region inside one); dropping it restores the state that
/// was current when it was made. Guards belong to their thread (they are not `Send`) and must
/// be dropped in the reverse order of their creation, as scopes nest.
#[must_use = "the scope ends when the guard is dropped"]
pub struct AutocastGuard {
    previous: Option<DType>,
    enabled: bool,
    /// Not `Send`: the state it restores is this thread's.
    _thread: PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Opens a scope in which the matrix ops run in `dtype` (f16 or bf16; any other dtype is
    /// an error naming it).
    pub fn new(dtype: DType) -> Result<AutocastGuard> {
        if !matches!(dtype, DType::F16 | DType::BF16) {
            return Err(Error::UnsupportedDType {
                op: "autocast",
                dtype,
                supported: "f16, bf16",
            });
        }
        let previous = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.enabled_scopes += 1;
            s.dtype.replace(dtype)
        });
        Ok(AutocastGuard {
            previous,
            enabled: true,
            _thread: PhantomData,
        })
    }

    /// Opens an f32 region inside a scope (PyTorch's `autocast(enabled=False)`): the ops run
    /// in the dtypes of their inputs until the guard is dropped. Cached copies stay cached for
    /// the enclosing scope.
    pub fn disabled() -> AutocastGuard {
        let previous = STATE.with(|s| s.borrow_mut().dtype.take());
        AutocastGuard {
            previous,
            enabled: false,
            _thread: PhantomData,
        }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // Take the cache out before dropping it: dropping tensors must not run under the
        // borrow of the state.
        let freed = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.dtype = self.previous;
            if self.enabled {
                s.enabled_scopes -= 1;
                if s.enabled_scopes == 0 {
                    return std::mem::take(&mut s.cache);
                }
            }
            HashMap::new()
        });
        drop(freed);
    }
}

/// Runs `f` inside an autocast scope of `dtype` (see [`AutocastGuard::new`]) and returns its
/// value; the previous state is restored afterwards, also when `f` panics. A `dtype` other than
/// f16 or bf16 is an error naming it (and `f` does not run).
pub fn autocast<R>(dtype: DType, f: impl FnOnce() -> R) -> Result<R> {
    let _guard = AutocastGuard::new(dtype)?;
    Ok(f())
}

/// The low-precision copy of `param` in `dtype` for this scope: the cached one, or the one
/// `make` returns (then cached). Only an f32 leaf that requires grad is cached; any other
/// tensor is passed to `make` every time. Ops call this through their autocast policy.
pub fn cached_cast(
    param: &Tensor,
    dtype: DType,
    make: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let cacheable = param.dtype() == DType::F32
        && param.is_leaf()
        && param.requires_grad()
        && STATE.with(|s| s.borrow().enabled_scopes > 0);
    if !cacheable {
        return make(param);
    }
    let key = (param.id(), dtype, is_grad_enabled());
    let hit = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let hit = s.cache.get(&key).cloned();
        if hit.is_some() {
            s.hits += 1;
        }
        hit
    });
    if let Some(copy) = hit {
        return Ok(copy);
    }
    let copy = make(param)?;
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.casts += 1;
        s.cache.insert(key, copy.clone());
    });
    Ok(copy)
}

/// Frees this thread's cached copies (the backward pass calls it: it frees the graph the
/// copies were recorded in).
pub(crate) fn clear_weight_cache() {
    let freed = STATE.with(|s| std::mem::take(&mut s.borrow_mut().cache));
    drop(freed);
}

/// This thread's weight-cache counters, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightCacheStats {
    /// Copies held now.
    pub cached: usize,
    /// Copies made on this thread so far (cache misses of cacheable parameters).
    pub casts: u64,
    /// Uses served from the cache on this thread so far.
    pub hits: u64,
}

/// This thread's [`WeightCacheStats`].
pub fn weight_cache_stats() -> WeightCacheStats {
    STATE.with(|s| {
        let s = s.borrow();
        WeightCacheStats {
            cached: s.cache.len(),
            casts: s.casts,
            hits: s.hits,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::Device;

    fn param() -> Tensor {
        Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap()
    }

    fn make(t: &Tensor) -> Result<Tensor> {
        t.to_dtype(DType::BF16)
    }

    #[test]
    fn scopes_nest_and_restore_and_disabled_regions_turn_autocast_off() {
        assert_eq!(autocast_dtype(), None);
        let v = autocast(DType::BF16, || {
            assert_eq!(autocast_dtype(), Some(DType::BF16));
            autocast(DType::F16, || {
                assert_eq!(autocast_dtype(), Some(DType::F16))
            })
            .unwrap();
            assert_eq!(autocast_dtype(), Some(DType::BF16));
            {
                let _off = AutocastGuard::disabled();
                assert_eq!(autocast_dtype(), None);
                let _on = AutocastGuard::new(DType::F16).unwrap();
                assert_eq!(autocast_dtype(), Some(DType::F16));
            }
            assert_eq!(autocast_dtype(), Some(DType::BF16));
            7
        })
        .unwrap();
        assert_eq!(v, 7);
        assert_eq!(autocast_dtype(), None);
    }

    #[test]
    fn only_half_precision_dtypes_open_a_scope() {
        for dtype in [DType::F32, DType::F64, DType::I64, DType::U8] {
            let err = AutocastGuard::new(dtype).err().expect("an error");
            let text = err.to_string();
            assert!(
                text.contains("autocast") && text.contains(dtype.name()),
                "{text}"
            );
            let mut ran = false;
            assert!(autocast(dtype, || ran = true).is_err());
            assert!(
                !ran,
                "the closure must not run outside a scope it asked for"
            );
        }
        assert_eq!(autocast_dtype(), None);
    }

    #[test]
    fn a_panicking_closure_restores_the_state() {
        let r = std::panic::catch_unwind(|| autocast(DType::BF16, || panic!("inside")).unwrap());
        assert!(r.is_err());
        assert_eq!(autocast_dtype(), None);
        assert_eq!(weight_cache_stats().cached, 0);
    }

    #[test]
    fn the_cache_holds_one_copy_per_parameter_until_the_outermost_scope_ends() {
        let p = param();
        let before = weight_cache_stats();
        autocast(DType::BF16, || {
            let a = cached_cast(&p, DType::BF16, make).unwrap();
            autocast(DType::BF16, || {
                let b = cached_cast(&p, DType::BF16, make).unwrap();
                assert!(a.same_tensor(&b), "the inner scope reuses the outer copy");
            })
            .unwrap();
            // The inner scope's end does not free the outer scope's cache.
            let _off = AutocastGuard::disabled();
            let c = cached_cast(&p, DType::BF16, make).unwrap();
            assert!(a.same_tensor(&c));
            assert_eq!(weight_cache_stats().cached, 1);
        })
        .unwrap();
        let after = weight_cache_stats();
        assert_eq!(after.cached, 0, "freed with the outermost scope");
        assert_eq!(after.casts - before.casts, 1);
        assert_eq!(after.hits - before.hits, 2);
        // A new scope makes a new copy.
        let d = autocast(DType::BF16, || cached_cast(&p, DType::BF16, make).unwrap()).unwrap();
        assert_eq!(weight_cache_stats().casts - before.casts, 2);
        assert_eq!(d.dtype(), DType::BF16);
    }

    #[test]
    fn non_leaves_tensors_without_grad_and_uses_outside_a_scope_are_never_cached() {
        let plain = Tensor::from_vec(vec![1.0f32], &[1], Device::Cpu).unwrap();
        let before = weight_cache_stats();
        let p = param();
        let x = cached_cast(&p, DType::BF16, make).unwrap();
        let y = cached_cast(&p, DType::BF16, make).unwrap();
        assert!(!x.same_tensor(&y), "outside a scope nothing is cached");
        autocast(DType::BF16, || {
            let a = cached_cast(&plain, DType::BF16, make).unwrap();
            let b = cached_cast(&plain, DType::BF16, make).unwrap();
            assert!(!a.same_tensor(&b));
            let non_leaf = p.with_grad_fn(tandem_core::Node::new(
                Box::new(crate::record::FnBackward::new("test", |_: &Tensor| {
                    Ok(vec![])
                })),
                vec![],
            ));
            let a = cached_cast(&non_leaf, DType::BF16, make).unwrap();
            let b = cached_cast(&non_leaf, DType::BF16, make).unwrap();
            assert!(!a.same_tensor(&b));
            assert_eq!(weight_cache_stats().cached, 0);
        })
        .unwrap();
        assert_eq!(weight_cache_stats().casts, before.casts);
    }

    #[test]
    fn grad_mode_and_dtype_have_separate_copies() {
        let p = param();
        autocast(DType::BF16, || {
            let a = cached_cast(&p, DType::BF16, make).unwrap();
            let b = crate::grad_mode::no_grad(|| cached_cast(&p, DType::BF16, make).unwrap());
            let c = cached_cast(&p, DType::F16, |t| t.to_dtype(DType::F16)).unwrap();
            assert!(!a.same_tensor(&b));
            assert_eq!(c.dtype(), DType::F16);
            assert_eq!(weight_cache_stats().cached, 3);
        })
        .unwrap();
    }

    #[test]
    fn a_backward_pass_frees_the_calling_threads_cache() {
        let p = param();
        autocast(DType::BF16, || {
            cached_cast(&p, DType::BF16, make).unwrap();
            assert_eq!(weight_cache_stats().cached, 1);
            clear_weight_cache();
            assert_eq!(weight_cache_stats().cached, 0);
        })
        .unwrap();
    }

    #[test]
    fn threads_never_see_another_threads_scope_or_cache() {
        let p = param();
        autocast(DType::BF16, || {
            cached_cast(&p, DType::BF16, make).unwrap();
            std::thread::scope(|s| {
                s.spawn(|| {
                    assert_eq!(autocast_dtype(), None);
                    assert_eq!(weight_cache_stats(), WeightCacheStats::default());
                    autocast(DType::F16, || {
                        assert_eq!(autocast_dtype(), Some(DType::F16));
                        let copy = cached_cast(&p, DType::F16, |t| t.to_dtype(DType::F16));
                        assert_eq!(copy.unwrap().dtype(), DType::F16);
                    })
                    .unwrap();
                });
            });
            assert_eq!(autocast_dtype(), Some(DType::BF16));
            let stats = weight_cache_stats();
            assert_eq!(stats.cached, 1);
        })
        .unwrap();
    }
}
