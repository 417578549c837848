"""The analytic phases of a training step and the estimate's result type: `phases(model, cluster,
cfg)` prices each point where memory peaks as a sum of terms (model_states.py, buffers.py,
activations.py; LoRA's from lora.py), and `MemoryEstimate` is what `autotune.memory.estimate`
returns. For code other than the builtin stand-in the activation terms here are placeholders that
traced.py replaces with the traced ones; the layer order of memory/ is pyproject.toml's import contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.hardware import Cluster
from autotune.memory import activations as act
from autotune.memory import buffers, model_states
from autotune.memory.code_trace import persistent_params
from autotune.memory.layout import Layout
from autotune.memory.lora import lora_phases
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig
from autotune.units import GiB


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    num_params: int
    tensor_peak_bytes: int
    """Peak tensor bytes per GPU: what torch.cuda.max_memory_allocated (or the CPU profiler) sees."""
    overhead_bytes: int
    capacity_bytes: int
    phase: str
    """Where the peak is: forward, backward (loss | end | recompute) or optimizer."""
    terms: dict[str, int]
    """Bytes by term at the peak phase; they sum to tensor_peak_bytes."""
    overhead: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    """Tensor bytes at each candidate peak point."""
    host_bytes: int = 0
    """Host RAM one node needs (offloaded states, rank runtimes; memory/host.py); 0 on CPU ranks."""
    host_capacity_bytes: int = 0
    """Host RAM per node (data/gpus.yaml, or @host= on --gpus); 0: unknown, not checked."""

    @property
    def host_fits(self) -> bool:
        return not self.host_capacity_bytes or self.host_bytes <= self.host_capacity_bytes

    @property
    def total_bytes(self) -> int:
        return self.tensor_peak_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes and self.host_fits

    @property
    def used_fraction(self) -> float:
        """Fraction of capacity used."""
        return self.total_bytes / self.capacity_bytes if self.capacity_bytes else float("inf")

    @property
    def dominant_term(self) -> str:
        return max(self.terms, key=self.terms.get)

    def to_json(self) -> dict:
        return {
            "num_params": self.num_params,
            "total_bytes": self.total_bytes,
            "tensor_peak_bytes": self.tensor_peak_bytes,
            "overhead_bytes": self.overhead_bytes,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "used_fraction": round(self.used_fraction, 4),
            "phase": self.phase,
            "dominant_term": self.dominant_term,
            "terms": dict(self.terms),
            "overhead": dict(self.overhead),
            "phases": dict(self.phases),
            "source": "estimated",
            "host_bytes_per_node": self.host_bytes,
            "host_capacity_bytes": self.host_capacity_bytes,
        }

    def verdict(self) -> str:
        if not self.host_fits:
            return (
                f"does not fit host memory: the node needs {self.host_bytes / GiB:.1f} GiB of host RAM "
                f"(offloaded states), has {self.host_capacity_bytes / GiB:.1f} GiB"
            )
        pct = 100 * self.used_fraction
        if self.fits:
            return f"fits: {self.total_bytes / GiB:.2f} of {self.capacity_bytes / GiB:.2f} GiB ({pct:.1f}% used)"
        return (
            f"does not fit: needs {self.total_bytes / GiB:.2f} GiB, has {self.capacity_bytes / GiB:.2f} GiB "
            f"({pct:.1f}%); largest term: {self.dominant_term}"
        )


def builtin(model: ModelSpec) -> bool:
    """Whether `model` runs autotune/impl/builtin.py, which the analytic activation terms describe;
    any other code (Hugging Face, a factory module) is traced (memory/code_trace.py)."""
    return getattr(model, "implementation", "builtin") == "builtin"


def phases(
    model: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout | None = None
) -> dict[str, dict[str, int]]:
    """The analytic phases. For code other than the builtin model the activation terms here are
    placeholders that traced.trace replaces; ZeRO-3's persistent parameters are then counted on the
    module itself (a Qwen2 has biases on q, k, v only, which the shape does not say). LoRA/QLoRA:
    memory/lora.py's phases, built from these for the adapters. `layout`: memory.estimate's
    (memory/layout.py), else that of (model, cluster, cfg)."""
    layout = layout or Layout.of(model, cluster, cfg)
    if cfg.method != "full":
        return lora_phases(model, cluster, cfg, layout, phases)
    threshold = layout.stage3_param_persistence_threshold
    fused = not cluster.gpu.is_cpu
    kw = dict(micro_batch=cfg.micro_batch, seq_len=cfg.seq_len, precision=cfg.precision)
    keep = None
    if not builtin(model) and cfg.zero_stage == 3:
        keep = persistent_params(model, threshold)
    static = model_states.states(model, cluster, cfg, threshold, layout.reduce_bucket_size, keep)
    gathered = {"zero3_gathered_params": model_states.zero3_gathered(model, cluster, cfg, layout, keep)}
    carried = {
        "accumulated_gradients": buffers.accumulated_gradients(model, cluster, cfg),
        "carried_reduce_bucket": buffers.carried_reduce_bucket(model, cfg, layout),
    }
    saved = act.activation_bytes(model, ckpt_layers=cfg.ckpt_layers, attention=cfg.attention, **kw)
    grads = {"gradients": buffers.backward_gradients(model, cluster, cfg, layout)}
    out = {
        "forward": {
            **static,
            **gathered,
            **carried,
            **saved,
            "logits_transient": act.logits_forward_transient_bytes(model, **kw),
        },
        "backward (loss)": {
            **static,
            **gathered,
            **carried,
            **saved,
            "logits_transient": act.logits_backward_transient_bytes(model, **kw),
        },
        "backward (head)": {
            **static,
            **gathered,
            **carried,
            **{k: v for k, v in saved.items() if k != "logits_and_loss"},
            **buffers.head_gradient_bytes(model, cluster, cfg, layout),
        },
        "backward (end)": {**static, **gathered, **grads, **buffers.backward_end_extra(model, cluster, cfg, layout)},
        "optimizer": {
            **static,
            **model_states.step_terms(model, cluster, cfg, fused, layout),
            **model_states.zero3_step_parameters(model, cluster, cfg),
        },
    }
    prefetch = model_states.zero3_prefetch(
        model, cluster, cfg, layout, keep, on_demand=model.vocab_size * model.hidden_size if builtin(model) else 0
    )
    if prefetch:  # ZeRO-3 from the second step: the head's prefetched bucket, just before the head runs
        before_head = {
            **static,
            **gathered,
            **carried,
            "prefetch_bucket": prefetch,
            **{k: v for k, v in saved.items() if k != "logits_and_loss"},
        }
        out = {"forward": out.pop("forward"), "forward (prefetch)": before_head, **out}
    if cfg.ckpt_layers:
        # Checkpointed blocks run backward last, from block k-1 down to 0: the first holds all k
        # inputs and the gradients of the L-k blocks after it, the last one input and nearly every
        # gradient; memory is linear in between, so the two ends bound it.
        layer = act.layer_saved_bytes(model, attention=cfg.attention, **kw)
        one_input = saved["checkpointed_inputs"] // cfg.ckpt_layers
        L, k = model.num_layers, cfg.ckpt_layers
        for name, inputs, done in (("first", k, L - k), ("last", 1, L)):
            out[f"backward (recompute {name})"] = {
                **static,
                **gathered,
                **carried,
                "gradients": buffers.gradients_during_backward(model, cluster, cfg, layout, done),
                "comm_buffers": buffers.buckets_in_backward(model, cfg, layout),
                "checkpointed_inputs": inputs * one_input,
                "rotary_tables": saved["rotary_tables"],
                "recomputed_layer": layer,
            }
    return {name: {k: v for k, v in terms.items() if v} for name, terms in out.items()}
