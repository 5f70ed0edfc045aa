//! The bookkeeping of the pinned staging buffers host↔device copies go through: a bounded,
//! size-classed cache that never frees a buffer while training runs.
//!
//! Pinned memory is slow to allocate, and freeing it (`cuMemFreeHost`) can synchronise the whole
//! device, stalling every stream in the middle of a step. So the cache
//!
//! - rounds every request up to a **size class**, a power of two from [`MIN_CLASS_BYTES`]
//!   (64 KiB) to [`MAX_CLASS_BYTES`] (8 MiB, the copy chunk), so a buffer fits every later
//!   request of its class;
//! - holds at most [`CAP_BYTES`] (64 MiB) of pinned memory in all, idle or in use;
//! - **never frees** on its own: buffers go back to the cache after use, busy until the copy
//!   reading or writing them completes, and leave it only at an explicit trim point
//!   ([`PinnedCache::trim`], called by [`empty_cache`](super::empty_cache), where the user has
//!   already synchronised the device and asked for memory back).
//!
//! When a request finds no idle buffer whose copy has completed, the cache allocates a new one
//! if the cap allows. At the cap it hands out an idle buffer whose copy is still running,
//! together with that copy's completion, which the caller waits for: the host waits for one
//! earlier transfer (a few hundred microseconds for 8 MiB), never for the device as a whole.
//! Only when no idle buffer of the class or larger exists at all (every buffer is checked out by
//! other threads' copies at that moment, or the cap is taken by smaller classes) does the copy
//! go the **pageable** way ([`Staging::Pageable`]): the driver stages the caller's own memory
//! itself, synchronously for that copy and its stream (`cuMemcpy*Async` from pageable memory
//! waits for the stream, not for the device).
//!
//! The logic is generic over the buffer and the completion, so it is tested without a GPU; the
//! CUDA side (`transfer.rs`) instantiates it with `cuMemHostAlloc` buffers and CUDA events.

/// The smallest size class.
pub(crate) const MIN_CLASS_BYTES: usize = 64 << 10;
/// The largest size class (copies are cut into chunks of this size).
pub(crate) const MAX_CLASS_BYTES: usize = 8 << 20;
/// The most pinned memory the cache holds, idle and in use together: eight chunks in flight,
/// enough to keep a host-to-device link busy while the next chunks are staged.
pub(crate) const CAP_BYTES: usize = 64 << 20;

/// A staging buffer as the cache sees it.
pub(crate) trait StagingBuffer {
    /// Its size in bytes (the size class it was allocated for).
    fn capacity(&self) -> usize;
}

/// The completion of the copy that last used a buffer (a CUDA event on the device).
pub(crate) trait Completion {
    /// Whether the copy has completed (never blocks).
    fn is_complete(&self) -> bool;
}

/// The size class of a request of `bytes`: the next power of two, at least
/// [`MIN_CLASS_BYTES`]; `None` beyond [`MAX_CLASS_BYTES`].
pub(crate) fn size_class(bytes: usize) -> Option<usize> {
    let class = bytes.max(MIN_CLASS_BYTES).checked_next_power_of_two()?;
    (class <= MAX_CLASS_BYTES).then_some(class)
}

/// What a request gets.
pub(crate) enum Staging<B, E> {
    /// A buffer of at least the requested size. When `wait_for` is set, a copy still uses the
    /// buffer: wait for it (outside the cache's lock) before touching the buffer.
    Buffer { buffer: B, wait_for: Option<E> },
    /// No pinned buffer can be had without freeing one (see the module comment): copy through
    /// pageable memory.
    Pageable,
}

/// An idle buffer and the copy that may still use it.
struct Idle<B, E> {
    buffer: B,
    busy: Option<E>,
}

/// The cache (see the module comment). `B` is the buffer, `E` the completion of a copy.
pub(crate) struct PinnedCache<B, E> {
    /// Idle buffers, the most recently returned last.
    idle: Vec<Idle<B, E>>,
    /// Bytes of every buffer the cache has allocated and not trimmed (idle or checked out).
    held: usize,
    cap: usize,
}

impl<B: StagingBuffer, E: Completion> PinnedCache<B, E> {
    /// An empty cache holding at most `cap` bytes.
    pub(crate) const fn new(cap: usize) -> Self {
        PinnedCache {
            idle: Vec::new(),
            held: 0,
            cap,
        }
    }

    /// Bytes of pinned memory held (idle or checked out).
    #[cfg(test)]
    pub(crate) fn held_bytes(&self) -> usize {
        self.held
    }

    /// Idle buffers.
    #[cfg(test)]
    pub(crate) fn idle_buffers(&self) -> usize {
        self.idle.len()
    }

    /// A buffer for `bytes` bytes: an idle one of its class whose copy has completed, else a new
    /// one from `alloc` (called with the class size) if the cap allows, else an idle one of its
    /// class or larger with the copy to wait for, else [`Staging::Pageable`]. Never frees.
    pub(crate) fn take<Err>(
        &mut self,
        bytes: usize,
        alloc: impl FnOnce(usize) -> Result<B, Err>,
    ) -> Result<Staging<B, E>, Err> {
        let Some(class) = size_class(bytes) else {
            return Ok(Staging::Pageable);
        };
        let done = |i: &Idle<B, E>| i.busy.as_ref().is_none_or(Completion::is_complete);
        // The most recently returned idle buffer of the class that no copy uses.
        if let Some(i) = self
            .idle
            .iter()
            .rposition(|i| i.buffer.capacity() == class && done(i))
        {
            return Ok(self.hand_out(i, false));
        }
        if self.held + class <= self.cap {
            let buffer = alloc(class)?;
            self.held += class;
            return Ok(Staging::Buffer {
                buffer,
                wait_for: None,
            });
        }
        // At the cap: the smallest idle buffer that fits, preferring one already free, else
        // the one returned first (its copy was issued first, so it should finish first).
        let fits = |i: &Idle<B, E>| i.buffer.capacity() >= class;
        let free = self
            .idle
            .iter()
            .enumerate()
            .filter(|(_, i)| fits(i) && done(i))
            .min_by_key(|(_, i)| i.buffer.capacity())
            .map(|(n, _)| n);
        if let Some(i) = free {
            return Ok(self.hand_out(i, false));
        }
        match self.idle.iter().position(fits) {
            Some(i) => Ok(self.hand_out(i, true)),
            None => Ok(Staging::Pageable),
        }
    }

    fn hand_out(&mut self, index: usize, wait: bool) -> Staging<B, E> {
        let Idle { buffer, busy } = self.idle.remove(index);
        Staging::Buffer {
            buffer,
            wait_for: if wait { busy } else { None },
        }
    }

    /// Returns a buffer taken from this cache, in use until `busy` completes. Never frees.
    pub(crate) fn give(&mut self, buffer: B, busy: Option<E>) {
        self.idle.push(Idle { buffer, busy });
    }

    /// Removes the idle buffers whose copies have completed and returns them for the caller to
    /// free (outside the lock). Buffers still in use stay.
    pub(crate) fn trim(&mut self) -> Vec<B> {
        let mut freed = Vec::new();
        let mut kept = Vec::with_capacity(self.idle.len());
        for i in self.idle.drain(..) {
            if i.busy.as_ref().is_none_or(Completion::is_complete) {
                self.held -= i.buffer.capacity();
                freed.push(i.buffer);
            } else {
                kept.push(i);
            }
        }
        self.idle = kept;
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A buffer that counts its frees (drops) in a shared counter.
    struct Fake {
        capacity: usize,
        id: usize,
        frees: Rc<Cell<usize>>,
    }

    impl StagingBuffer for Fake {
        fn capacity(&self) -> usize {
            self.capacity
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.frees.set(self.frees.get() + 1);
        }
    }

    /// A copy's completion that the test completes by hand.
    #[derive(Clone)]
    struct Copy(Rc<Cell<bool>>);

    impl Completion for Copy {
        fn is_complete(&self) -> bool {
            self.0.get()
        }
    }

    fn copy_in_flight() -> Copy {
        Copy(Rc::new(Cell::new(false)))
    }

    struct World {
        cache: PinnedCache<Fake, Copy>,
        allocs: Vec<usize>,
        frees: Rc<Cell<usize>>,
    }

    impl World {
        fn new(cap: usize) -> Self {
            World {
                cache: PinnedCache::new(cap),
                allocs: Vec::new(),
                frees: Rc::new(Cell::new(0)),
            }
        }

        fn take(&mut self, bytes: usize) -> Staging<Fake, Copy> {
            let (allocs, frees) = (&mut self.allocs, &self.frees);
            let id = allocs.len();
            self.cache
                .take(bytes, |capacity| {
                    allocs.push(capacity);
                    Ok::<_, ()>(Fake {
                        capacity,
                        id,
                        frees: frees.clone(),
                    })
                })
                .unwrap()
        }

        /// Takes a buffer, expecting one, and returns it with whether it came with a wait.
        fn buffer(&mut self, bytes: usize) -> (Fake, Option<Copy>) {
            match self.take(bytes) {
                Staging::Buffer { buffer, wait_for } => (buffer, wait_for),
                Staging::Pageable => panic!("pageable for {bytes} bytes"),
            }
        }
    }

    #[test]
    fn requests_round_up_to_power_of_two_classes() {
        assert_eq!(size_class(0), Some(MIN_CLASS_BYTES));
        assert_eq!(size_class(1), Some(MIN_CLASS_BYTES));
        assert_eq!(size_class(MIN_CLASS_BYTES + 1), Some(2 * MIN_CLASS_BYTES));
        assert_eq!(size_class(3 << 20), Some(4 << 20));
        assert_eq!(size_class(MAX_CLASS_BYTES), Some(MAX_CLASS_BYTES));
        assert_eq!(size_class(MAX_CLASS_BYTES + 1), None);
        assert_eq!(size_class(usize::MAX), None);
    }

    #[test]
    fn a_buffer_is_reused_within_its_class_once_its_copy_completes() {
        let mut w = World::new(CAP_BYTES);
        let (a, _) = w.buffer(100 << 10);
        assert_eq!(a.capacity, 128 << 10);
        let copy = copy_in_flight();
        w.cache.give(a, Some(copy.clone()));
        // Still copying: a second request of the class gets a new buffer.
        let (b, wait) = w.buffer(128 << 10);
        assert!(wait.is_none());
        assert_eq!(b.id, 1);
        // Another class never takes it.
        let (c, _) = w.buffer(1 << 20);
        assert_eq!((c.id, c.capacity), (2, 1 << 20));
        copy.0.set(true);
        let (d, wait) = w.buffer(70 << 10);
        assert!(wait.is_none());
        assert_eq!(d.id, 0, "the completed buffer of the class is reused");
        assert_eq!(w.allocs, [128 << 10, 128 << 10, 1 << 20]);
        assert_eq!(w.cache.held_bytes(), (256 << 10) + (1 << 20));
        drop((b, c, d));
    }

    #[test]
    fn the_cap_bounds_pinned_memory_and_a_busy_buffer_is_waited_for_not_freed() {
        let mut w = World::new(4 * MAX_CLASS_BYTES);
        let copies: Vec<Copy> = (0..4).map(|_| copy_in_flight()).collect();
        for copy in &copies {
            let (buffer, _) = w.buffer(MAX_CLASS_BYTES);
            w.cache.give(buffer, Some(copy.clone()));
        }
        assert_eq!(w.cache.held_bytes(), 4 * MAX_CLASS_BYTES);
        // At the cap with every copy in flight: the first buffer returned, with its copy to
        // wait for; nothing new allocated, nothing freed.
        let (buffer, wait) = w.buffer(MAX_CLASS_BYTES);
        assert_eq!(buffer.id, 0);
        assert!(wait.is_some_and(|c| Rc::ptr_eq(&c.0, &copies[0].0)));
        assert_eq!(w.allocs.len(), 4);
        assert_eq!(w.frees.get(), 0);
        w.cache.give(buffer, Some(copy_in_flight()));
        // A completed buffer of a larger class serves a small request at the cap.
        copies[2].0.set(true);
        let (small, wait) = w.buffer(1000);
        assert!(wait.is_none());
        assert_eq!(small.id, 2);
        assert_eq!(w.cache.held_bytes(), 4 * MAX_CLASS_BYTES);
        drop(small);
    }

    #[test]
    fn with_no_idle_buffer_at_the_cap_the_copy_goes_pageable() {
        let mut w = World::new(2 * MAX_CLASS_BYTES);
        let (a, _) = w.buffer(MAX_CLASS_BYTES);
        let (b, _) = w.buffer(MAX_CLASS_BYTES);
        // Both checked out (other threads' copies): nothing to wait for, nothing to allocate.
        assert!(matches!(w.take(MAX_CLASS_BYTES), Staging::Pageable));
        // Beyond the largest class: pageable, at any fill.
        let mut empty = World::new(CAP_BYTES);
        assert!(matches!(empty.take(MAX_CLASS_BYTES + 1), Staging::Pageable));
        assert!(empty.allocs.is_empty());
        // Smaller buffers idle at the cap do not serve a larger request.
        w.cache.give(a, None);
        w.cache.give(b, None);
        let mut small = World::new(3 * MIN_CLASS_BYTES);
        let (s, _) = small.buffer(1);
        small.cache.give(s, None);
        let (t, _) = small.buffer(MIN_CLASS_BYTES + 1);
        assert_eq!(small.cache.held_bytes(), 3 * MIN_CLASS_BYTES);
        assert!(matches!(small.take(MIN_CLASS_BYTES + 1), Staging::Pageable));
        small.cache.give(t, None);
        assert_eq!(w.frees.get() + small.frees.get(), 0);
    }

    #[test]
    fn a_long_run_of_copies_never_frees_until_the_trim() {
        const IN_FLIGHT: usize = 10;
        let mut w = World::new(CAP_BYTES);
        let mut pending: Vec<Copy> = Vec::new();
        // Many steps of uploads of mixed sizes, each copy completing ten requests later: more
        // buffers in flight than the eight the old pool kept.
        for step in 0..200usize {
            let bytes = [3 << 20, 8 << 20, 200 << 10, 8 << 20, 64 << 10][step % 5];
            let (buffer, wait) = match w.take(bytes) {
                Staging::Buffer { buffer, wait_for } => (buffer, wait_for),
                Staging::Pageable => continue,
            };
            if let Some(copy) = wait {
                copy.0.set(true); // the caller waits for it
            }
            let copy = copy_in_flight();
            w.cache.give(buffer, Some(copy.clone()));
            pending.push(copy);
            if pending.len() > IN_FLIGHT {
                pending.remove(0).0.set(true);
            }
            assert!(w.cache.held_bytes() <= CAP_BYTES);
        }
        assert_eq!(
            w.frees.get(),
            0,
            "no pinned buffer is freed during the steps"
        );
        let allocated: usize = w.allocs.iter().sum();
        assert_eq!(allocated, w.cache.held_bytes());
        assert!(
            w.allocs.len() <= 2 * IN_FLIGHT,
            "buffers are reused: {:?}",
            w.allocs
        );
        // The trim frees the idle buffers whose copies completed, and only those.
        let completed = w.cache.idle_buffers() - IN_FLIGHT;
        let freed = w.cache.trim();
        assert_eq!(freed.len(), completed);
        drop(freed);
        assert_eq!(w.frees.get(), completed);
        assert_eq!(w.cache.idle_buffers(), IN_FLIGHT);
        for copy in &pending {
            copy.0.set(true);
        }
        drop(w.cache.trim());
        assert_eq!(w.cache.held_bytes(), 0);
        assert_eq!(w.frees.get(), w.allocs.len());
    }
}
