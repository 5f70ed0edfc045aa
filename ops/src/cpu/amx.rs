//! Intel AMX tiles with BF16 dot products: the matrix unit of Sapphire Rapids and later Xeons,
//! which the bf16 convolution (`conv2d/cpu/amx.rs`) runs on.
//!
//! AMX has eight tile registers (`tmm0`–`tmm7`), each up to 16 rows of 64 bytes, shaped by a
//! 64-byte tile configuration loaded per thread (`ldtilecfg`). `tdpbf16ps c, a, b` adds to the
//! f32 tile `c` (`M × N`) the product of the bf16 tile `a` (`M × 2K`) and the bf16 tile `b`,
//! stored pair-interleaved as `K` rows of `N` pairs (each 32-bit element holds the values of
//! two consecutive `k`, the even one in the low half) — one instruction does `16·16·32`
//! multiply-adds, each product exact and summed in f32.
//!
//! Using AMX takes three things, all checked once by [`detect`]: the CPU reports AMX-TILE and
//! AMX-BF16 (CPUID leaf 7), it has AVX-512BW and AVX512-BF16 (for the packing and rounding
//! around the tiles), and the
//! Linux kernel grants this process the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`; without it the first tile instruction raises SIGILL). Setting
//! `TANDEM_NO_AMX` (any value) turns AMX off, for comparisons and tests of the other paths.
//!
//! The instructions are not exposed as stable intrinsics, so they are emitted with `asm!`; the
//! tile register numbers are `const` operands. The tile registers are invisible to the
//! compiler, which is fine: each instruction is its own `asm!` block, and blocks are emitted in
//! program order with their memory effects.

#[cfg(target_arch = "x86_64")]
use std::arch::asm;
use std::sync::OnceLock;

/// Proof that this process may run AMX-BF16 tile instructions (and AVX-512F, AVX-512BW and
/// AVX512-BF16): only
/// [`detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Amx {
    _granted: (),
}

/// `Some` where this CPU has AMX-BF16 and the kernel granted the tile state, once per process.
pub(crate) fn detect() -> Option<Amx> {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    GRANTED
        .get_or_init(|| std::env::var_os("TANDEM_NO_AMX").is_none() && request())
        .then_some(Amx { _granted: () })
}

/// Whether the CPU has AMX-TILE, AMX-BF16, AVX-512F/BW and AVX512-BF16, and Linux grants the
/// tile data state to this process.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request() -> bool {
    if !std::arch::is_x86_feature_detected!("avx512f")
        || !std::arch::is_x86_feature_detected!("avx512bw")
        || !std::arch::is_x86_feature_detected!("avx512bf16")
    {
        return false;
    }
    // Leaf 7 is valid when the maximum basic leaf (leaf 0's eax) is at least 7.
    if std::arch::x86_64::__cpuid(0).eax < 7 {
        return false;
    }
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    let (amx_bf16, amx_tile) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
    if !(amx_bf16 && amx_tile) {
        return false;
    }
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) only asks the kernel to
    // enlarge this process's saved register state; it reads no user memory. The syscall
    // clobbers rcx and r11, declared below.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request() -> bool {
    false
}

/// The shapes of the eight tiles (palette 1), in the 64-byte layout `ldtilecfg` reads.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile.
    colsb: [u16; 16],
    /// Rows of each tile.
    rows: [u8; 16],
}

impl TileConfig {
    /// A configuration with every tile unused.
    pub(crate) const fn new() -> Self {
        TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        }
    }

    /// Every tile with `rows` rows of `bytes` bytes (at most 16 and 64, a multiple of 4).
    pub(crate) const fn uniform(rows: u8, bytes: u16) -> Self {
        assert!(rows >= 1 && rows <= 16 && bytes >= 4 && bytes <= 64 && bytes.is_multiple_of(4));
        let mut c = TileConfig::new();
        let mut t = 0;
        while t < 8 {
            c.rows[t] = rows;
            c.colsb[t] = bytes;
            t += 1;
        }
        c
    }

    /// Tile `t` with `rows` rows of `bytes` bytes (at most 16 and 64).
    pub(crate) fn tile(mut self, t: usize, rows: usize, bytes: usize) -> Self {
        assert!(
            t < 8
                && (1..=16).contains(&rows)
                && (4..=64).contains(&bytes)
                && bytes.is_multiple_of(4)
        );
        self.rows[t] = rows as u8;
        self.colsb[t] = bytes as u16;
        self
    }
}

/// The tile state of the calling thread while it is configured: loads `config` on creation
/// and releases the tiles when dropped (so the thread does not carry the large tile state into
/// context switches once done).
pub(crate) struct Tiles {
    _amx: Amx,
}

impl Tiles {
    /// Configures the calling thread's tiles.
    pub(crate) fn configure(amx: Amx, config: &TileConfig) -> Tiles {
        // SAFETY: `amx` proves the tile state was granted; `config` is a valid palette-1
        // configuration (`TileConfig::tile` checks each shape), 64-byte aligned.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) config as *const TileConfig, options(nostack, readonly));
        }
        Tiles { _amx: amx }
    }

    /// Zeroes tile `T`.
    #[inline(always)]
    pub(crate) fn zero<const T: u8>(&self) {
        // SAFETY: the tiles are configured (self exists); tilezero touches no memory.
        unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) }
    }

    /// Loads tile `T` from `rows` rows `stride` bytes apart starting at `ptr`.
    ///
    /// # Safety
    /// Every row's configured bytes, `ptr + r·stride .. + colsb` for each configured row `r`,
    /// must be readable.
    #[inline(always)]
    pub(crate) unsafe fn load<const T: u8>(&self, ptr: *const u8, stride: usize) {
        asm!(
            "tileloadd tmm{t}, [{p} + {s} * 1]",
            t = const T,
            p = in(reg) ptr,
            s = in(reg) stride,
            options(nostack, readonly),
        );
    }

    /// Stores tile `T` to rows `stride` bytes apart starting at `ptr`.
    ///
    /// # Safety
    /// Every row's configured bytes must be writable and not aliased by live references.
    #[inline(always)]
    pub(crate) unsafe fn store<const T: u8>(&self, ptr: *mut u8, stride: usize) {
        asm!(
            "tilestored [{p} + {s} * 1], tmm{t}",
            t = const T,
            p = in(reg) ptr,
            s = in(reg) stride,
            options(nostack),
        );
    }

    /// `C += A · B` on tiles (`tdpbf16ps`): C f32 `M × N`, A bf16 `M × 2K`, B bf16 pairs
    /// `K × N`; the shapes come from the configuration.
    #[inline(always)]
    pub(crate) fn dot<const C: u8, const A: u8, const B: u8>(&self) {
        // SAFETY: the tiles are configured; the instruction works on registers only. The
        // callers configure compatible shapes (a mismatch raises #UD, not memory unsafety).
        unsafe {
            asm!(
                "tdpbf16ps tmm{c}, tmm{a}, tmm{b}",
                c = const C,
                a = const A,
                b = const B,
                options(nostack, nomem),
            );
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: tilerelease returns the tiles to their initial state; nothing reads them
        // after this.
        unsafe { asm!("tilerelease", options(nostack, nomem)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::half::bf16;

    #[test]
    fn one_tile_product_matches_the_plain_sum() {
        let Some(amx) = detect() else {
            eprintln!("no AMX-BF16 here: skipped");
            return;
        };
        // A: 16 × 32 bf16, B: 16 pairs-rows × 16 columns × 2.
        let a: Vec<bf16> = (0..16 * 32)
            .map(|i| bf16::from_f32((i % 7) as f32 - 3.0))
            .collect();
        let b: Vec<bf16> = (0..16 * 32)
            .map(|i| bf16::from_f32((i % 5) as f32 * 0.5))
            .collect();
        let mut c = vec![1.0f32; 256];
        let config = TileConfig::new()
            .tile(0, 16, 64)
            .tile(1, 16, 64)
            .tile(2, 16, 64);
        let tiles = Tiles::configure(amx, &config);
        // SAFETY: each buffer holds 16 rows of 64 bytes.
        unsafe {
            tiles.load::<0>(c.as_ptr().cast(), 64);
            tiles.load::<1>(a.as_ptr().cast(), 64);
            tiles.load::<2>(b.as_ptr().cast(), 64);
            tiles.dot::<0, 1, 2>();
            tiles.store::<0>(c.as_mut_ptr().cast(), 64);
        }
        drop(tiles);
        for m in 0..16 {
            for n in 0..16 {
                let want: f32 = 1.0
                    + (0..32)
                        .map(|k| a[m * 32 + k].to_f32() * b[(k / 2) * 32 + n * 2 + k % 2].to_f32())
                        .sum::<f32>();
                assert_eq!(c[m * 16 + n], want, "row {m} column {n}");
            }
        }
    }
}
