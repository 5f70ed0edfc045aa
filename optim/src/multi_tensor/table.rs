//! The table a multi-tensor kernel walks: one 64-byte entry per tensor (`optim_tensor` in
//! `kernels/multi_tensor.cuh`) with the addresses of the tensor's element 0 in each role, its
//! size, and the number of chunks of all tensors before it.
//!
//! Building a table is pure host arithmetic on addresses, so the host harness runs the very
//! tables the CUDA path uploads. The builder leaves empty tensors out (a kernel has nothing to
//! do for them and their address may be null), numbers the chunks, and checks the counts the
//! kernels rely on: at most `i32::MAX` tensors (a 32-bit search), no arithmetic overflow.

use tandem_core::cuda::launch::index_u32;
use tandem_core::{DType, Error, Result};

/// Words (u64) per table entry.
pub const ENTRY_WORDS: usize = 8;

/// One tensor of a multi-tensor launch: device addresses of element 0 of each dense tensor it
/// involves (0 for a role the kernel does not use) and its number of elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableEntry {
    /// The parameter (updated in place by SGD and Adam).
    pub param: u64,
    /// Its gradient (read by updates; scaled by clipping, zeroed by zero_grad).
    pub grad: u64,
    /// Per-element optimizer state: SGD's momentum buffer in `state[0]`; Adam's `exp_avg`,
    /// `exp_avg_sq` and (AMSGrad) `max_exp_avg_sq`.
    pub state: [u64; 3],
    /// Elements of each of the tensors above (they all have the parameter's shape).
    pub numel: u64,
}

impl TableEntry {
    /// The addresses in the order of the kernel's struct.
    fn addresses(&self) -> [u64; 5] {
        [
            self.param,
            self.grad,
            self.state[0],
            self.state[1],
            self.state[2],
        ]
    }
}

/// A table ready to upload: its words, and the counts a launch needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorTable {
    dtype: DType,
    chunk_size: u64,
    words: Vec<u64>,
    /// For each entry, its position in the list the table was built from (for messages).
    positions: Vec<usize>,
    chunks: u64,
}

impl TensorTable {
    /// The table of `entries` (tensors of `dtype`, cut into chunks of `chunk_size` elements),
    /// leaving out empty ones. Errors name `op`.
    pub fn new(
        op: &'static str,
        dtype: DType,
        entries: &[TableEntry],
        chunk_size: u64,
    ) -> Result<Self> {
        if chunk_size == 0 {
            return Err(Error::invalid(op, "multi-tensor chunk size must be > 0"));
        }
        let mut words = Vec::with_capacity(entries.len() * ENTRY_WORDS);
        let mut positions = Vec::with_capacity(entries.len());
        let mut chunks: u64 = 0;
        for (position, entry) in entries.iter().enumerate() {
            if entry.numel == 0 {
                continue;
            }
            let bytes = entry.numel.checked_mul(dtype.size_in_bytes() as u64);
            let fits = entry
                .addresses()
                .iter()
                .all(|&a| a == 0 || bytes.and_then(|b| a.checked_add(b)).is_some());
            if !fits || entry.param == 0 && entry.grad == 0 {
                return Err(Error::invalid(
                    op,
                    format!(
                        "tensor {position} of the multi-tensor table ({} elements of {dtype} at \
                         {:#x?}) has no address or reaches beyond the 64-bit address space",
                        entry.numel,
                        entry.addresses()
                    ),
                ));
            }
            words.extend_from_slice(&[
                entry.param,
                entry.grad,
                entry.state[0],
                entry.state[1],
                entry.state[2],
                entry.numel,
                chunks,
                0,
            ]);
            positions.push(position);
            chunks = chunks
                .checked_add(entry.numel.div_ceil(chunk_size))
                .ok_or_else(|| Error::invalid(op, "multi-tensor chunk count overflows"))?;
        }
        index_u32(op, "the number of tensors in one launch", positions.len())?;
        Ok(TensorTable {
            dtype,
            chunk_size,
            words,
            positions,
            chunks,
        })
    }

    /// The element type of every tensor in the table.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements per chunk.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// The words to upload, [`ENTRY_WORDS`] per entry.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Entries (non-empty tensors).
    pub fn tensors(&self) -> u32 {
        // new() checked that the count fits.
        self.positions.len() as u32
    }

    /// The addresses of each entry's roles, in the order param, grad, state 0..3 (0 for a role
    /// the kernel does not use).
    pub fn entry_addresses(&self) -> impl Iterator<Item = [u64; 5]> + '_ {
        self.words
            .chunks_exact(ENTRY_WORDS)
            .map(|w| [w[0], w[1], w[2], w[3], w[4]])
    }

    /// Whether the table has no entries (nothing to launch).
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Chunks of all tensors together: the blocks' work items.
    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    /// The first pair of entries (as positions in the list the table was built from; possibly
    /// the same position twice) whose memory overlaps in any two roles, if any. Each element of
    /// each role is written or read by one thread only when nothing overlaps.
    pub fn first_overlap(&self) -> Option<(usize, usize)> {
        let size = self.dtype.size_in_bytes() as u64;
        let mut ranges: Vec<(u64, u64, usize)> = Vec::with_capacity(self.positions.len() * 2);
        for (entry, &position) in self.words.chunks_exact(ENTRY_WORDS).zip(&self.positions) {
            let end = entry[5] * size;
            for &address in &entry[..5] {
                if address != 0 {
                    ranges.push((address, address + end, position));
                }
            }
        }
        ranges.sort_unstable();
        ranges
            .windows(2)
            .find(|w| w[1].0 < w[0].1)
            .map(|w| (w[0].2.min(w[1].2), w[0].2.max(w[1].2)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(param: u64, grad: u64, numel: u64) -> TableEntry {
        TableEntry {
            param,
            grad,
            numel,
            ..Default::default()
        }
    }

    #[test]
    fn chunks_are_numbered_across_tensors_and_empty_tensors_are_left_out() {
        let entries = [
            entry(0x1000, 0x9000, 10),
            entry(0, 0, 0),
            entry(0x2000, 0xa000, 4),
            entry(0x3000, 0xb000, 9),
        ];
        let table = TensorTable::new("t", DType::F32, &entries, 4).unwrap();
        assert_eq!(table.tensors(), 3);
        assert_eq!(table.chunks(), 3 + 1 + 3);
        let first_chunks: Vec<u64> = table
            .words()
            .chunks_exact(ENTRY_WORDS)
            .map(|e| e[6])
            .collect();
        assert_eq!(first_chunks, [0, 3, 4]);
        assert_eq!(table.words()[..8], [0x1000, 0x9000, 0, 0, 0, 10, 0, 0]);
        assert_eq!(table.first_overlap(), None);
    }

    #[test]
    fn overlapping_memory_is_found_and_named_by_position() {
        // 10 f32 at 0x1000 end at 0x1028; the third tensor's gradient starts inside.
        let entries = [
            entry(0x1000, 0x9000, 10),
            entry(0x2000, 0xa000, 4),
            entry(0x3000, 0x1024, 1),
        ];
        let table = TensorTable::new("t", DType::F32, &entries, 4).unwrap();
        assert_eq!(table.first_overlap(), Some((0, 2)));
        // Adjacent is not overlapping.
        let entries = [entry(0x1000, 0x9000, 10), entry(0x1028, 0x9028, 1)];
        let table = TensorTable::new("t", DType::F32, &entries, 4).unwrap();
        assert_eq!(table.first_overlap(), None);
    }

    #[test]
    fn bad_sizes_and_addresses_are_errors() {
        assert!(TensorTable::new("t", DType::F32, &[entry(0x1000, 0x2000, 1)], 0).is_err());
        let err = TensorTable::new("sgd", DType::F64, &[entry(u64::MAX - 8, 0x2000, 2)], 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("sgd") && err.contains("tensor 0"), "{err}");
        assert!(TensorTable::new("t", DType::F32, &[entry(0, 0, 3)], 4).is_err());
        let empty = TensorTable::new("t", DType::F32, &[], 4).unwrap();
        assert!(empty.is_empty() && empty.chunks() == 0);
    }
}
