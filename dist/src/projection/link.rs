//! The link model: how long a ring all-reduce of `bytes` takes on `p` devices.
//!
//! A ring all-reduce is a reduce-scatter then an all-gather: `2(p-1)` steps, each sending
//! `bytes/p` to the next device. With a per-step latency `α` and a bandwidth `β` per device and
//! direction:
//!
//! ```text
//! t(bytes, p) = 2(p-1)/p · bytes / β  +  2(p-1) · α
//! ```
//!
//! `β` is exactly what nccl-tests reports as *bus bandwidth* (`busbw`) for `all_reduce_perf`
//! at large sizes: nccl-tests defines `busbw = algbw · 2(p-1)/p` with `algbw = bytes / time`,
//! so that `busbw` is the per-device link speed the ring achieved, independent of `p`
//! (nccl-tests, `doc/PERFORMANCE.md`, section "Bus bandwidth", github.com/NVIDIA/nccl-tests).
//! `α` comes from the time nccl-tests reports at small sizes (8 B – 1 KiB), divided by the
//! `2(p-1)` ring steps.
//!
//! The presets are orders of magnitude for the two systems the issue names, taken from what
//! public `all_reduce_perf` runs on such machines typically report — not measured by tandem and
//! not a vendor specification; measure your own with `all_reduce_perf -b 8 -e 1G -f 2 -g 1` (one
//! process per GPU) and pass them with `--busbw-gbs` and `--alpha-us`:
//!
//! - **NVLink (one DGX A100 node, 8 × A100 over NVSwitch).** Each A100 has 12 NVLink 3 links,
//!   300 GB/s per direction (A100 datasheet); nccl-tests' large-message `all_reduce_perf` on
//!   such a node typically reports a bus bandwidth of about 230 GB/s, and about 15–25 µs at small sizes
//!   for 8 GPUs, i.e. `α ≈ 1.5 µs` per ring step. Preset: `β = 230 GB/s`, `α = 1.5 µs`.
//! - **InfiniBand (DGX A100 nodes, 8 × HDR 200 Gb/s rails per node).** Across nodes the ring's
//!   slowest hop is the network: 8 rails × 25 GB/s, of which nccl-tests' multi-node
//!   `all_reduce_perf` typically reports a bus bandwidth of about 180–190 GB/s, and small-message times of
//!   tens of µs (`α ≈ 5 µs` per step). Preset: `β = 185 GB/s`, `α = 5 µs`, used when `p` exceeds
//!   the 8 GPUs of a node.
//!
//! Within one node the NVLink preset applies; beyond it the InfiniBand one (the ring crosses
//! the network twice per node, so its slowest link sets the pace). NCCL switches to a tree for
//! small messages across many nodes (latency `∝ log p`); the ring's `2(p-1)α` overestimates
//! small-bucket latency at 64 GPUs, which makes the projection conservative there.

use std::fmt;

/// A link's per-step latency and per-device bus bandwidth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// Latency per ring step, seconds.
    pub alpha_s: f64,
    /// Bus bandwidth (nccl-tests `busbw`), bytes per second.
    pub busbw_bytes_per_s: f64,
}

impl LinkModel {
    /// A link of `busbw_gbs` GB/s (10⁹ bytes per second, as nccl-tests prints) and `alpha_us`
    /// µs per ring step.
    pub fn new(busbw_gbs: f64, alpha_us: f64) -> LinkModel {
        LinkModel {
            alpha_s: alpha_us * 1e-6,
            busbw_bytes_per_s: busbw_gbs * 1e9,
        }
    }

    /// Seconds for a ring all-reduce of `bytes` over `p` devices (0 for one device).
    pub fn all_reduce_s(&self, bytes: u64, p: usize) -> f64 {
        if p <= 1 {
            return 0.0;
        }
        let steps = 2.0 * (p as f64 - 1.0);
        steps / p as f64 * bytes as f64 / self.busbw_bytes_per_s + steps * self.alpha_s
    }
}

impl fmt::Display for LinkModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "busbw {:.3} GB/s, α {:.2} µs",
            self.busbw_bytes_per_s / 1e9,
            self.alpha_s * 1e6
        )
    }
}

/// The systems the projection knows (see the module documentation for the numbers' sources).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkPreset {
    /// 8 GPUs per node on NVLink/NVSwitch, InfiniBand HDR × 8 between nodes (DGX A100).
    DgxA100,
}

impl LinkPreset {
    /// GPUs per node.
    pub fn gpus_per_node(self) -> usize {
        match self {
            LinkPreset::DgxA100 => 8,
        }
    }

    /// The link a ring over `p` GPUs runs at: NVLink inside a node, InfiniBand across nodes.
    pub fn link_for(self, p: usize) -> LinkModel {
        match self {
            LinkPreset::DgxA100 if p <= self.gpus_per_node() => LinkModel::new(230.0, 1.5),
            LinkPreset::DgxA100 => LinkModel::new(185.0, 5.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_time_follows_the_nccl_tests_bus_bandwidth_definition() {
        let link = LinkModel::new(100.0, 0.0);
        // 1 GB on 8 devices at busbw 100 GB/s: algbw = busbw · p / (2(p-1)) = 57.14 GB/s.
        let t = link.all_reduce_s(1_000_000_000, 8);
        assert!((t - 1.0 / (100.0 * 8.0 / 14.0)).abs() < 1e-12, "{t}");
        // Two devices send the whole buffer once each way: bytes / busbw.
        assert!((link.all_reduce_s(1_000_000_000, 2) - 0.01).abs() < 1e-12);
        assert_eq!(link.all_reduce_s(1 << 30, 1), 0.0);
        // Latency: 2(p-1) steps.
        let lat = LinkModel::new(1e12, 2.0).all_reduce_s(0, 16);
        assert!((lat - 30.0 * 2e-6).abs() < 1e-15, "{lat}");
    }
}
