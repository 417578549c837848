"""GPUs and clusters: `GpuSpec`, `Cluster`, and the `--gpus` grammar.

Grammar (case-insensitive):

    GPUS  := COUNT "x" TYPE [ "@" MEM ] [ "@host=" MEM ]        4xA100, 16xH100, 2xcpu@2GiB
           | NODES "x" COUNT "x" TYPE [ "@" MEM ] [ "@host=" MEM ]  2x8xH100 (2 nodes of 8 GPUs each)
    @host= overrides the host RAM per node of the preset (data/gpus.yaml host_memory_gib), which
    bounds what ZeRO-Offload / ZeRO-Infinity can put there (memory/host.py).
    @net=NUMBERGbps gives the node's network between nodes, all its NICs together (e.g. @net=100Gbps
    for one 100 GbE NIC, @net=3200Gbps for 8 x 400 Gb/s InfiniBand); the preset's is a reference
    system's (data/gpus.yaml inter_node_gbps), which a rented cluster may not have.
    MEM   := NUMBER ("GiB" | "MiB" | "GB")       overrides the per-device memory capacity

A COUNT larger than the type's gpus_per_node (8 for data-centre parts) is split into full
nodes: 16xH100 is 2 nodes of 8; a COUNT that does not split evenly is an error. `A100` means
the 80 GB part, and the resolved name says so.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

import yaml

from autotune.errors import SpecError
from autotune.units import GB, TFLOPS, GiB, MiB

GRAMMAR = (
    "expected [NODESx]COUNTxTYPE[@MEM][@host=SIZE][@net=GBITSGbps], e.g. 4xA100, 8xH100, 2xA100-40GB, "
    "16xH100 (2 nodes of 8), 2x8xH100, 2xcpu, 2xcpu@2GiB, 8xH100@host=512GiB, 2x8xA100@net=100Gbps"
)


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator type, with the datasheet numbers the models need."""

    name: str
    memory_bytes: int
    """Total device memory as the driver reports it."""
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """Dense peak per precision ('fp32', 'fp16', 'bf16'); empty where unknown (CPU)."""
    hbm_gbps: float = 0.0
    intra_node_gbps: float = 0.0
    inter_node_gbps: float = 0.0
    bf16: bool = False
    gpus_per_node: int = 8
    p2p: bool = True
    """GPUs of a node reach each other directly (NVLink, or PCIe peer-to-peer). False (GeForce RTX 40
    cards: NVIDIA disables peer-to-peer on them): NCCL stages every transfer through host memory
    (its SHM transport), so each byte crosses PCIe twice (data/gpus.yaml cites the sources)."""
    host_memory_bytes: int = 0
    """Host RAM per node of the reference system (data/gpus.yaml) or as given (@host=); 0: unknown."""
    source: str = ""

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    def peak_flops(self, precision: str) -> float | None:
        v = self.peak_tflops.get(precision)
        return v * TFLOPS if v else None


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """What a run is given: `num_nodes` x `gpus_per_node` devices of one type."""

    gpu: GpuSpec
    num_nodes: int
    gpus_per_node: int
    text: str = ""
    """What the user typed."""
    note: str = ""
    """Anything the user should know about how the text was read (e.g. A100 = A100-80GB)."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise SpecError(f"--gpus {self.text}: need at least one node and one device per node")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def capacity_bytes(self) -> int:
        """Memory of one device."""
        return self.gpu.memory_bytes

    def describe(self) -> str:
        nodes = f"{self.num_nodes} nodes x " if self.num_nodes > 1 else ""
        return f"{nodes}{self.gpus_per_node} x {self.gpu.name} ({self.capacity_bytes / GiB:.1f} GiB each)"


@cache
def gpu_table() -> dict:
    """data/gpus.yaml's entries by preset name, as written there (`autotune gpus` lists them)."""
    return yaml.safe_load(resources.files("autotune").joinpath("data/gpus.yaml").read_text())["gpus"]


def gpu_presets() -> dict[str, GpuSpec]:
    return {name: _spec(name, e) for name, e in gpu_table().items()}


def _spec(name: str, e: dict, memory_bytes: int | None = None) -> GpuSpec:
    return GpuSpec(
        name=name,
        memory_bytes=memory_bytes if memory_bytes is not None else e["memory_mib"] * MiB,
        peak_tflops=dict(e.get("peak_tflops") or {}),
        hbm_gbps=e["hbm_gbps"],
        intra_node_gbps=e["intra_node_gbps"],
        inter_node_gbps=e["inter_node_gbps"],
        bf16=e["bf16"],
        gpus_per_node=e["gpus_per_node"],
        source=e["source"],
        p2p=e.get("p2p", True),
        host_memory_bytes=int((e.get("host_memory_gib") or 0) * GiB),
    )


def lookup_gpu(type_text: str) -> tuple[str, dict]:
    """(preset name, its gpus.yaml entry) of a type name or alias, any case; SpecError naming the known ones."""
    key = type_text.lower()
    for name, e in gpu_table().items():
        if key == name.lower() or key in (str(a).lower() for a in e.get("aliases", [])):
            return name, e
    import difflib

    names = list(gpu_table()) + [str(a) for e in gpu_table().values() for a in e.get("aliases", [])]
    close = difflib.get_close_matches(type_text, names, n=3, cutoff=0.4)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise SpecError(f"unknown GPU type {type_text!r}.{hint} Known: {', '.join(gpu_table())} (run `autotune gpus`).")


def _parse_mem(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(gib|mib|gb)", text.strip().lower())
    if not m:
        raise SpecError(f"bad memory {text!r} after @: use e.g. 2GiB, 512MiB, 40GB")
    scale = {"gib": GiB, "mib": MiB, "gb": GB}[m.group(2)]
    return int(float(m.group(1)) * scale)


def host_memory_bytes() -> int:
    """Physical RAM of this machine (sysconf; Linux and macOS)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _net_part(suffix: str, text: str) -> tuple[str | None, float | None]:
    """Split "@net=100Gbps" off the text after the type: (the rest or None, GB/s per node or None)."""
    parts = suffix.split("@")
    nets = [p for p in parts if p.lower().startswith("net=")]
    rest = "@".join(p for p in parts if not p.lower().startswith("net="))
    if not nets:
        return suffix, None
    m = re.fullmatch(r"net=(\d+(?:\.\d+)?)\s*gbps", nets[0].strip().lower())
    if len(nets) > 1 or not m or float(m.group(1)) <= 0:
        raise SpecError(
            f"malformed --gpus {text!r}: @net= takes the node's network in Gb/s, e.g. @net=100Gbps; {GRAMMAR}"
        )
    return (rest or None), float(m.group(1)) / 8  # Gb/s -> GB/s


def parse_gpus(text: str) -> Cluster:
    """Parse the --gpus grammar (module docstring) into a Cluster."""
    raw = text.strip()
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x([A-Za-z0-9][A-Za-z0-9\-_.]*)(?:@(.+))?", raw, re.IGNORECASE)
    if not m:
        raise SpecError(f"malformed --gpus {text!r}: {GRAMMAR}")
    nodes_txt, count_txt, type_txt, mem_txt = m.groups()
    count = int(count_txt)
    if count < 1 or (nodes_txt is not None and int(nodes_txt) < 1):
        raise SpecError(f"malformed --gpus {text!r}: counts must be at least 1; {GRAMMAR}")
    name, entry = lookup_gpu(type_txt)
    per_node_max = entry["gpus_per_node"]
    if nodes_txt is not None:
        nodes, per_node = int(nodes_txt), count
    elif count > per_node_max:
        if count % per_node_max:
            raise SpecError(
                f"--gpus {text!r}: {count} {name} do not fill nodes of {per_node_max}; "
                f"write NODESxCOUNTx{type_txt} to say how they are split"
            )
        nodes, per_node = count // per_node_max, per_node_max
    else:
        nodes, per_node = 1, count
    notes = []
    if type_txt.lower() != name.lower():
        notes.append(f"{type_txt} read as {name}")
    host, net = None, None
    if mem_txt is not None:
        mem_txt, net = _net_part(mem_txt, text)
        if net is not None:
            notes.append(f"network between nodes {net * 8:g} Gb/s per node (given)")
    if mem_txt is not None:  # "@MEM", "@host=SIZE" or "@MEM@host=SIZE"
        parts = mem_txt.split("@")
        hosts = [p for p in parts if p.lower().startswith("host=")]
        rest = [p for p in parts if not p.lower().startswith("host=")]
        if len(hosts) > 1 or len(rest) > 1:
            raise SpecError(f"malformed --gpus {text!r}: at most one @MEM and one @host=SIZE; {GRAMMAR}")
        if hosts:
            host = _parse_mem(hosts[0][len("host=") :])
            notes.append(f"host memory {host / GiB:.0f} GiB per node")
        mem_txt = rest[0] if rest else None
    if mem_txt is not None:
        mem = _parse_mem(mem_txt)
        notes.append(f"memory capped at {mem / GiB:.2f} GiB per device")
    elif name == "cpu":
        mem = host_memory_bytes() // per_node
        notes.append(f"cpu ranks share this machine's RAM: {mem / GiB:.1f} GiB each")
    else:
        mem = entry["memory_mib"] * MiB
    spec = _spec(name, entry, mem)
    if host is not None:
        spec = dataclasses.replace(spec, host_memory_bytes=host)
    if net is not None:  # GB/s per GPU, as data/gpus.yaml's inter_node_gbps
        spec = dataclasses.replace(spec, inter_node_gbps=net / per_node)
    return Cluster(gpu=spec, num_nodes=nodes, gpus_per_node=per_node, text=raw, note="; ".join(notes))
