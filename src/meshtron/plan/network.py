"""Which links each mesh dim's collectives cross, and how long a collective takes on them.

The mesh lays ranks out row-major over [pp, dp_replicate, dp_shard, cp, tp] (comm/mesh.py), the expert view
over [pp, dp_replicate, edp, ep, tp]; nodes hold `gpus_per_node` consecutive ranks. A group of n ranks
spaced `stride` apart therefore has min(n, ceil(G/stride)) members per node: it stays on NVLink when
n·stride <= G, and otherwise crosses the network.

Time of one collective (the alpha-beta model; Hockney 1994, Thakur et al. 2005), S the bytes of the
full tensor, n the group size, B the link's bandwidth per GPU per direction times its efficiency, a the
per-message latency of the link:

  collective          bytes each rank sends       time
  all-reduce (ring)   2·S·(n−1)/n                 2·(n−1)·a + 2·S·(n−1)/n / B
  all-gather          S·(n−1)/n                   (n−1)·a + S·(n−1)/n / B
  reduce-scatter      S·(n−1)/n                   (n−1)·a + S·(n−1)/n / B
  all-to-all          S·(n−1)/n                   (n−1)·a + max(on-node part / B_nvlink,
                                                               off-node part / B_network)
  send / receive      S                           a_p2p + S / (B·p2p)

A collective issued as c separate calls (FSDP's one per unit, DDP's one per bucket) pays the latency c
times and the bandwidth term once for its total bytes. Point-to-point messages may have their own
latency and share of the link (a CPU's gloo pairs do: probe/hardware.py measures them); by default they
take the link's.

A ring that leaves the node runs at the network's rate: every GPU's share of the ring passes its own NIC
(NCCL builds one ring per NIC), so bandwidth per GPU is the NIC's. An all-to-all is split: the peers on
the same node are reached over NVLink, the others over the network, concurrently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from meshtron.plan.hardware import Accelerator

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]


@dataclass(frozen=True)
class LinkEfficiency:
    """The achievable share of each link's peak and the latency per message (named, calibrated; see
    docs/planner.md#calibration). The bandwidth shares are Calculon's (Isaev et al. 2023: NVLink about
    0.65 of its per-direction peak, InfiniBand about 0.9)."""

    nvlink: float = 0.65
    network: float = 0.9
    nvlink_latency_s: float = 5e-6
    network_latency_s: float = 10e-6
    p2p: float = 1.0  # a send/receive's bandwidth as a share of the link's (above)
    p2p_latency_s: float = 0.0  # 0: the link's latency
    # The SMs that communication kernels hold while they overlap compute, as a share of the GPU's: 20 of
    # an H800's 132 saturate its InfiniBand and NVLink (DeepSeek-AI 2024, §3.2.2), DeepEP's default too.
    overlap_sm_share: float = 20 / 132


@dataclass(frozen=True)
class Group:
    """A mesh group as the network sees it: its size, the rank distance of its members, and whether
    it crosses nodes on this cluster."""

    size: int
    stride: int
    gpus_per_node: int

    @property
    def per_node(self) -> int:
        """Members that share one node."""
        return max(1, min(self.size, math.ceil(self.gpus_per_node / self.stride)))

    @property
    def crosses_nodes(self) -> bool:
        return self.size > self.per_node


def ep_group(ep: int, tp: int, expert_tp: bool, gpus_per_node: int) -> Group:
    """The ep group in the experts' grid [edp, ep, etp] (config/layout.py): its ranks lie etp apart."""
    return Group(ep, tp if expert_tp else 1, gpus_per_node)


def mesh_strides(dims: dict[str, int], order: tuple[str, ...]) -> dict[str, int]:
    """The rank distance between neighbours of each dim of a row-major mesh over `order`."""
    strides, stride = {}, 1
    for name in reversed(order):
        strides[name] = stride
        stride *= dims[name]
    return strides


def collective_time(
    kind: Collective,
    nbytes: float,
    group: Group,
    gpu: Accelerator,
    eff: LinkEfficiency,
    calls: int = 1,
) -> float:
    """Seconds a collective over `group` takes (the module docstring's table); `nbytes` is the full
    tensor (for p2p, the message), or all `calls` calls' together."""
    n = group.size
    if n == 1 or nbytes <= 0:
        return 0.0
    nvlink = gpu.intra_node_bytes_per_s * eff.nvlink
    network = gpu.inter_node_bytes_per_s * eff.network
    crossing = group.crosses_nodes
    bandwidth = network if crossing else nvlink
    latency = calls * (eff.network_latency_s if crossing else eff.nvlink_latency_s)
    ring = (n - 1) / n
    if kind == "all_reduce":
        return 2 * (n - 1) * latency + 2 * nbytes * ring / bandwidth
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) * latency + nbytes * ring / bandwidth
    if kind == "p2p":
        return (calls * eff.p2p_latency_s or latency) + nbytes / (bandwidth * eff.p2p)
    on_node = nbytes * (group.per_node - 1) / n
    off_node = nbytes * (n - group.per_node) / n
    return (n - 1) * latency + max(on_node / nvlink, off_node / network if off_node else 0.0)
