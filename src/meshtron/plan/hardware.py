"""Accelerators the planner knows: compute peaks, memory, and the two kinds of link a GPU has.

Every figure is a vendor's published peak; the planner multiplies them by its own efficiency constants.
Units are SI (1 GB/s = 1e9 bytes/s, 1 Gb/s = 1e9 bits/s = 1.25e8 bytes/s) except memory capacity:

  field                    meaning                                            as published
  bf16_flops_per_s         dense bf16 tensor-core peak, FLOP/s                datasheets print the 2:4-sparse
                                                                              figure too: the dense one is half
  fp8_flops_per_s          dense fp8 peak (None: no fp8 tensor cores)         same
  memory_bytes             HBM capacity, binary units: "80 GB" is 80 GiB      the HBM stacks are binary sized;
                           (the driver leaves a little less than that)        80e9 would undercount by 7%
  hbm_bytes_per_s          HBM bandwidth                                      TB/s, decimal
  intra_node_bytes_per_s   NVLink (scale-up) bandwidth per GPU PER DIRECTION  datasheets print the total of
                                                                              both directions: halved here
  inter_node_bytes_per_s   network (scale-out) bandwidth per GPU per          NIC line rate in Gb/s, / 8
                           direction: one NIC per GPU, as in NVIDIA's DGX
  gpus_per_node            GPUs behind one NVLink switch domain               8 in every HGX/DGX board here

Why per direction: a ring (or tree) all-reduce, all-gather or reduce-scatter sends and receives the same
number of bytes on every GPU at the same time, so its time is bytes / (bandwidth of one direction). The
"900 GB/s" of an H100 is 18 NVLink-4 links of 25 GB/s each way, 450 GB/s out plus 450 GB/s in; a ring's
bus bandwidth cannot exceed 450 GB/s. (NVSwitch's in-switch reduction, NVLS, lets an all-reduce move
less than a ring does; that, like protocol overheads, belongs to the planner's efficiency constants.)
A NIC's "400 Gb/s" is already per direction (full duplex), so only the bits-to-bytes factor applies.

  GPU         bf16 / fp8 TFLOP/s   memory    HBM TB/s   NVLink total -> per direction   network per GPU
  a100-40gb   312 / -              40 GiB    1.555      600 -> 300 GB/s                 200 Gb/s HDR
  a100-80gb   312 / -              80 GiB    2.039      600 -> 300 GB/s                 200 Gb/s HDR
  h100        989 / 1979           80 GiB    3.35       900 -> 450 GB/s                 400 Gb/s NDR
  h800        989 / 1979           80 GiB    3.35       400 -> 200 GB/s                 400 Gb/s NDR
  h200        989 / 1979           141 GiB   4.8        900 -> 450 GB/s                 400 Gb/s NDR
  b200        2250 / 4500          180 GiB   8.0        1800 -> 900 GB/s                400 Gb/s NDR

Choices:
- H100 SXM's dense bf16 peak is 989.4 TFLOP/s in NVIDIA's Hopper whitepaper; 989 is stored; the trainer's
  MFU divides by this table's peaks too (`probe/peak.py`), so planner and trainer MFU agree.
- H800 is H100 SXM with NVLink cut to 8 links (400 GB/s total); its tensor cores, memory and network are
  an H100's. DeepSeek-V3's report measures about 160 GB/s of NVLink and 50 GB/s of InfiniBand per GPU on
  its H800 cluster: the link efficiency constants, not this table, account for that gap.
- B200 comes with 192 GB of HBM3e on the package, of which DGX B200 exposes 180 GB per GPU (1,440 GB per
  8-GPU system); the usable 180 is stored. Its scale-out is 400 Gb/s: DGX B200 ships one ConnectX-7
  (400 Gb/s NDR) per GPU; ConnectX-8 at 800 Gb/s belongs to B300 / GB300 systems. Override with
  `--inter-node-gbps 800` for such a cluster.
- A100 has no fp8 tensor cores (None: a planner asked for fp8 on it refuses).

Sources (datasheets, as published by NVIDIA):
- A100: "NVIDIA A100 Tensor Core GPU" datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/
  Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (bf16 312 TFLOPS dense,
  40 GB HBM2 1,555 GB/s, 80 GB HBM2e 2,039 GB/s, NVLink 600 GB/s); "NVIDIA DGX A100" datasheet
  (8 single-port ConnectX-6 HDR 200 Gb/s cluster NICs, one per GPU).
- H100: "NVIDIA H100 Tensor Core GPU" datasheet, https://resources.nvidia.com/en-us-tensor-core/
  nvidia-tensor-core-gpu-datasheet (H100 SXM: bf16 1,979 and fp8 3,958 TFLOPS with sparsity, 80 GB
  HBM3 3.35 TB/s, NVLink 900 GB/s); "NVIDIA H100 Tensor Core GPU Architecture" whitepaper (989.4 dense
  bf16); "NVIDIA DGX H100" datasheet (8 single-port ConnectX-7 400 Gb/s NDR cluster NICs).
- H800: NVIDIA's H800 SXM specifications for the China market (NVLink 400 GB/s total; tensor-core
  peaks, memory and bandwidth those of H100 SXM; no public datasheet URL is stable); DeepSeek-AI,
  "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 3.2 (8 H800 per node, NVLink within, one
  400 Gb/s InfiniBand NIC per GPU across nodes).
- H200: "NVIDIA H200 Tensor Core GPU" datasheet, https://www.nvidia.com/en-us/data-center/h200/
  (H200 SXM: bf16 1,979 and fp8 3,958 TFLOPS with sparsity, 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s);
  "NVIDIA DGX H200" datasheet (8 ConnectX-7 400 Gb/s cluster NICs).
- B200: "NVIDIA DGX B200" datasheet and user guide, https://www.nvidia.com/en-us/data-center/dgx-b200/
  and https://docs.nvidia.com/dgx/dgxb200-user-guide/ (8 B200, 1,440 GB HBM3e, 64 TB/s, fp8 72 PFLOPS
  training with sparsity = 4.5 dense per GPU, NVLink 5 14.4 TB/s aggregate = 1.8 TB/s per GPU, 8
  single-port ConnectX-7 400 Gb/s cluster NICs); "NVIDIA HGX B200" specifications (bf16 2.25 PFLOPS
  dense per GPU).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from meshtron.config.schema import ConfigError

GiB = 2**30
TERA = 1e12
GB_PER_S = 1e9  # bytes/s
GBIT_PER_S = 1e9 / 8  # bytes/s of one Gb/s

PeakDType = Literal["bf16", "fp8", "fp32"]


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One GPU type: peaks, memory and links, per GPU (see the module docstring for units and sources)."""

    name: str
    bf16_flops_per_s: float
    fp8_flops_per_s: float | None
    memory_bytes: int
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # NVLink, per GPU, per direction
    inter_node_bytes_per_s: float  # network, per GPU, per direction
    gpus_per_node: int = 8
    sources: str = ""
    # Only for a measured machine (`meshtron plan --gpu cpu`): the fp32 matmul rate, what it trains in.
    fp32_flops_per_s: float | None = None


_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf); NVIDIA DGX A100 datasheet (ConnectX-6 "
    "HDR 200 Gb/s per GPU)"
)
_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet (https://resources.nvidia.com/en-us-tensor-core/"
    "nvidia-tensor-core-gpu-datasheet), H100 SXM column, sparse peaks halved; NVIDIA H100 architecture "
    "whitepaper (989.4 dense bf16); NVIDIA DGX H100 datasheet (ConnectX-7 NDR 400 Gb/s per GPU)"
)
_H800 = (
    "NVIDIA H800 SXM specifications (NVLink 400 GB/s total, otherwise H100 SXM); DeepSeek-V3 Technical "
    "Report, arXiv:2412.19437, sec. 3.2 (H800 nodes of 8, 400 Gb/s InfiniBand per GPU)"
)
_H200 = (
    "NVIDIA H200 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h200/), H200 SXM "
    "column, sparse peaks halved; NVIDIA DGX H200 datasheet (ConnectX-7 NDR 400 Gb/s per GPU)"
)
_B200 = (
    "NVIDIA DGX B200 datasheet and user guide (https://www.nvidia.com/en-us/data-center/dgx-b200/, "
    "https://docs.nvidia.com/dgx/dgxb200-user-guide/): 1,440 GB and 64 TB/s per 8 GPUs, NVLink 5 14.4 TB/s "
    "aggregate, fp8 72 PFLOPS sparse per 8 GPUs, ConnectX-7 400 Gb/s per GPU; NVIDIA HGX B200 "
    "specifications (bf16 2.25 PFLOPS dense)"
)


def _gpu(
    name: str,
    bf16_tflops: float,
    fp8_tflops: float | None,
    memory_gib: int,
    hbm_gb_per_s: float,
    nvlink_total_gb_per_s: float,
    network_gbit_per_s: float,
    sources: str,
) -> Accelerator:
    """An entry from the datasheet's own units; NVLink given as the datasheet's two-direction total."""
    return Accelerator(
        name=name,
        bf16_flops_per_s=bf16_tflops * TERA,
        fp8_flops_per_s=None if fp8_tflops is None else fp8_tflops * TERA,
        memory_bytes=memory_gib * GiB,
        hbm_bytes_per_s=hbm_gb_per_s * GB_PER_S,
        intra_node_bytes_per_s=nvlink_total_gb_per_s / 2 * GB_PER_S,
        inter_node_bytes_per_s=network_gbit_per_s * GBIT_PER_S,
        sources=sources,
    )


ACCELERATORS: Mapping[str, Accelerator] = MappingProxyType(
    {
        acc.name: acc
        for acc in (
            _gpu("a100-40gb", 312, None, 40, 1555, 600, 200, _A100),
            _gpu("a100-80gb", 312, None, 80, 2039, 600, 200, _A100),
            _gpu("h100", 989, 1979, 80, 3350, 900, 400, _H100),
            _gpu("h800", 989, 1979, 80, 3350, 400, 400, _H800),
            _gpu("h200", 989, 1979, 141, 4800, 900, 400, _H200),
            _gpu("b200", 2250, 4500, 180, 8000, 1800, 400, _B200),
        )
    }
)


def accelerator(name: str) -> Accelerator:
    """The table's entry for `name` (case-insensitive); an unknown name is refused with the known ones."""
    key = name.strip().lower()
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    known = sorted(ACCELERATORS)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError([f"unknown GPU type {name!r}{hint} (known: {', '.join(known)})"])


def with_links(
    acc: Accelerator,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    gpus_per_node: int | None = None,
) -> Accelerator:
    """A copy of `acc` with the user's link figures: bandwidths per GPU per direction in Gb/s (bits, as
    `--intra-node-gbps` / `--inter-node-gbps` take them: an H100's NVLink is 3600), GPUs per node."""
    problems = []
    for flag, value in (("--intra-node-gbps", intra_node_gbps), ("--inter-node-gbps", inter_node_gbps)):
        if value is not None and not value > 0:
            problems.append(f"{flag} must be a positive bandwidth in Gb/s per GPU per direction, got {value}")
    if gpus_per_node is not None and gpus_per_node < 1:
        problems.append(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    if problems:
        raise ConfigError(problems)
    changes: dict[str, float | int] = {}
    if intra_node_gbps is not None:
        changes["intra_node_bytes_per_s"] = intra_node_gbps * GBIT_PER_S
    if inter_node_gbps is not None:
        changes["inter_node_bytes_per_s"] = inter_node_gbps * GBIT_PER_S
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
    return dataclasses.replace(acc, **changes)


def peak_flops_per_s(acc: Accelerator, dtype: PeakDType = "bf16") -> float:
    """The dense matmul peak for the compute dtype; fp8 on a GPU without fp8 tensor cores is refused."""
    if dtype == "bf16":
        return acc.bf16_flops_per_s
    if dtype == "fp32":
        if acc.fp32_flops_per_s is None:
            raise ConfigError([f"the planner has no fp32 matmul rate for {acc.name}; use --dtype bf16"])
        return acc.fp32_flops_per_s
    if acc.fp8_flops_per_s is None:
        raise ConfigError([f"{acc.name} has no fp8 tensor cores; use --dtype bf16"])
    return acc.fp8_flops_per_s


# Table entries by the word torch.cuda.get_device_name carries ("NVIDIA H100 80GB HBM3",
# "NVIDIA A100-SXM4-80GB"); A100 comes in two memory sizes, told apart by the memory the device reports.
GPU_FAMILIES = ("b200", "h200", "h800", "h100", "a100")


def table_name(device_name: str, memory_bytes: int) -> str | None:
    """The planner's entry for a CUDA device name, or None when the table has no such GPU."""
    words = re.split(r"[^a-z0-9]+", device_name.lower())
    if "pcie" in words or "nvl" in words:  # the table's figures are SXM boards' (clocks, NVLink to 8)
        return None
    for family in GPU_FAMILIES:
        if family in words:
            if family == "a100":
                return "a100-80gb" if memory_bytes > 48 * GiB else "a100-40gb"
            return family
    return None
