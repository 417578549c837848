"""Where trials run. `base` defines the contract; `ray_executor` runs real trials, `simulated`
prices them with the cost model. `choose` decides which one a search gets (starting nothing),
`make` starts it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from autotune.errors import SpecError
from autotune.hardware import Cluster

Kind = Literal["ray", "simulated"]
PRESENT_MEMORY_FRACTION = 0.9
"""A device counts as the requested type when it has at least this share of the preset's memory:
driver-reported totals sit a few percent under the marketing size (an 80 GB A100 reports 81,920 MiB,
data/gpus.yaml), while the two sizes of one name (A100 40/80 GB) differ by half."""


GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")
"""Present wherever a GPU driver is: NVIDIA's kernel module (its /proc folder, its control device) or
ROCm's (/dev/kfd, which torch.cuda reaches through HIP). Without one, torch.cuda sees no device."""


def devices_present(cluster: Cluster) -> tuple[bool, str]:
    """Whether the requested devices are here: CPU ranks always are; GPUs if CUDA shows enough of
    them, of the requested name and memory size."""
    if cluster.gpu.is_cpu:
        return True, "cpu ranks run here"
    if not any(Path(p).exists() for p in GPU_DRIVER_PATHS):
        # no GPU driver: no device, known without importing torch (8 s of a simulated plan's 40 on 2 cores)
        return False, f"{cluster.describe()} requested, this machine has 0 CUDA device(s) (no GPU driver)"
    import torch

    n = torch.cuda.device_count()
    if n < cluster.world_size or cluster.num_nodes > 1:
        return False, f"{cluster.describe()} requested, this machine has {n} CUDA device(s)"
    props = torch.cuda.get_device_properties(0)
    family = cluster.gpu.name.split("-")[0].lower()
    if family not in props.name.lower() or props.total_memory < PRESENT_MEMORY_FRACTION * cluster.gpu.memory_bytes:
        return False, (
            f"{cluster.gpu.name} requested, this machine has {n} x {props.name} ({props.total_memory / 2**30:.0f} GiB)"
        )
    return True, f"{n} x {props.name} here"


RAY_CONNECT_S = 5.0
"""How long a --ray-address may take to accept a TCP connection. Ray's own client retries for about 20 s, printing a
gcs_client warning each time, then raises ConnectionError (measured: 22 s and ~20 lines for 127.0.0.1:1)."""


def check_reachable(address: str, timeout_s: float = RAY_CONNECT_S) -> None:
    """SpecError (exit 2) at once when nothing accepts connections at `address` (HOST:PORT, or ray://HOST:PORT of Ray
    Client); "auto" and other forms are left to Ray."""
    import socket

    text = address.strip()
    rest = text.split("://", 1)[1] if "://" in text else text
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        if text in ("auto", "local") or "://" in text:
            return
        raise SpecError(f"--ray-address {address!r}: expected HOST:PORT of the Ray head node (e.g. 10.0.0.1:6379)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        why = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise SpecError(
            f"--ray-address {address}: cannot reach a Ray cluster there ({why.lower()}); start one "
            f"with `ray start --head` on that machine, or check the host and port (the head's GCS port, 6379 by default)"
        ) from None


def choose(kind: str, cluster: Cluster, ray_address: str | None, dry_run: bool = False) -> tuple[Kind, str]:
    """Which executor ("ray" or "simulated") for `kind` (auto, ray, simulated), and a sentence saying
    which and why; starts nothing. A `dry_run` is Ray's (the ranks' plans, nothing measured): on a local Ray with the
    cluster's GPUs declared when no --ray-address is given."""
    if ray_address:
        check_reachable(ray_address)
    if dry_run:
        if kind == "simulated":
            raise SpecError("--dry-run shows what the Ray executor's ranks would run with: use --executor ray or auto")
        where = (
            f"the Ray cluster at {ray_address}"
            if ray_address
            else "a local Ray instance"
            + ("" if cluster.gpu.is_cpu else f" with {cluster.gpus_per_node} GPU(s) per node declared")
        )
        return "ray", f"ray, DRY RUN on {where}: trials are placed and their ranks started, nothing is measured"
    here, why = devices_present(cluster)
    if ray_address and not here:
        why = f"{cluster.describe()} expected from the Ray cluster"
    if kind == "auto":
        kind = "ray" if here or ray_address else "simulated"
        if kind == "simulated":
            why += "; results below are SIMULATED by the cost model, not measured"
    if kind == "ray":
        if not here and not ray_address:
            raise SpecError(
                f"--executor ray: {why}; pass --ray-address of a Ray cluster that has them, or use --executor simulated"
            )
        where = f"the Ray cluster at {ray_address}" if ray_address else "a local Ray instance"
        return "ray", f"ray: real DeepSpeed trials on {where} ({why})"
    if cluster.gpu.is_cpu:
        raise SpecError(
            "--executor simulated: the cost model prices GPUs from their datasheets; CPU ranks "
            "are run for real (--executor ray or auto)"
        )
    return "simulated", f"simulated: the throughput cost model ({why})"


def make(
    kind: Kind, cluster: Cluster, ray_address: str | None = None, concurrent_trials: int = 1, dry_run: bool = False
):
    """Start the executor `choose` picked."""
    if kind == "ray":
        from autotune.executors.ray_executor import RayExecutor

        return RayExecutor(cluster, ray_address=ray_address, concurrent_trials=concurrent_trials, dry_run=dry_run)
    from autotune.executors.simulated import SimulatedExecutor

    # As many in flight as the search would run on the GPUs: the stopping rule reads each result before it
    # picks the next (search/stopping.py); 256 slots ran 196 simulated trials of lora.yaml (13B x 4xA100), not ~11.
    return SimulatedExecutor(slots=concurrent_trials)
