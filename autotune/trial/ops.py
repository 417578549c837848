"""What one node can run, found out once per node before any trial: whether DeepSpeed's FusedAdam is prebuilt or can
be built there, whether bitsandbytes is installed, and the node's memory. Asked by the Ray executor of every node it
places trials on (autotune/executors/ray_executor.py, one task per node) and by the launcher for a local trial.

Nothing here makes a CUDA call: `node_facts` reads versions, files and `nvcc -V`; the device's own memory is read by
`device_memory`, which the executor runs only on a real run (never in a dry run).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket

import psutil

from autotune.deepspeed_config import default_optimizer_impl
from autotune.errors import SpecError
from autotune.hardware import Cluster
from autotune.train_config import TrainConfig

BNB_EXTRA = "pip install 'autotune[bnb]'"
"""How to install bitsandbytes: pyproject's optional extra `bnb`."""


@functools.cache
def fused_adam() -> tuple[bool, str]:
    """(whether DeepSpeed can load its FusedAdam op on this node, why), decided as DeepSpeed's op builder does
    (deepspeed/ops/op_builder/builder.py): `OpBuilder.load` imports a prebuilt op when the install has it
    (git_version_info.installed_ops['fused_adam'], built for the cuda accelerator); otherwise `jit_load` compiles it,
    which needs ninja (verify_ninja_availability) and a CUDA toolkit whose nvcc (CUDA_HOME/bin/nvcc -V,
    installed_cuda_version) matches the CUDA torch was built with (assert_no_cuda_mismatch: equal major.minor, or a
    minor pair listed in cuda_minor_mismatch_ok, which has no CUDA 13 entry). `FusedAdamBuilder.is_compatible` alone
    says True on any machine (measured: on this CPU-only torch), so it is not asked."""
    import torch

    try:
        from deepspeed.git_version_info import accelerator_name, installed_ops
    except ImportError:
        return False, "DeepSpeed is not installed"
    if installed_ops.get("fused_adam") and accelerator_name == "cuda":
        return True, "prebuilt in this DeepSpeed install"
    if torch.version.hip:
        return False, "ROCm torch: autotune does not build DeepSpeed's ops for HIP"
    if not torch.version.cuda:
        return False, f"torch {torch.__version__} is built without CUDA, and this DeepSpeed has no prebuilt FusedAdam"
    from deepspeed.ops.op_builder.builder import (
        CUDAMismatchException,
        MissingCUDAException,
        assert_no_cuda_mismatch,
        installed_cuda_version,
    )
    from torch.utils.cpp_extension import is_ninja_available

    try:
        major, minor = installed_cuda_version()
    except MissingCUDAException as e:
        return False, f"no CUDA compiler to build it ({e}); the torch wheels from the package index ship none"
    try:
        assert_no_cuda_mismatch("fused_adam")
    except CUDAMismatchException:
        return (
            False,
            f"nvcc is CUDA {major}.{minor}, torch is built with CUDA {torch.version.cuda}: DeepSpeed refuses it",
        )
    if not is_ninja_available():
        return False, "ninja is not installed (DeepSpeed's JIT build runs it)"
    return True, f"buildable: nvcc {major}.{minor} matches torch's CUDA {torch.version.cuda}, ninja installed"


def bitsandbytes() -> tuple[bool, str]:
    """(whether bitsandbytes is installed here, its version or how to install it); not imported (it loads CUDA)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return False, f"bitsandbytes is not installed ({BNB_EXTRA})"
    from importlib.metadata import version

    return True, f"bitsandbytes {version('bitsandbytes')}"


def node_facts(gpu_cluster: bool = True) -> dict:
    """This node's answers, as plain values (a Ray task returns them): host name, CPUs, RAM, and on a GPU cluster
    whether FusedAdam and bitsandbytes can run. No CUDA call."""
    facts = {
        "host": socket.gethostname(),
        "cpus": os.cpu_count() or 1,
        "ram_bytes": psutil.virtual_memory().total,
    }
    if gpu_cluster:
        ok, why = fused_adam()
        bnb, bnb_why = bitsandbytes()
        facts.update(fused_adam=ok, fused_adam_why=why, bitsandbytes=bnb, bitsandbytes_why=bnb_why)
    return facts


def device_memory() -> dict:
    """The CUDA devices this process sees (CUDA_VISIBLE_DEVICES): count, name and total memory as torch reports it
    (cudaMemGetInfo's total, below the driver's figure that nvidia-smi and the presets show). Makes a CUDA context:
    the executor runs it in a Ray task of its own that exits after (max_calls=1), never in a dry run."""
    import torch

    n = torch.cuda.device_count()
    if not n:
        return {"count": 0}
    props = torch.cuda.get_device_properties(0)
    return {"count": n, "name": props.name, "total_bytes": int(torch.cuda.mem_get_info(0)[1])}


def optimizer_impl(cfg: TrainConfig, cluster: Cluster, facts: list[dict]) -> str:
    """The optimizer code a trial of `cfg` runs on nodes that answered `facts` (node_facts, every node of the trial):
    FusedAdam where every node can load it, else torch's fused AdamW, which needs no build; bitsandbytes' 8-bit AdamW
    only where every node has bitsandbytes (SpecError, exit 2, otherwise)."""
    impl = default_optimizer_impl(cfg, cluster)
    if impl == "bnb_adamw8bit":
        missing = [f["host"] for f in facts if not f.get("bitsandbytes")]
        if missing:
            raise SpecError(
                f"optimizer adamw8bit needs bitsandbytes on every node, and {', '.join(missing)} has none: "
                f"{BNB_EXTRA} there, or search adamw"
            )
    if impl == "fused_adam" and not all(f.get("fused_adam") for f in facts):
        return "torch_adamw_fused"
    return impl


def optimizer_reason(facts: list[dict]) -> str:
    """Why FusedAdam is or is not used, in one line (node 0's answer, or the first node that cannot)."""
    bad = next((f for f in facts if not f.get("fused_adam", True)), None)
    f = bad or (facts[0] if facts else {})
    return f"FusedAdam on {f.get('host', '?')}: {f.get('fused_adam_why', 'not asked (CPU ranks)')}"
