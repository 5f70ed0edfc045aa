//! Which plan a call uses and what runs when cuDNN refuses a chosen algorithm: pure logic, tested
//! without a GPU.
//!
//! **Keys.** cuDNN's algorithms differ in what addresses they accept: many load 16 bytes at a
//! time and need buffers aligned to that. An algorithm chosen on 256-byte-aligned buffers (every
//! fresh allocation) may not run on a view that starts inside one (`x.narrow(0, 1, n)` of an
//! NCHW batch starts `C·H·W` elements in), and cuDNN then answers `CUDNN_STATUS_NOT_SUPPORTED`.
//! So a plan is keyed by the alignment of each buffer a pass touches as well as by geometry,
//! dtype, TF32 setting and search (PyTorch keys its cuDNN plans on alignment in the same way):
//! a misaligned view gets its own plan, chosen for its own addresses. The alignment is the
//! largest power of two dividing the address, capped at [`MAX_ALIGNMENT`], so the few values in
//! use (4, 8, 16, … 256 bytes) keep the cache small. The workspace is not in the key: it is
//! allocated after the lookup (its size comes from the choice) by the stream-ordered pool,
//! whose addresses are always 256-byte aligned; the fallback below covers any surprise.
//!
//! **Fallback.** When running a chosen algorithm still answers NOT_SUPPORTED (the heuristics
//! rank algorithms without seeing addresses, and cuDNN may refuse for reasons of its own), the
//! call makes a fresh choice that skips the refused algorithm and runs that; if cuDNN refuses
//! again, or cannot choose, the pass runs through im2col + cuBLAS, and the plan remembers it, so
//! later calls with the same key go straight to im2col. Any other cuDNN error is an error.

use std::hash::Hash;

use tandem_core::DType;

use crate::conv2d::cuda::{CudnnAlgorithmSearch, Format};
use crate::conv2d::Geometry;

/// The largest alignment keys distinguish, in bytes.
pub(super) const MAX_ALIGNMENT: u16 = 256;

/// How many chosen algorithms one call runs before it gives the pass to im2col: the cached one
/// and one fresh choice.
pub(super) const MAX_CUDNN_ATTEMPTS: usize = 2;

/// The alignment of `address` in bytes: the largest power of two that divides it, at most
/// [`MAX_ALIGNMENT`] (which the null address of an empty buffer also gets).
pub(super) fn alignment(address: u64) -> u16 {
    let max_shift = MAX_ALIGNMENT.trailing_zeros();
    1 << address.trailing_zeros().min(max_shift)
}

/// The alignments of the three buffers of one pass (two inputs and the output, in the order of
/// `passes::Operands`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Alignments {
    pub a: u16,
    pub b: u16,
    pub out: u16,
}

impl Alignments {
    /// The alignments of the buffers at `a`, `b` and `out`.
    pub(super) fn of(a: u64, b: u64, out: u64) -> Self {
        Alignments {
            a: alignment(a),
            b: alignment(b),
            out: alignment(out),
        }
    }
}

/// The key of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct PlanKey {
    pub geometry: Geometry,
    pub dtype: DType,
    pub format: Format,
    pub tf32: bool,
    pub search: CudnnAlgorithmSearch,
    pub alignments: Alignments,
}

/// Whether a cuDNN status (as its integer) says NOT_SUPPORTED: cuDNN 9 numbers that category
/// 3000 to 3999 (the plain status and its reasons: shape, layout, padding, …).
pub(super) fn is_not_supported(status: u32) -> bool {
    status / 1000 == 3
}

/// What runs one pass of one plan.
#[derive(Debug)]
pub(super) enum Choice<C> {
    /// A cuDNN algorithm (with what it needs to run).
    Cudnn(C),
    /// cuDNN declined the pass; im2col + cuBLAS runs it.
    Im2col,
}

/// What running a chosen cuDNN algorithm came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ran {
    /// The pass is queued.
    Done,
    /// cuDNN answered NOT_SUPPORTED and queued nothing.
    NotSupported,
}

/// Which engine a call of a pass ended on: what the cuDNN path returns instead of a bare
/// "declined" flag, as the CPU plan names the algorithm it takes. `Im2col` is the decline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub(in crate::conv2d::cuda) enum Engine {
    /// cuDNN ran the pass.
    Cudnn,
    /// The caller must run the pass through im2col.
    Im2col,
}

/// What a call did, for the cache's statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Event {
    /// An algorithm was chosen.
    Chose,
    /// A chosen algorithm was refused with NOT_SUPPORTED.
    NotSupported,
    /// The call ends on im2col.
    Declined,
}

/// Runs one call of a pass whose choice lives in `slot` (`None` before the first call): chooses
/// with `choose` when there is no choice (it gets the algorithm just refused, to skip; `None`
/// from it means cuDNN cannot choose), runs the choice with `execute`, and on NOT_SUPPORTED
/// chooses afresh once, then settles on im2col (see the module comment). `slot` keeps the last
/// choice for later calls. `note` hears of each [`Event`]. Errors from `choose` and `execute`
/// propagate.
pub(super) fn run_pass<C, E>(
    slot: &mut Option<Choice<C>>,
    mut choose: impl FnMut(Option<&C>) -> Result<Option<C>, E>,
    mut execute: impl FnMut(&C) -> Result<Ran, E>,
    mut note: impl FnMut(Event),
) -> Result<Engine, E> {
    let mut refused: Option<C> = None;
    let mut attempts = 0;
    loop {
        if slot.is_none() {
            note(Event::Chose);
            *slot = Some(match choose(refused.as_ref())? {
                Some(c) => Choice::Cudnn(c),
                None => Choice::Im2col,
            });
        }
        let ran = match slot.as_ref() {
            Some(Choice::Cudnn(c)) => execute(c)?,
            _ => {
                note(Event::Declined);
                return Ok(Engine::Im2col);
            }
        };
        match ran {
            Ran::Done => return Ok(Engine::Cudnn),
            Ran::NotSupported => {
                note(Event::NotSupported);
                attempts += 1;
                if let Some(Choice::Cudnn(c)) = slot.take() {
                    refused = Some(c);
                }
                if attempts >= MAX_CUDNN_ATTEMPTS {
                    *slot = Some(Choice::Im2col);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_dividing_the_address_up_to_256() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x1000 + 128), 128);
        assert_eq!(alignment(0x1000 + 16), 16);
        assert_eq!(alignment(0x1000 + 48), 16);
        assert_eq!(alignment(0x1000 + 4), 4);
        assert_eq!(alignment(0x1000 + 2), 2);
        assert_eq!(alignment(0x1001), 1);
        assert_eq!(alignment(u64::MAX), 1);
        assert_eq!(alignment(1 << 63), 256);
    }

    fn geometry() -> Geometry {
        Geometry {
            batch: 8,
            in_channels: 3,
            in_h: 5,
            in_w: 5,
            out_channels: 4,
            kernel: (3, 3),
            stride: (1, 1),
            padding: (1, 1),
            dilation: (1, 1),
            out_h: 5,
            out_w: 5,
        }
    }

    fn key(x: u64, w: u64, y: u64) -> PlanKey {
        PlanKey {
            geometry: geometry(),
            dtype: DType::F32,
            format: Format::Nchw,
            tf32: false,
            search: CudnnAlgorithmSearch::Measured,
            alignments: Alignments::of(x, w, y),
        }
    }

    #[test]
    fn a_view_narrowed_into_a_batch_gets_its_own_plan() {
        let (x, w, y) = (
            0x7f00_0010_0000u64,
            0x7f00_0020_0000u64,
            0x7f00_0030_0000u64,
        );
        // x.narrow(0, 1, 7) of an f32 [8, 3, 5, 5] batch starts 75 floats (300 bytes) in.
        let sample = 3 * 5 * 5 * 4;
        let narrowed = key(x + sample, w, y);
        assert_ne!(narrowed, key(x, w, y));
        assert_eq!(narrowed.alignments.a, 4);
        // Two samples in: 600 bytes, 8-aligned, yet another plan; the same alignment elsewhere
        // in memory finds the same plan.
        assert_ne!(key(x + 2 * sample, w, y), narrowed);
        assert_eq!(key(x + 2 * sample, w, y), key(0x5000 + 600, w + 256, y));
        // Every operand counts.
        assert_ne!(key(x, w + 4, y), key(x, w, y));
        assert_ne!(key(x, w, y + 8), key(x, w, y));
        // Aligned buffers anywhere share one plan.
        assert_eq!(key(x, w, y), key(0x1_0000, 0x2_0000, 0x3_0100));
    }

    #[test]
    fn every_not_supported_reason_is_not_supported_and_nothing_else_is() {
        use cudarc::cudnn::sys::cudnnStatus_t::*;
        for status in [
            CUDNN_STATUS_NOT_SUPPORTED,
            CUDNN_STATUS_NOT_SUPPORTED_LAYOUT,
            CUDNN_STATUS_NOT_SUPPORTED_SHAPE,
            CUDNN_STATUS_NOT_SUPPORTED_PADDING,
            CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH,
        ] {
            assert!(is_not_supported(status as u32), "{status:?}");
        }
        for status in [
            CUDNN_STATUS_SUCCESS,
            CUDNN_STATUS_BAD_PARAM,
            CUDNN_STATUS_INTERNAL_ERROR,
            CUDNN_STATUS_EXECUTION_FAILED,
        ] {
            assert!(!is_not_supported(status as u32), "{status:?}");
        }
    }

    /// A fake cuDNN: algorithms are numbers; `refuses` lists those that answer NOT_SUPPORTED on
    /// the buffers at hand; the ranking is 1, 2, 3, … skipping the one just refused.
    struct Fake {
        refuses: Vec<u32>,
        ranking: Vec<u32>,
        chosen: Vec<(u32, Option<u32>)>,
        ran: Vec<u32>,
        events: Vec<Event>,
    }

    impl Fake {
        fn new(refuses: &[u32], ranking: &[u32]) -> Self {
            Fake {
                refuses: refuses.to_vec(),
                ranking: ranking.to_vec(),
                chosen: Vec::new(),
                ran: Vec::new(),
                events: Vec::new(),
            }
        }

        fn call(&mut self, slot: &mut Option<Choice<u32>>) -> Result<Engine, String> {
            let Fake {
                refuses,
                ranking,
                chosen,
                ran,
                events,
            } = self;
            run_pass(
                slot,
                |skip: Option<&u32>| {
                    let pick = ranking.iter().copied().find(|a| Some(a) != skip);
                    if let Some(a) = pick {
                        chosen.push((a, skip.copied()));
                    }
                    Ok(pick)
                },
                |&algo| {
                    ran.push(algo);
                    Ok(if refuses.contains(&algo) {
                        Ran::NotSupported
                    } else {
                        Ran::Done
                    })
                },
                |e| events.push(e),
            )
        }
    }

    #[test]
    fn a_cached_choice_that_runs_is_reused_without_choosing_again() {
        let mut fake = Fake::new(&[], &[1, 2]);
        let mut slot = None;
        assert_eq!(fake.call(&mut slot), Ok(Engine::Cudnn));
        assert_eq!(fake.call(&mut slot), Ok(Engine::Cudnn));
        assert_eq!(fake.chosen, [(1, None)]);
        assert_eq!(fake.ran, [1, 1]);
        assert_eq!(fake.events, [Event::Chose]);
    }

    #[test]
    fn not_supported_from_a_cached_choice_makes_a_fresh_choice_that_skips_it() {
        let mut fake = Fake::new(&[], &[1, 2]);
        let mut slot = None;
        assert_eq!(fake.call(&mut slot), Ok(Engine::Cudnn));
        // The same plan now meets buffers algorithm 1 refuses.
        fake.refuses = vec![1];
        assert_eq!(fake.call(&mut slot), Ok(Engine::Cudnn));
        assert_eq!(fake.chosen, [(1, None), (2, Some(1))]);
        assert_eq!(fake.ran, [1, 1, 2]);
        assert!(matches!(slot, Some(Choice::Cudnn(2))), "{slot:?}");
        assert_eq!(
            fake.events,
            [Event::Chose, Event::NotSupported, Event::Chose]
        );
        // Later calls run the new choice at once.
        assert_eq!(fake.call(&mut slot), Ok(Engine::Cudnn));
        assert_eq!(fake.ran, [1, 1, 2, 2]);
    }

    #[test]
    fn not_supported_twice_settles_on_im2col_for_this_and_later_calls() {
        let mut fake = Fake::new(&[1, 2], &[1, 2, 3]);
        let mut slot = None;
        assert_eq!(fake.call(&mut slot), Ok(Engine::Im2col));
        assert_eq!(fake.ran, [1, 2]);
        assert!(matches!(slot, Some(Choice::Im2col)));
        assert_eq!(
            fake.events,
            [
                Event::Chose,
                Event::NotSupported,
                Event::Chose,
                Event::NotSupported,
                Event::Declined
            ]
        );
        assert_eq!(fake.call(&mut slot), Ok(Engine::Im2col));
        assert_eq!(fake.ran, [1, 2], "no cuDNN call once settled on im2col");
    }

    #[test]
    fn no_algorithm_to_choose_runs_im2col() {
        let mut fake = Fake::new(&[1], &[1]);
        let mut slot = None;
        // 1 is refused; the fresh choice finds nothing else.
        assert_eq!(fake.call(&mut slot), Ok(Engine::Im2col));
        assert_eq!(fake.ran, [1]);
        assert!(matches!(slot, Some(Choice::Im2col)));
        let mut nothing = Fake::new(&[], &[]);
        let mut slot = None;
        assert_eq!(nothing.call(&mut slot), Ok(Engine::Im2col));
        assert!(nothing.ran.is_empty());
    }

    #[test]
    fn other_errors_propagate_and_leave_the_choice() {
        let mut slot = Some(Choice::Cudnn(1u32));
        let r = run_pass(
            &mut slot,
            |_| -> Result<Option<u32>, String> { panic!("no choice is made after an error") },
            |_| Err("CUDNN_STATUS_EXECUTION_FAILED".to_string()),
            |_| {},
        );
        assert_eq!(r, Err("CUDNN_STATUS_EXECUTION_FAILED".to_string()));
        assert!(matches!(slot, Some(Choice::Cudnn(1))));
    }
}
