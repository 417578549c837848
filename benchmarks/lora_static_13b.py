"""The reference article's claim, in numbers: LoRA's static memory for a 13B model on 4 x A100
against full fine-tuning, per ZeRO stage (docs/memory.md "LoRA and QLoRA"). Static = what every
step holds from start to end: parameters (frozen base + adapters), fp32 master weights, optimizer
states, and ZeRO-3's persistent gradient partition; the same terms `autotune estimate --json`
reports (memory/model_states.py, memory/lora.py). `python benchmarks/lora_static_13b.py`."""

from __future__ import annotations

from autotune.hardware import parse_gpus
from autotune.memory import _phases
from autotune.models import resolve_model
from autotune.train_config import TrainConfig
from autotune.units import GiB

STATIC = (
    "parameters",
    "frozen_parameters",
    "adapter_parameters",
    "master_weights",
    "optimizer_states",
    "gradient_partition",
)
METHODS = [
    ("full", {}),
    ("lora r8 attention", dict(method="lora", lora_rank=8)),
    ("lora r64 all-linear", dict(method="lora", lora_rank=64, lora_targets="all-linear")),
    ("qlora r64 all-linear", dict(method="qlora", lora_rank=64, lora_targets="all-linear")),
]


def table(model: str = "13b", gpus: str = "4xA100") -> list[tuple[str, int, float]]:
    spec, cluster = resolve_model(model, implementation="hf", factory=None), parse_gpus(gpus)
    rows = []
    for name, kw in METHODS:
        for z in (0, 1, 2, 3):
            terms = _phases(spec, cluster, TrainConfig(zero_stage=z, seq_len=2048, **kw))["optimizer"]
            rows.append((name, z, sum(v for k, v in terms.items() if k in STATIC) / GiB))
    return rows


if __name__ == "__main__":
    rows = table()
    full = {z: v for n, z, v in rows if n == "full"}
    print(f"{'method':<22} " + " ".join(f"{'ZeRO-' + str(z):>16}" for z in range(4)))
    for name, _ in METHODS:
        cells = [
            f"{v:8.2f} GiB {full[z] / v:4.0f}x" if name != "full" else f"{v:8.2f} GiB      "
            for n, z, v in rows
            if n == name
        ]
        print(f"{name:<22} " + " ".join(f"{c:>16}" for c in cells))
