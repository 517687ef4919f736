//! Collectives on the links a group of ranks actually spans: NCCL's own estimate on GPUs
//! (`super::nccl`: ring or tree, LL/LL128/Simple), ring α-β costs between CPU ranks.
//!
//! A group's bandwidth comes from the topology (`Mesh` groups and `nodes_spanned`): inside one
//! node it is the intra-node link's NCCL bus bandwidth; across nodes, each node's members send
//! through their own NICs, so the ring gets `members per node × NIC bandwidth`, capped by the
//! intra-node link when several members share a node (a "mixed" group). NCCL's bus-bandwidth
//! convention matches these formulas, with S the full buffer and B the per-rank bandwidth:
//! all-reduce `2(n−1)/n·S/B + 2(n−1)·α`; all-gather and reduce-scatter `(n−1)/n·S/B + (n−1)·α`;
//! point-to-point `S/B + α` (DESIGN §6). Nothing here knows about layers or schedules.

use super::nccl;
use crate::mesh::Mesh;
use crate::spec::{Cluster, DeviceKind};

/// The effective link of a group: per-rank bandwidth (bytes/s) and per-step latency (s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupLink {
    /// Ranks in the group.
    pub ranks: u64,
    /// Nodes the group spans.
    pub nodes: u64,
    pub bandwidth: f64,
    pub latency: f64,
    /// On GPUs: the collectives as NCCL estimates them (`super::nccl`); on CPU ranks, the
    /// α-β formulas above.
    pub nccl: Option<nccl::Group>,
}

impl GroupLink {
    /// A group of one rank: every collective is free.
    pub const SOLO: GroupLink = GroupLink {
        ranks: 1,
        nodes: 1,
        bandwidth: f64::INFINITY,
        latency: 0.0,
        nccl: None,
    };

    /// The link of `ranks` ranks spread over `nodes` nodes with at most `per_node` in one node.
    pub fn new(cluster: &Cluster, ranks: u64, nodes: u64, per_node: u64) -> GroupLink {
        let c = &cluster.calibration;
        let intra = cluster.intra_node.bandwidth_gbps * 1e9 * c.intra_node_efficiency;
        let nic = cluster.inter_node.bandwidth_gbps * 1e9 * c.inter_node_efficiency;
        let (bandwidth, latency) = if nodes <= 1 {
            (intra, cluster.intra_node.latency_us * 1e-6)
        } else {
            let across = per_node as f64 * nic;
            let bw = if per_node > 1 {
                across.min(intra)
            } else {
                across
            };
            (bw, cluster.inter_node.latency_us * 1e-6)
        };
        let nccl = (cluster.device.kind == DeviceKind::Gpu).then_some(nccl::Group {
            ranks: ranks as f64,
            nodes: nodes as f64,
            bandwidth,
            intra_extra: cluster.intra_node.latency_us * 1e-6,
            inter_extra: cluster.inter_node.latency_us * 1e-6,
        });
        GroupLink {
            ranks,
            nodes,
            bandwidth,
            latency,
            nccl,
        }
    }

    /// The link of a group of ranks laid out on `mesh`.
    pub fn of_group(cluster: &Cluster, mesh: &Mesh, group: &[u64]) -> GroupLink {
        let nodes = mesh.nodes_spanned(group);
        let mut per_node = std::collections::BTreeMap::new();
        for r in group {
            *per_node.entry(mesh.node(*r)).or_insert(0u64) += 1;
        }
        let most = per_node.values().copied().max().unwrap_or(1);
        GroupLink::new(cluster, group.len() as u64, nodes, most)
    }

    /// Whether the group leaves its node.
    pub fn crosses_nodes(&self) -> bool {
        self.nodes > 1
    }

    /// Seconds to all-reduce a buffer of `bytes` on every rank.
    pub fn all_reduce(&self, bytes: f64) -> f64 {
        if self.ranks <= 1 {
            return 0.0;
        }
        if let Some(g) = &self.nccl {
            return g.all_reduce(bytes);
        }
        let n = self.ranks as f64;
        2.0 * (n - 1.0) / n * bytes / self.bandwidth + 2.0 * (n - 1.0) * self.latency
    }

    /// Seconds to all-gather (or reduce-scatter) a full buffer of `bytes`.
    pub fn all_gather(&self, bytes: f64) -> f64 {
        if self.ranks <= 1 {
            return 0.0;
        }
        if let Some(g) = &self.nccl {
            return g.all_gather(bytes);
        }
        let n = self.ranks as f64;
        (n - 1.0) / n * bytes / self.bandwidth + (n - 1.0) * self.latency
    }

    /// Seconds for one message of `bytes` between the group's two ranks.
    pub fn p2p(&self, bytes: f64) -> f64 {
        match &self.nccl {
            Some(g) => g.p2p(bytes),
            None => bytes / self.bandwidth + self.latency,
        }
    }

    /// Seconds to reduce-scatter a full buffer of `bytes` (the same ring traffic as all-gather).
    pub fn reduce_scatter(&self, bytes: f64) -> f64 {
        self.all_gather(bytes)
    }
}

/// An all-to-all over a group (expert parallelism's token dispatch and combine): each rank
/// sends an equal share of its buffer to every member, all at once. The shares bound for the
/// rank's own node go over the intra-node link, those for other nodes through the rank's own
/// NIC, concurrently; the slower of the two sets the time, plus one hop's latency (NCCL runs
/// the all-to-all as grouped point-to-point sends, `ncclGroupStart` … `ncclSend`/`ncclRecv` …
/// `ncclGroupEnd`, which proceed in parallel; on GPUs the hop is NCCL's Simple-protocol hop,
/// as in [`GroupLink::p2p`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllToAll {
    pub ranks: u64,
    pub nodes: u64,
    /// Members in the rank's own node (itself included).
    pub per_node: u64,
    /// The intra-node link's and one NIC's bandwidth per rank, bytes/s.
    pub intra: f64,
    pub nic: f64,
    /// One hop's latency inside a node and across nodes, s.
    pub intra_latency: f64,
    pub inter_latency: f64,
}

impl AllToAll {
    /// A group of one rank: nothing moves.
    pub const SOLO: AllToAll = AllToAll {
        ranks: 1,
        nodes: 1,
        per_node: 1,
        intra: f64::INFINITY,
        nic: f64::INFINITY,
        intra_latency: 0.0,
        inter_latency: 0.0,
    };

    /// The all-to-all of `ranks` ranks over `nodes` nodes with `per_node` in the rank's node.
    pub fn new(cluster: &Cluster, ranks: u64, nodes: u64, per_node: u64) -> AllToAll {
        let c = &cluster.calibration;
        let gpu = cluster.device.kind == DeviceKind::Gpu;
        // NCCL's Simple-protocol hop (µs) besides the spec's own latency, on GPUs.
        let (nvlink_hop, net_hop) = if gpu { (3.4e-6, 14e-6) } else { (0.0, 0.0) };
        AllToAll {
            ranks,
            nodes,
            per_node: per_node.clamp(1, ranks.max(1)),
            intra: cluster.intra_node.bandwidth_gbps * 1e9 * c.intra_node_efficiency,
            nic: cluster.inter_node.bandwidth_gbps * 1e9 * c.inter_node_efficiency,
            intra_latency: cluster.intra_node.latency_us * 1e-6 + nvlink_hop,
            inter_latency: cluster.inter_node.latency_us * 1e-6 + net_hop,
        }
    }

    /// Seconds to exchange a buffer of `bytes` per rank (its own share included, which does
    /// not move): `(g − 1)/n` of it over the intra-node link and `(n − g)/n` through the NIC,
    /// with `g` members in the rank's node.
    pub fn time(&self, bytes: f64) -> f64 {
        if self.ranks <= 1 {
            return 0.0;
        }
        let (n, g) = (self.ranks as f64, self.per_node as f64);
        let inside = bytes * (g - 1.0) / n / self.intra;
        let outside = bytes * (n - g) / n / self.nic;
        let latency = if self.nodes > 1 {
            self.inter_latency
        } else {
            self.intra_latency
        };
        inside.max(outside) + latency
    }
}

/// Seconds for one point-to-point message of `bytes` between two ranks.
pub fn p2p(cluster: &Cluster, mesh: &Mesh, from: u64, to: u64, bytes: f64) -> f64 {
    GroupLink::of_group(cluster, mesh, &[from, to]).p2p(bytes)
}

/// The links of one layout's groups, computed once from the mesh.
#[derive(Debug, Clone, PartialEq)]
pub struct Links {
    pub tp: GroupLink,
    /// The whole data-parallel group: the ranks that sum gradients, DP × CP with context
    /// parallelism (Megatron-Core's data-parallel group with CP).
    pub dp: GroupLink,
    /// The context-parallel ring (K/V passed rank to rank).
    pub cp: GroupLink,
    /// The data-parallel ranks inside one node (HYBRID_SHARD's shard group).
    pub dp_in_node: GroupLink,
    /// One data-parallel rank per node (HYBRID_SHARD's replica group).
    pub dp_across_nodes: GroupLink,
    /// Between the first and the last pipeline stage (tied embeddings' gradient).
    pub first_last: GroupLink,
    /// The expert-parallel group's all-to-all (MoE token dispatch and combine).
    pub ep: AllToAll,
    /// The expert-data-parallel group: the ranks that hold the same experts and sum their
    /// gradients (DP × CP / EP of them).
    pub expert_dp: GroupLink,
    /// Its members inside one node (hybrid sharding of the expert states).
    pub expert_dp_in_node: GroupLink,
    /// `pp_next[s]`: between stage `s` and stage `(s + 1) % pp`, as (bandwidth, latency).
    pub pp_next: Vec<GroupLink>,
}

/// Groups up to this size are listed rank by rank; larger ones (a DP of 10^12) are measured
/// in closed form, which gives the same numbers (a test checks) without listing them.
const LISTED_GROUP: u64 = 4096;

/// `(nodes spanned, most members in one node)` of the group `{0, stride, 2·stride, …}` of
/// `ranks` ranks, with `per_node` ranks per node: the TP group of rank 0 (stride 1) and its DP
/// group (stride TP), in closed form.
fn progression(ranks: u64, stride: u64, per_node: u64) -> (u64, u64) {
    if ranks == 0 {
        return (0, 1);
    }
    if stride >= per_node {
        // Every member in a node of its own.
        return (ranks, 1);
    }
    // Consecutive members are less than a node apart, so every node up to the last is hit;
    // node 0 holds the most: the multiples of the stride below `per_node`.
    let last = u128::from(ranks - 1) * u128::from(stride) / u128::from(per_node);
    let nodes = u64::try_from(last + 1).unwrap_or(u64::MAX);
    (nodes, ranks.min(per_node.div_ceil(stride.max(1))))
}

/// The link of the group `{0, stride, …}` of `ranks` ranks on `mesh`: listed when small.
fn progression_link(cluster: &Cluster, mesh: &Mesh, ranks: u64, stride: u64) -> GroupLink {
    if ranks <= LISTED_GROUP {
        let group: Vec<u64> = (0..ranks).map(|i| i * stride).collect();
        return GroupLink::of_group(cluster, mesh, &group);
    }
    let (nodes, most) = progression(ranks, stride, mesh.gpus_per_node);
    GroupLink::new(cluster, ranks, nodes, most)
}

impl Links {
    /// The links of a layout's groups. The TP and DP groups are sized in closed form when
    /// large; `pp_next` has one entry per stage (callers bound PP: a layout that passes
    /// `Layout::check` has at most `layout::MAX_SIMULATED_PASSES` stages).
    pub fn new(cluster: &Cluster, mesh: &Mesh) -> Links {
        let tp = progression_link(cluster, mesh, mesh.tp, 1);
        let cp = progression_link(cluster, mesh, mesh.cp, mesh.tp);
        // The gradient group: DP × CP ranks, every TP-th rank (rank = tp + TP·(cp + CP·dp)).
        let grads = mesh.dp.saturating_mul(mesh.cp);
        let (dp, dp_in_node, dp_across_nodes) = if grads <= LISTED_GROUP {
            let dp_group = mesh.dp_cp_group(0);
            let dp = GroupLink::of_group(cluster, mesh, &dp_group);
            let home = mesh.node(0);
            let local: Vec<u64> = dp_group
                .iter()
                .copied()
                .filter(|r| mesh.node(*r) == home)
                .collect();
            let dp_in_node = GroupLink::of_group(cluster, mesh, &local);
            let mut seen = std::collections::BTreeSet::new();
            let heads: Vec<u64> = dp_group
                .iter()
                .copied()
                .filter(|r| seen.insert(mesh.node(*r)))
                .collect();
            let dp_across_nodes = GroupLink::of_group(cluster, mesh, &heads);
            (dp, dp_in_node, dp_across_nodes)
        } else {
            let (nodes, most) = progression(grads, mesh.tp, mesh.gpus_per_node);
            // Rank 0's node holds the most DP members (`most`); one member per node spans
            // every node the group does.
            (
                GroupLink::new(cluster, grads, nodes, most),
                GroupLink::new(cluster, most, 1, most),
                GroupLink::new(cluster, nodes, nodes, 1),
            )
        };
        let stages = mesh.pp_group(0);
        let last = *stages.last().expect("pp ≥ 1");
        let first_last = GroupLink::of_group(cluster, mesh, &[0, last]);
        let pp_next = (0..stages.len())
            .map(|s| {
                let to = stages[(s + 1) % stages.len()];
                GroupLink::of_group(cluster, mesh, &[stages[s], to])
            })
            .collect();
        // EP groups are consecutive DP × CP indices (stride TP in ranks); the expert-DP group
        // strides over TP·EP (`Mesh::ep_group`, `Mesh::expert_dp_group`).
        let ep = {
            let (nodes, most) = progression(mesh.ep, mesh.tp, mesh.gpus_per_node);
            AllToAll::new(cluster, mesh.ep, nodes, most)
        };
        let edp = (grads / mesh.ep.max(1)).max(1);
        let stride = mesh.tp.saturating_mul(mesh.ep.max(1));
        let expert_dp = progression_link(cluster, mesh, edp, stride);
        let (_, most) = progression(edp, stride, mesh.gpus_per_node);
        let expert_dp_in_node = GroupLink::new(cluster, most, 1, most);
        Links {
            tp,
            cp,
            dp,
            dp_in_node,
            dp_across_nodes,
            first_last,
            ep,
            expert_dp,
            expert_dp_in_node,
            pp_next,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Calibration, Device, DeviceKind, Link, Overhead};

    fn cluster() -> Cluster {
        Cluster {
            name: "t".into(),
            nodes: 4,
            gpus_per_node: 8,
            devices: 32,
            device: Device {
                name: "t".into(),
                kind: DeviceKind::Gpu,
                memory_gib: 80.0,
                peak_tflops: 100.0,
                peak_tflops_fp8: None,
                memory_bandwidth_gbps: 1000.0,
                sms: 0,
                kernel_launch_us: 0.0,
                transcendental_gops: None,
                shared_cores: None,
                precision: None,
                l2_cache_kib: None,
            },
            intra_node: Link {
                bandwidth_gbps: 300.0,
                latency_us: 2.0,
            },
            inter_node: Link {
                bandwidth_gbps: 25.0,
                latency_us: 5.0,
            },
            overhead: Overhead {
                context_gib: 0.0,
                fragmentation: 0.0,
                ..Overhead::default()
            },
            calibration: Calibration {
                intra_node_efficiency: 0.5,
                inter_node_efficiency: 0.8,
                ..Calibration::default()
            },
            calibrated: true,
            host: Default::default(),
            cost: None,
            reliability: None,
            storage: None,
        }
    }

    fn check(l: GroupLink, nodes: u64, bandwidth: f64, latency: f64) {
        assert_eq!(l.nodes, nodes, "{l:?}");
        assert!((l.bandwidth - bandwidth).abs() < 1e-3, "{l:?}");
        assert!((l.latency - latency).abs() < 1e-15, "{l:?}");
    }

    #[test]
    fn cost_group_link_intra_inter_and_mixed() {
        let c = cluster();
        // TP 8 inside a node: NVLink at 50% of 300 GB/s, intra latency.
        let m = Mesh::new(4, 1, 8, 8);
        let tp = GroupLink::of_group(&c, &m, &m.tp_group(0));
        check(tp, 1, 150e9, 2e-6);
        // DP across 4 nodes, one rank per node: one NIC at 80% of 25 GB/s.
        let dp = GroupLink::of_group(&c, &m, &m.dp_group(0));
        check(dp, 4, 20e9, 5e-6);
        // TP 1: each node holds 8 DP ranks, 8 NICs: 160 GB/s, capped at NVLink's 150.
        let m = Mesh::new(32, 1, 1, 8);
        let dp = GroupLink::of_group(&c, &m, &m.dp_group(0));
        check(dp, 4, 150e9, 5e-6);
        // TP 4: 2 DP ranks per node, two NICs: 40 GB/s.
        let m = Mesh::new(8, 1, 4, 8);
        let dp = GroupLink::of_group(&c, &m, &m.dp_group(0));
        check(dp, 4, 40e9, 5e-6);
        // TP 16 crosses the node boundary: 8 members per node, 8 NICs = 160, capped at 150,
        // but with the inter-node latency on every ring step.
        let m = Mesh::new(2, 1, 16, 8);
        let tp = GroupLink::of_group(&c, &m, &m.tp_group(0));
        check(tp, 2, 150e9, 5e-6);
    }

    #[test]
    fn cost_ring_collectives_follow_the_alpha_beta_formulas() {
        let l = GroupLink {
            ranks: 4,
            nodes: 1,
            bandwidth: 100e9,
            latency: 1e-6,
            nccl: None,
        };
        let s = 1e9;
        // 2·3/4·1e9/1e11 + 6·1e-6 and 3/4·1e9/1e11 + 3·1e-6, written out.
        assert!((l.all_reduce(s) - (0.015 + 6e-6)).abs() < 1e-15);
        assert!((l.all_gather(s) - (0.0075 + 3e-6)).abs() < 1e-15);
        assert_eq!(GroupLink::SOLO.all_reduce(s), 0.0);
        let c = cluster();
        let m = Mesh::new(1, 2, 8, 8);
        // Stage 0 (ranks 0-7) to stage 1 (ranks 8-15): different nodes, one NIC; on GPUs one
        // Simple network hop of NCCL's (14 µs) plus the spec's 5 µs.
        assert!((p2p(&c, &m, 0, 8, 1e6) - (1e6 / 20e9 + 14e-6 + 5e-6)).abs() < 1e-15);
    }

    /// The closed form of a group's nodes and densest node equals listing its ranks.
    #[test]
    fn cost_group_shape_in_closed_form_equals_the_listed_group() {
        let c = cluster();
        for per_node in [1, 2, 3, 4, 6, 8, 16] {
            for stride in 1..=20 {
                for ranks in 1..=40 {
                    let mesh = Mesh::new(ranks, 1, stride, per_node);
                    let group: Vec<u64> = (0..ranks).map(|i| i * stride).collect();
                    let want = GroupLink::of_group(&c, &mesh, &group);
                    let (nodes, most) = progression(ranks, stride, per_node);
                    assert_eq!(
                        GroupLink::new(&c, ranks, nodes, most),
                        want,
                        "{ranks} ranks, stride {stride}, {per_node} per node"
                    );
                    // The DP group of rank 0 is this progression with stride TP.
                    assert_eq!(GroupLink::of_group(&c, &mesh, &mesh.dp_group(0)), want);
                    let local = group.iter().filter(|r| **r < per_node).count() as u64;
                    assert_eq!(local, most.min(ranks));
                }
            }
        }
        // A DP group of 10^12 ranks is sized without listing it.
        let mesh = Mesh::new(1_000_000_000_000, 1, 2, 8);
        let l = Links::new(&c, &mesh);
        assert_eq!(
            (l.dp.ranks, l.dp.nodes),
            (1_000_000_000_000, 250_000_000_000)
        );
        assert_eq!(
            (l.dp_in_node.ranks, l.dp_across_nodes.ranks),
            (4, 250_000_000_000)
        );
        assert_eq!((l.tp.ranks, l.tp.nodes), (2, 1));
    }

    /// The all-to-all, written out: EP 16 over two nodes of 8 (TP 1), a 64 MB buffer: 7/16 of
    /// it over NVLink at 150 GB/s (0.1867 ms), 8/16 through one NIC at 20 GB/s
    /// (1.6 ms), plus the network hop (NCCL's 14 µs + the spec's 5 µs).
    #[test]
    fn cost_all_to_all_splits_its_traffic_between_nvlink_and_the_nic() {
        let c = cluster();
        let m = Mesh::new(32, 1, 1, 8).with_ep(16);
        let l = Links::new(&c, &m);
        assert_eq!((l.ep.ranks, l.ep.nodes, l.ep.per_node), (16, 2, 8));
        let want = (64e6 * 8.0 / 16.0 / 20e9) + 14e-6 + 5e-6;
        assert!(
            (l.ep.time(64e6) - want).abs() < 1e-12,
            "{}",
            l.ep.time(64e6)
        );
        // Inside one node (EP 8): 7/8 over NVLink, NVLink's hop.
        let m = Mesh::new(32, 1, 1, 8).with_ep(8);
        let l = Links::new(&c, &m);
        let want = 64e6 * 7.0 / 8.0 / 150e9 + 3.4e-6 + 2e-6;
        assert!((l.ep.time(64e6) - want).abs() < 1e-12);
        // Expert-DP: DP 32 / EP 8 = 4 ranks, stride 8: one per node.
        assert_eq!((l.expert_dp.ranks, l.expert_dp.nodes), (4, 4));
        assert_eq!(AllToAll::SOLO.time(1e9), 0.0);
    }

    #[test]
    fn cost_layout_links_cover_the_pipeline_ring() {
        let c = cluster();
        let m = Mesh::new(2, 4, 4, 8);
        let l = Links::new(&c, &m);
        assert_eq!(l.pp_next.len(), 4);
        // tp 4 × dp 2 fill a node, so every stage boundary crosses nodes.
        assert!(l.pp_next.iter().all(|x| x.nodes == 2));
        assert_eq!(l.dp_in_node.ranks, 2);
        assert_eq!(l.dp_across_nodes.ranks, 1);
    }
}
