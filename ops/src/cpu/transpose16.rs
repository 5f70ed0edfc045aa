//! A 16 × 16 transpose of 16-bit values (bf16, f16) with AVX-512BW: three rounds of
//! two-register permutes (`vpermt2w`) over eight registers that each hold two rows.
//!
//! Each round merges pairs of registers so that a register holds twice as many rows of half as
//! many columns, with the row index fastest: after the first round a register holds 4 rows × 8
//! columns, after the second 8 × 4, after the third 16 × 2 — two whole columns, i.e. two rows of
//! the transpose. The permute indices are worked out once, by labelling every element with its
//! (row, column) and looking each wanted label up in the two source registers.

use std::arch::x86_64::*;
use std::sync::OnceLock;

/// The labels `(row, col)` of one register's 32 elements.
type Labels = [(u8, u8); 32];

/// One round: for output register `k` (of 8), its two sources and the 32 indices into them.
struct Round {
    sources: [(usize, usize); 8],
    index: [[u16; 32]; 8],
}

/// The three rounds, and the labels they end with (checked by the test).
struct Plan {
    rounds: [Round; 3],
    last: [Labels; 8],
}

/// Builds the rounds by labelling. Start: register `i` holds rows `2i` and `2i + 1`.
fn plan() -> Plan {
    let mut labels: [Labels; 8] = [[(0, 0); 32]; 8];
    for (i, reg) in labels.iter_mut().enumerate() {
        for (e, l) in reg.iter_mut().enumerate() {
            *l = ((2 * i + e / 16) as u8, (e % 16) as u8);
        }
    }
    let mut rounds = Vec::with_capacity(3);
    // Round k: registers hold `rows` rows × `cols` columns (row fastest after round 0);
    // registers 2j and 2j+1... are merged so that rows double and columns halve.
    let mut rows = 2usize;
    for _ in 0..3 {
        let cols = 32 / rows;
        let (new_rows, new_cols) = (rows * 2, cols / 2);
        let mut next: [Labels; 8] = [[(0, 0); 32]; 8];
        let mut sources = [(0, 0); 8];
        let mut index = [[0u16; 32]; 8];
        // Register pairs holding consecutive row groups with the same columns: pair (a, b)
        // gives two outputs, the lower and the upper half of the columns.
        let groups = 16 / rows; // row groups; each group has `16 / cols` registers
        let per_group = 16 / cols;
        let mut out = 0;
        for g in (0..groups).step_by(2) {
            for c in 0..per_group {
                let (a, b) = (g * per_group + c, (g + 1) * per_group + c);
                let (r0, c0) = (
                    labels[a][0].0 as usize,
                    labels[a].iter().map(|l| l.1).min().unwrap() as usize,
                );
                for half in 0..2 {
                    let mut reg = [(0u8, 0u8); 32];
                    for (e, l) in reg.iter_mut().enumerate() {
                        let (cc, rr) = (e / new_rows, e % new_rows);
                        *l = ((r0 + rr) as u8, (c0 + half * new_cols + cc) as u8);
                    }
                    for (e, want) in reg.iter().enumerate() {
                        let from_a = labels[a].iter().position(|l| l == want);
                        let from_b = labels[b].iter().position(|l| l == want).map(|p| p + 32);
                        index[out][e] = from_a.or(from_b).expect("every label has a source") as u16;
                    }
                    sources[out] = (a, b);
                    next[out] = reg;
                    out += 1;
                }
            }
        }
        rounds.push(Round { sources, index });
        labels = next;
        rows = new_rows;
    }
    let rounds: [Round; 3] = rounds.try_into().ok().expect("three rounds");
    Plan {
        rounds,
        last: labels,
    }
}

fn the_plan() -> &'static Plan {
    static PLAN: OnceLock<Plan> = OnceLock::new();
    PLAN.get_or_init(plan)
}

/// Writes the transpose of the 16 × 16 block at `src` (rows `src_stride` elements apart) to
/// `dst` (rows `dst_stride` apart): `dst[c][r] = src[r][c]`.
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW; the 16 rows of 16 values at `src` must be
/// readable and those at `dst` writable.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn transpose16(
    src: *const u16,
    src_stride: usize,
    dst: *mut u16,
    dst_stride: usize,
) {
    let plan = the_plan();
    let mut regs = [_mm512_setzero_si512(); 8];
    for (i, reg) in regs.iter_mut().enumerate() {
        let lo = _mm256_loadu_si256(src.add(2 * i * src_stride).cast());
        let hi = _mm256_loadu_si256(src.add((2 * i + 1) * src_stride).cast());
        *reg = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
    }
    for round in &plan.rounds {
        let mut next = [_mm512_setzero_si512(); 8];
        for (k, n) in next.iter_mut().enumerate() {
            let (a, b) = round.sources[k];
            let idx = _mm512_loadu_si512(round.index[k].as_ptr().cast());
            *n = _mm512_permutex2var_epi16(regs[a], idx, regs[b]);
        }
        regs = next;
    }
    // Register k now holds columns 2k, 2k+1 (16 rows each, row fastest).
    for (k, reg) in regs.iter().enumerate() {
        let c = plan.last[k][0].1 as usize;
        _mm256_storeu_si256(dst.add(c * dst_stride).cast(), _mm512_castsi512_si256(*reg));
        _mm256_storeu_si256(
            dst.add((c + 1) * dst_stride).cast(),
            _mm512_extracti64x4_epi64::<1>(*reg),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rounds_end_with_two_whole_columns_per_register() {
        let plan = plan();
        let mut seen = [false; 16];
        for reg in &plan.last {
            let c = reg[0].1 as usize;
            seen[c] = true;
            for (e, &(r, cc)) in reg.iter().enumerate() {
                assert_eq!((r as usize, cc as usize), (e % 16, c + e / 16));
            }
        }
        assert!(seen.iter().step_by(2).all(|&s| s));
    }

    #[test]
    fn transposes_a_strided_block() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
            eprintln!("no AVX-512BW here: skipped");
            return;
        }
        let (ss, ds) = (21, 37);
        let src: Vec<u16> = (0..16 * ss).map(|i| i as u16).collect();
        let mut dst = vec![0u16; 16 * ds];
        // SAFETY: AVX-512BW checked above; 16 rows of each stride fit the buffers.
        unsafe { transpose16(src.as_ptr(), ss, dst.as_mut_ptr(), ds) };
        for r in 0..16 {
            for c in 0..16 {
                assert_eq!(dst[c * ds + r], src[r * ss + c], "row {r} column {c}");
            }
        }
    }
}
