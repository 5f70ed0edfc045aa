//! The cache of uploaded tables, with leases: a table a launch is about to read stays alive until
//! that launch is queued.
//!
//! A caller asks for a table and gets a [`TableLease`] with its device address; it builds and
//! queues the launch, and only then drops the lease. While any lease on a table lives the cache
//! never evicts it (eviction under pressure takes the least recently used table nobody leases;
//! if every table is leased the cache briefly holds more than its capacity). The lease also owns
//! a reference to the upload itself, so even a table dropped from the cache keeps its memory
//! until the lease ends.
//!
//! That is enough for stream-ordered memory. Tables are uploaded on, and read by launches on,
//! the device's compute stream, and an upload's memory is freed with `cuMemFreeAsync` on that
//! stream when its last owner drops it. A lease dropped after the launch is queued therefore
//! puts the free after the launch in stream order: the pool cannot hand the memory to later
//! work on that stream before the launch has read it, nor to another stream before that stream
//! is ordered after the free (the pool allows no hidden cross-stream reuse, see core's
//! `POOL_SETTINGS`). Without the lease, another thread could evict the table between the lookup
//! and the launch; its free, and an allocation reusing the memory and overwriting it, would then
//! be queued before the launch that reads it.
//!
//! The cache is generic over what an upload is (a device tensor on a GPU, a fake in the tests),
//! so its rules are tested without a device.

use std::collections::VecDeque;
use std::sync::Arc;

use tandem_core::Tensor;

use super::table::TensorTable;
use crate::Result;

/// A table on a device.
struct Cached<U> {
    ordinal: usize,
    table: TensorTable,
    /// The words in device memory (freed in stream order when the last owner drops it). Owned,
    /// not read: holding it is what keeps the memory alive for the leases.
    #[cfg_attr(not(test), allow(dead_code))]
    uploaded: U,
    /// The device address of the words.
    address: u64,
}

/// A table held for a launch: drop it only after the launch reading it is queued.
pub(crate) struct TableLease<U = Tensor>(Arc<Cached<U>>);

impl<U> TableLease<U> {
    /// The device address of the table's words.
    pub(crate) fn address(&self) -> u64 {
        self.0.address
    }
}

/// Tables uploaded to devices, the most recently used first, at most `capacity` of them that no
/// lease holds. `U` is an upload: a device tensor, except in tests.
pub(crate) struct TableCache<U = Tensor> {
    capacity: usize,
    tables: VecDeque<Arc<Cached<U>>>,
}

impl<U> TableCache<U> {
    /// An empty cache keeping up to `capacity` tables (at least one).
    pub(crate) const fn new(capacity: usize) -> Self {
        TableCache {
            capacity,
            tables: VecDeque::new(),
        }
    }

    /// A lease on `table` on `cuda:ordinal`: the cached copy when one with the same words exists,
    /// otherwise a new one from `upload` (returning the upload and its device address), after
    /// `validate` accepts the table (a table that passed once is not checked again).
    pub(crate) fn lease_with(
        &mut self,
        ordinal: usize,
        table: &TensorTable,
        validate: impl FnOnce(&TensorTable) -> Result<()>,
        upload: impl FnOnce(&TensorTable) -> Result<(U, u64)>,
    ) -> Result<TableLease<U>> {
        let found = self.tables.iter().position(|c| {
            c.ordinal == ordinal
                && c.table.dtype() == table.dtype()
                && c.table.chunk_size() == table.chunk_size()
                && c.table.words() == table.words()
        });
        if let Some(i) = found {
            let hit = self.tables.remove(i).expect("index from position");
            let lease = TableLease(hit.clone());
            self.tables.push_front(hit);
            return Ok(lease);
        }
        validate(table)?;
        let (uploaded, address) = upload(table)?;
        let cached = Arc::new(Cached {
            ordinal,
            table: table.clone(),
            uploaded,
            address,
        });
        let lease = TableLease(cached.clone());
        self.tables.push_front(cached);
        self.evict();
        Ok(lease)
    }

    /// Drops the least recently used tables that no lease holds until at most `capacity` remain
    /// (fewer cannot be reached while leases hold the rest; the next call tries again).
    fn evict(&mut self) {
        while self.tables.len() > self.capacity.max(1) {
            // The cache's own reference is the only one of an unleased table. Leases are made
            // only under `&mut self`, so a count of 1 cannot grow while we look.
            match self.tables.iter().rposition(|c| Arc::strong_count(c) == 1) {
                Some(i) => drop(self.tables.remove(i)),
                None => break,
            }
        }
    }

    /// Tables cached now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.tables.len()
    }
}

impl<U> Cached<U> {
    #[cfg(test)]
    fn uploaded(&self) -> &U {
        &self.uploaded
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::multi_tensor::TableEntry;
    use std::cell::RefCell;
    use std::rc::Rc;
    use tandem_core::DType;

    /// An upload that notes its freeing (its drop) in a shared log.
    struct FakeUpload {
        id: u64,
        freed: Rc<RefCell<Vec<u64>>>,
    }

    impl Drop for FakeUpload {
        fn drop(&mut self) {
            self.freed.borrow_mut().push(self.id);
        }
    }

    /// A table of one gradient at address `id * 0x1000` (distinct words per id).
    fn table(id: u64) -> TensorTable {
        let entry = TableEntry {
            grad: id * 0x1000,
            numel: 4,
            ..Default::default()
        };
        TensorTable::new("t", DType::F32, &[entry], 4).unwrap()
    }

    struct World {
        cache: TableCache<FakeUpload>,
        uploads: Vec<u64>,
        freed: Rc<RefCell<Vec<u64>>>,
    }

    impl World {
        fn new(capacity: usize) -> Self {
            World {
                cache: TableCache::new(capacity),
                uploads: Vec::new(),
                freed: Rc::new(RefCell::new(Vec::new())),
            }
        }

        fn lease(&mut self, id: u64) -> TableLease<FakeUpload> {
            let (uploads, freed) = (&mut self.uploads, &self.freed);
            self.cache
                .lease_with(
                    0,
                    &table(id),
                    |_| Ok(()),
                    |_| {
                        uploads.push(id);
                        let upload = FakeUpload {
                            id,
                            freed: freed.clone(),
                        };
                        Ok((upload, 0x9000_0000 + id))
                    },
                )
                .unwrap()
        }
    }

    #[test]
    fn a_leased_table_is_not_evicted_before_its_launch_is_queued() {
        let mut w = World::new(2);
        // Thread A looks its table up; before it launches, other threads fill the cache.
        let lease = w.lease(1);
        for id in 2..10 {
            drop(w.lease(id));
        }
        assert!(
            !w.freed.borrow().contains(&1),
            "the table A is about to launch with was freed first: {:?}",
            w.freed.borrow()
        );
        assert_eq!(lease.address(), 0x9000_0001);
        assert_eq!(lease.0.uploaded().id, 1);
        // A's launch is queued; the lease ends. A is now the oldest unleased table and is the
        // next to go under pressure.
        drop(lease);
        drop(w.lease(10));
        assert!(w.freed.borrow().contains(&1));
        assert_eq!(w.cache.len(), 2);
    }

    #[test]
    fn eviction_under_pressure_takes_the_least_recently_used_unleased_table() {
        let mut w = World::new(2);
        let held = w.lease(1);
        drop(w.lease(2));
        drop(w.lease(3)); // over capacity: 2 goes, 1 is leased
        assert_eq!(*w.freed.borrow(), [2]);
        // 1 is still cached: leasing it again uploads nothing.
        let again = w.lease(1);
        assert_eq!(w.uploads, [1, 2, 3]);
        assert_eq!(again.address(), held.address());
        drop((held, again));
        drop(w.lease(4)); // 3 is now the least recently used
        assert_eq!(*w.freed.borrow(), [2, 3]);
    }

    #[test]
    fn with_every_table_leased_the_cache_grows_then_shrinks_back() {
        let mut w = World::new(2);
        let leases: Vec<_> = (1..=4).map(|id| w.lease(id)).collect();
        assert_eq!(w.cache.len(), 4);
        assert!(w.freed.borrow().is_empty());
        drop(leases);
        drop(w.lease(5));
        assert_eq!(w.cache.len(), 2);
        assert_eq!(*w.freed.borrow(), [1, 2, 3]);
    }

    #[test]
    fn a_table_is_validated_once_and_a_rejected_one_is_not_uploaded() {
        let mut w = World::new(4);
        let mut checks = 0;
        for _ in 0..3 {
            let lease = w.cache.lease_with(
                0,
                &table(7),
                |_| {
                    checks += 1;
                    Ok(())
                },
                |_| {
                    Ok((
                        FakeUpload {
                            id: 7,
                            freed: w.freed.clone(),
                        },
                        0x7000,
                    ))
                },
            );
            assert_eq!(lease.unwrap().address(), 0x7000);
        }
        assert_eq!(checks, 1);
        let rejected = w.cache.lease_with(
            0,
            &table(8),
            |_| Err(crate::Error::Clip { msg: "no".into() }),
            |_| panic!("a rejected table is uploaded"),
        );
        assert!(rejected.is_err());
        // Another device's table with the same words is another table.
        let other = w
            .cache
            .lease_with(
                1,
                &table(7),
                |_| Ok(()),
                |_| {
                    Ok((
                        FakeUpload {
                            id: 70,
                            freed: w.freed.clone(),
                        },
                        0x7100,
                    ))
                },
            )
            .unwrap();
        assert_eq!(other.address(), 0x7100);
    }
}
