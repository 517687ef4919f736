//! A collective's time as NCCL itself estimates it when it picks an algorithm and a protocol
//! (`src/graph/tuning.cc`, NCCL 2.30.7): for each protocol (LL, LL128, Simple) and algorithm
//! (ring; tree for an all-reduce over several nodes), a latency from NCCL's tables plus the
//! bytes over the protocol's share of the bus bandwidth; the fastest wins, as in NCCL.
//!
//! - Ring latency: `base + (steps − inter steps)·intra + inter steps·inter`, with `2(n−1)` steps
//!   for an all-reduce (`2(N−1)` of them between nodes) and `n−1` for an all-gather or a
//!   reduce-scatter (`N−1` between nodes): it grows linearly with the ranks. Over several
//!   nodes the Simple protocol's ring latency is multiplied by 1.4 ("plateau effect of ring").
//!   With one rank per node, the network hop takes the tree's latency.
//! - Tree all-reduce latency: `base + 2·((n/N − 1)·intra + log2(N)·inter)`: it grows with the
//!   logarithm of the nodes.
//! - Bandwidth: the ring moves `2(n−1)/n` of the buffer through each rank's link for an
//!   all-reduce (`(n−1)/n` for the others); the tree's algorithm bandwidth is half the bus
//!   bandwidth. Protocols pay for their flags: LL gets 1/2 of the bus bandwidth, LL128 0.92;
//!   the tree's bus bandwidth is 0.92 of the link's, LL 1/3.8 of that, LL128 120/128 of it.
//!
//! Latencies are NCCL's per-hop software figures for NVLink (inside a node) and the network
//! (between nodes); the cluster spec's own `latency_us` is added per hop on top. NCCL's
//! per-channel bandwidth caps are not modelled (they need the channel count). Pure functions.

/// Indices of NCCL's protocols in its tables.
const LL: usize = 0;
const LL128: usize = 1;
const SIMPLE: usize = 2;

/// `baseLat` (µs), by protocol LL, LL128, Simple.
const BASE_RING: [f64; 3] = [6.6, 14.0, 8.4];
const BASE_TREE: [f64; 3] = [6.8, 14.0, 8.4];
/// `hwLat` (µs) per hop: NVLink and the network, ring and tree.
const NVLINK_RING: [f64; 3] = [0.6, 1.9, 3.4];
const NVLINK_TREE: [f64; 3] = [0.6, 1.25, 4.0];
const NET_RING: [f64; 3] = [2.7, 4.0, 14.0];
const NET_TREE: [f64; 3] = [5.0, 8.5, 14.0];

/// The shape of a group and its link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Group {
    pub ranks: f64,
    pub nodes: f64,
    /// Bus bandwidth per rank, bytes/s (NCCL's busBw of the Simple ring).
    pub bandwidth: f64,
    /// The cluster's own latency per hop (s), added to NCCL's: inside a node, between nodes.
    pub intra_extra: f64,
    pub inter_extra: f64,
}

impl Group {
    fn intra(&self, table: &[f64; 3], p: usize) -> f64 {
        table[p] * 1e-6 + self.intra_extra
    }

    fn inter(&self, table: &[f64; 3], p: usize) -> f64 {
        table[p] * 1e-6 + self.inter_extra
    }

    /// Ring latency of `steps` steps, `inter_steps` of them between nodes.
    fn ring_latency(&self, p: usize, steps: f64, inter_steps: f64) -> f64 {
        // One rank per node: the network hop takes the tree's latency (tuning.cc).
        let net = if self.ranks <= self.nodes {
            &NET_TREE
        } else {
            &NET_RING
        };
        let lat = BASE_RING[p] * 1e-6
            + (steps - inter_steps) * self.intra(&NVLINK_RING, p)
            + inter_steps * self.inter(net, p);
        if self.nodes > 1.0 && p == SIMPLE {
            lat * 1.4
        } else {
            lat
        }
    }

    /// Seconds for a ring of `steps` steps moving `fraction` of `bytes` through each rank.
    fn ring(&self, bytes: f64, steps: f64, inter_steps: f64, fraction: f64) -> f64 {
        const BW: [f64; 3] = [0.5, 0.92, 1.0];
        (0..3)
            .map(|p| {
                self.ring_latency(p, steps, inter_steps)
                    + fraction * bytes / (self.bandwidth * BW[p])
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Seconds for a tree all-reduce (several nodes only).
    fn tree(&self, bytes: f64) -> f64 {
        let per_node = (self.ranks / self.nodes).max(1.0);
        (0..3)
            .map(|p| {
                let lat = BASE_TREE[p] * 1e-6
                    + 2.0
                        * ((per_node - 1.0) * self.intra(&NVLINK_TREE, p)
                            + self.nodes.log2() * self.inter(&NET_TREE, p));
                let bus = self.bandwidth
                    * 0.92
                    * match p {
                        LL => 1.0 / 3.8,
                        LL128 => 120.0 / 128.0,
                        _ => 1.0,
                    };
                lat + bytes / (0.5 * bus)
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Seconds to all-reduce `bytes` on every rank: the faster of NCCL's ring and tree.
    pub fn all_reduce(&self, bytes: f64) -> f64 {
        if self.ranks <= 1.0 {
            return 0.0;
        }
        let n = self.ranks;
        let ring = self.ring(
            bytes,
            2.0 * (n - 1.0),
            2.0 * (self.nodes - 1.0),
            2.0 * (n - 1.0) / n,
        );
        if self.nodes > 1.0 {
            ring.min(self.tree(bytes))
        } else {
            ring
        }
    }

    /// Seconds to all-gather (or reduce-scatter) a full buffer of `bytes`: a ring.
    pub fn all_gather(&self, bytes: f64) -> f64 {
        if self.ranks <= 1.0 {
            return 0.0;
        }
        let n = self.ranks;
        self.ring(bytes, n - 1.0, self.nodes - 1.0, (n - 1.0) / n)
    }

    /// One message between two ranks: a Simple ring hop's latency and the bytes.
    pub fn p2p(&self, bytes: f64) -> f64 {
        let hop = if self.nodes > 1.0 {
            self.inter(&NET_RING, SIMPLE)
        } else {
            self.intra(&NVLINK_RING, SIMPLE)
        };
        hop + bytes / self.bandwidth
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(ranks: f64, nodes: f64) -> Group {
        Group {
            ranks,
            nodes,
            bandwidth: 100e9,
            intra_extra: 0.0,
            inter_extra: 0.0,
        }
    }

    #[test]
    fn one_node_ring_latency_and_bandwidth() {
        let g = group(8.0, 1.0);
        // A large buffer: Simple, 14 steps of 3.4 µs after an 8.4 µs base, and 2·7/8 of 1 GB
        // at 100 GB/s.
        let want = (8.4 + 14.0 * 3.4) * 1e-6 + 2.0 * 7.0 / 8.0 * 1e9 / 100e9;
        assert!(
            (g.all_reduce(1e9) - want).abs() < 1e-12,
            "{}",
            g.all_reduce(1e9)
        );
        // A tiny buffer: LL, 6.6 + 14 × 0.6 µs, at half the bandwidth.
        let want = (6.6 + 14.0 * 0.6) * 1e-6 + 2.0 * 7.0 / 8.0 * 8.0 / 50e9;
        assert!(
            (g.all_reduce(8.0) - want).abs() < 1e-15,
            "{}",
            g.all_reduce(8.0)
        );
    }

    #[test]
    fn ring_latency_grows_with_ranks_and_tree_with_log_nodes() {
        // 1024 ranks, 8 per node (128 nodes), an 8-byte all-reduce: latency only.
        let g = group(1024.0, 128.0);
        let ring = g.ring_latency(LL, 2046.0, 254.0);
        // (6.6 + (2046 − 254)·0.6 + 254·2.7) µs.
        assert!((ring - (6.6 + 1792.0 * 0.6 + 254.0 * 2.7) * 1e-6).abs() < 1e-12);
        // The tree: 6.8 + 2·(7·0.6 + 7·5.0) µs, far below the ring's 1.8 ms.
        let tree_ll = (6.8 + 2.0 * (7.0 * 0.6 + 7.0 * 5.0)) * 1e-6;
        let t = g.all_reduce(8.0);
        assert!(t < 1e-4 && t >= tree_ll, "{t}");
        // Doubling the nodes adds one tree level (2 × 5 µs), not 2 × 1024 ring steps.
        let g2 = group(2048.0, 256.0);
        let step = g2.all_reduce(8.0) - t;
        assert!((step - 2.0 * 5.0e-6).abs() < 1e-9, "{step}");
    }

    #[test]
    fn large_buffers_take_the_ring_and_its_bandwidth() {
        // 64 ranks, one per node, 10 GB: the ring moves 2·63/64 of it at the full bus
        // bandwidth, the tree 2 × it at 0.92 of it, so the ring wins, with the Simple ring's
        // latency: 1.4 × (8.4 + 126 × 14) µs (one rank per node: the tree's network hop).
        let g = group(64.0, 64.0);
        let t = g.all_reduce(10e9);
        let want = 1.4 * (8.4 + 126.0 * 14.0) * 1e-6 + 2.0 * 63.0 / 64.0 * 10e9 / 100e9;
        assert!((t - want).abs() < 1e-12, "{t} vs {want}");
    }
}
