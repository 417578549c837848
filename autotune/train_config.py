"""The training configuration autotune searches over: `TrainConfig`, its checks against a model and
a cluster (`check_config`), and the precision facts every layer shares.

TrainConfig is the single source of its settings. Each field's metadata says how the rest of the
program treats it, so a new setting is one field here plus the memory and cost terms that price it:
- `space`: the values a search space tries when its YAML omits the key (search_space.py);
  a field without it is fixed per study, not searched (seq_len's `auto` is the study's --seq-len);
- `flag` and `help`: its option on `autotune estimate` / `autotune trial` (cli/common.py);
- `column`: "always" puts it in every ranked report row, "varying" only when the study's runs
  differ in it (report.py).
Choices come from the field's `Literal` type, integers' lower bounds from `minimum`.
docs/search.md ("Adding a setting") walks through one.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any, Literal

from autotune.errors import SpecError
from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.models.hf_config import attentions
from autotune.parallel import check_parallel

Precision = Literal["fp32", "fp16", "bf16"]

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per parameter/activation element in the training dtype: DeepSpeed casts the module to the
bf16/fp16 dtype (engine._configure_distributed_model), fp32 otherwise."""
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""torch dtype names per precision (torch is imported where a dtype is needed, not here)."""


def dtype_bytes(precision: str) -> int:
    """Element size of the model's parameters and activations (bytes)."""
    return ELEMENT_BYTES[precision]


def torch_dtype(precision: str):
    import torch

    return getattr(torch, TORCH_DTYPES[precision])


LORA_FIELDS = ("lora_rank", "lora_targets", "lora_alpha", "lora_dropout")
"""The settings that only matter when method is lora or qlora."""


def _setting(
    default,
    *,
    space: tuple | None,
    help: str,
    flag: str | None = None,
    column: str = "varying",
    minimum: int | None = None,
):
    return field(
        default=default, metadata={"space": space, "help": help, "flag": flag, "column": column, "minimum": minimum}
    )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One candidate: everything a DeepSpeed run needs besides the model and the GPUs."""

    zero_stage: Literal[0, 1, 2, 3] = _setting(0, space=(0, 1, 2, 3), flag="--zero", column="always", help="ZeRO stage")
    """ZeRO stage 0-3 (Rajbhandari et al. 2020): 1 shards optimizer states, 2 also gradients,
    3 also parameters, over the data-parallel ranks."""
    ckpt_layers: int = _setting(
        0, space=("all",), column="always", minimum=0, help="activation-checkpointed layers (the first k)"
    )
    """How many transformer blocks (the first k of L) recompute their activations in backward."""
    micro_batch: int = _setting(
        1, space=(1, 2, 4, 8, 16), column="always", minimum=1, help="sequences per GPU per forward"
    )
    """Sequences per GPU per forward pass (DeepSpeed's train_micro_batch_size_per_gpu)."""
    grad_accum: int = _setting(1, space=(1,), column="always", minimum=1, help="micro batches per optimizer step")
    """Micro batches accumulated per optimizer step."""
    precision: Precision = _setting("bf16", space=("auto",), column="always", help="training precision")
    """fp32; fp16 with dynamic loss scaling; bf16. Both 16-bit modes keep fp32 master weights."""
    optimizer: Literal["adamw", "adamw8bit"] = _setting("adamw", space=("adamw",), help="optimizer")
    """AdamW with fp32 moments, or 8-bit AdamW (bitsandbytes; moments in 1 byte each)."""
    bf16_master_weights_and_grads: bool = _setting(
        False,
        space=(False,),
        help="bf16 master weights and gradient partition (ZeRO 1-3, bf16; DeepSpeed bf16 section)",
    )
    """DeepSpeed's `bf16.bf16_master_weights_and_grads` (runtime/config.py; ZeRO optimizers build their
    master partition in bf16, base_optimizer.py _configure_master_weights). Halves the master copy;
    with fp32 optimizer states DeepSpeed requires ZeRO-Offload with DeepSpeedCPUAdam."""
    bf16_optimizer_states: bool = _setting(
        False, space=(False,), help="bf16 Adam moments (needs --bf16-master-weights-and-grads)"
    )
    """DeepSpeed's `bf16.bf16_optimizer_states`: Adam's moments in bf16, 4 B/param instead of 8 (the
    reference article's way to halve static memory; a stability risk it warns of, flagged in the report)."""
    offload_optimizer: bool = _setting(False, space=(False,), help="ZeRO-Offload of the optimizer states")
    """ZeRO-Offload: optimizer states and the step on the CPU (needs ZeRO >= 1)."""
    offload_param: Literal["none", "cpu"] = _setting(
        "none", space=("none",), help="ZeRO-3 parameter offload (ZeRO-Infinity) to host memory"
    )
    """DeepSpeed's `zero_optimization.offload_param.device` (runtime/zero/offload_config.py): stage 3
    keeps each rank's parameter partition in pinned host memory and gathers from there
    (Rajbhandari et al. 2021, ZeRO-Infinity, arXiv:2104.07857)."""
    attention: Literal["sdpa", "eager", "flash_attention_2"] = _setting(
        "sdpa",
        space=("auto",),
        help="attention implementation, transformers' names (flash_attention_2: GPU, hf only); default: what "
        "transformers picks for the model's class (sdpa where it has it, else eager)",
    )
    """transformers' attn_implementation names. sdpa: torch's scaled_dot_product_attention
    (memory-efficient/flash kernels, no s x s matrix kept; what transformers picks by default);
    eager: the explicit softmax(QK^T)V that keeps the s x s scores; flash_attention_2: the
    flash-attn package's kernels (GPU and the hf code only)."""
    method: Literal["full", "lora", "qlora"] = _setting(
        "full",
        space=("full",),
        column="always",
        help="what trains: full (every weight), lora (peft adapters on a frozen 16-bit base), qlora (the same "
        "on a 4-bit NF4 base: GPU only)",
    )
    """full fine-tuning; LoRA (Hu et al. 2021, arXiv:2106.09685): the base frozen, low-rank adapters B·A
    trained, by peft; QLoRA (Dettmers et al. 2023, arXiv:2305.14314): the frozen base in 4-bit NF4
    (bitsandbytes). autotune/impl/lora.py applies them through the model seam."""
    lora_rank: int = _setting(8, space=(8,), minimum=1, help="LoRA rank r (method lora/qlora)")
    """Rank r of each adapter (A: r x in, B: out x r). Ignored (normalised to the default) for full."""
    lora_targets: Literal["attention", "all-linear"] = _setting(
        "attention",
        space=("attention",),
        help="adapted layers: attention (q, k, v, o projections, fused or not) or all-linear "
        "(peft's: every linear layer but the LM head)",
    )
    """Which linear layers get adapters (autotune/impl/lora.py `target_modules`)."""
    lora_alpha: int = _setting(0, space=(0,), minimum=0, help="LoRA alpha; 0 means 2 x rank")
    """peft's lora_alpha (scaling alpha/r). 0 is the sentinel for 2 x lora_rank (`alpha`)."""
    lora_dropout: float = _setting(0.05, space=(0.05,), help="dropout on the adapters' input")
    """peft's lora_dropout: in [0, 1). With p > 0 the adapter path keeps its dropout mask and output."""
    grad_accum_dtype: Literal["auto", "fp32"] = _setting(
        "auto",
        space=("auto",),
        help="gradient accumulation dtype (DeepSpeed data_types.grad_accum_dtype; auto: the model's dtype)",
    )
    """DeepSpeed's `data_types.grad_accum_dtype` (runtime/config.py). fp32 with 16-bit training: at
    ZeRO-1 bf16 DeepSpeed switches to its BF16_Optimizer (engine._do_optimizer_sanity_check), which
    keeps full fp32 gradients beside the partition; at ZeRO-3 the flat gradient partition is fp32
    (stage3.py grad_partitions_flat_buffer); at ZeRO-2 the reduced partition is fp32."""
    overlap_comm: bool = _setting(
        False, space=(False,), help="ZeRO 1-2: reduce gradients during backward (a second reduce bucket)"
    )
    """DeepSpeed's `zero_optimization.overlap_comm` at stages 1-2: a second reduce bucket
    (stage_1_and_2.py setup_buckets, "double buffers"). Stage 3 always overlaps (nothing allocated)."""
    reduce_bucket_size: int = _setting(
        0, space=(0,), minimum=0, help="ZeRO reduce bucket in elements (0: hidden^2, Hugging Face's auto)"
    )
    """`zero_optimization.reduce_bucket_size` in elements; 0 writes Hugging Face's "auto" hidden^2."""
    allgather_bucket_size: int = _setting(
        0, space=(0,), minimum=0, help="ZeRO 1-2 allgather bucket in elements (0: hidden^2)"
    )
    """`zero_optimization.allgather_bucket_size` (stages 1-2) in elements; 0 writes hidden^2."""
    stage3_param_persistence_threshold: int = _setting(
        0, space=(0,), minimum=0, help="ZeRO-3: parameters under this many elements stay whole (0: 10 hidden)"
    )
    """`zero_optimization.stage3_param_persistence_threshold`; 0 writes Hugging Face's auto 10 h."""
    stage3_prefetch_bucket_size: int = _setting(
        0,
        space=(0,),
        minimum=0,
        help="ZeRO-3: elements gathered ahead of use (0: 0.9 hidden^2, Hugging Face's auto; 1: one parameter)",
    )
    """`zero_optimization.stage3_prefetch_bucket_size`; 0 writes Hugging Face's auto 0.9 h^2. The
    coordinator gathers up to this many elements of the next modules ahead of use, from the second
    step on (partitioned_param_coordinator.py _fetch_sub_module_impl); 1 prefetches one parameter
    (DeepSpeed's own zero_allgather_sequential setting, engine.py)."""
    stage3_max_live_parameters: int = _setting(
        0,
        space=(0,),
        minimum=0,
        help="ZeRO-3: prefetch stops once this many elements are gathered (0: DeepSpeed's 1e9)",
    )
    """`zero_optimization.stage3_max_live_parameters`; 0 writes DeepSpeed's default 1e9. It caps only
    the prefetch (min(max_live - available, prefetch bucket), partitioned_param_coordinator.py):
    parameters a module needs are gathered whatever it is, and released by stage3_max_reuse_distance."""
    zero_quantized_weights: bool = _setting(
        False, space=(False,), help="ZeRO++ qwZ: int8 weight all-gather (ZeRO-3, GPUs)"
    )
    """ZeRO++ qwZ (Wang et al. 2023, arXiv:2306.10209, sec. 3.1): the stage-3 all-gather of weights in
    int8, half the bytes of bf16. CUDA quantizer kernels: GPUs only."""
    zero_quantized_gradients: bool = _setting(
        False, space=(False,), help="ZeRO++ qgZ: quantized gradient reduce-scatter (ZeRO-3, GPUs)"
    )
    """ZeRO++ qgZ (arXiv:2306.10209, sec. 3.3): gradients reduce-scattered by an all-to-all in int4,
    a quarter of the bf16 bytes (stage3.py all_to_all_quant_reduce). GPUs only."""
    zero_hpz_partition_size: int = _setting(
        1,
        space=(1,),
        minimum=1,
        help="ZeRO++ hpZ: secondary weight partition within this many GPUs of a node (ZeRO-3, multi-node, GPUs)",
    )
    """ZeRO++ hpZ (arXiv:2306.10209, sec. 3.2): a second copy of the weights partitioned within a node,
    so the backward all-gather stays on NVLink; costs pb*P/hpz bytes per GPU."""
    autotp_size: int = _setting(
        1, space=(1,), minimum=1, help="tensor-parallel ranks (DeepSpeed AutoTP training; 1: off)"
    )
    """DeepSpeed's `tensor_parallel.autotp_size` (runtime/tensor_parallel/config.py): the model's linears
    sharded over this many ranks, which see the same batch; ZeRO then shards over world / tp
    (autotune/parallel.py checks it, docs/parallelism.md)."""
    sequence_parallel_size: int = _setting(
        1, space=(1,), minimum=1, help="Ulysses sequence-parallel ranks (DeepSpeed ALST; 1: off)"
    )
    """DeepSpeed's Ulysses sequence parallelism (`sequence_parallel_size` in its JSON, runtime/config.py; the
    attention of runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF): each sequence is split over this
    many ranks, which see the same micro batch; ZeRO shards over world / (tp x sp) data-parallel ranks
    (autotune/parallel.py checks it, docs/parallelism.md)."""
    deepcompile: bool = _setting(
        False,
        space=(False,),
        help="DeepSpeed's DeepCompile (ZeRO 1-3, CUDA, torch >= 2.6); not priced: estimated as without",
    )
    """DeepSpeed's `compile.deepcompile` plus engine.compile() (deepspeed/compile/, runtime/engine.py compile):
    ZeRO 1-3 only (stage 0 "Falling back to the torch compiler"), CUDA only (compile/util.py
    is_deepcompile_supported). Memory and speed are priced as without it (docs/parallelism.md)."""
    seq_len: int = _setting(2048, space=("auto",), minimum=1, help="sequence length (default: min(2048, model max))")
    """Tokens per sequence. A search axis (`seq_len: [2048, 4096, 8192]` in a space); `auto`, the
    default, is the study's `--seq-len` (min(2048, the model's maximum) when not given)."""

    def __post_init__(self) -> None:
        if self.method == "full":
            # the adapter settings mean nothing without adapters: one full candidate, not one per rank
            for name in LORA_FIELDS:
                object.__setattr__(self, name, TrainConfig.__dataclass_fields__[name].default)
        elif isinstance(self.lora_dropout, int) and not isinstance(self.lora_dropout, bool):
            object.__setattr__(self, "lora_dropout", float(self.lora_dropout))  # YAML's 0 is an int
        for name in _FIELD_NAMES:
            check_value(name, getattr(self, name))
        self.check_combination()

    def check_combination(self) -> None:
        """Refuse combinations of valid values. It reads attributes only, so `search_space.expand` runs it
        on a plain namespace of a combination before it builds the frozen config (most of a large
        space's product is refused here)."""
        if self.offload_optimizer and self.zero_stage == 0:
            raise SpecError(
                "offload_optimizer needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads the partitioned optimizer only)"
            )
        if self.offload_optimizer and self.optimizer == "adamw8bit":
            raise SpecError(
                "offload_optimizer runs DeepSpeed's CPU Adam, which has no 8-bit states; choose one of the two"
            )
        # then the knobs: combinations DeepSpeed refuses or ignores, so no two candidates run the same job
        z = self.zero_stage
        if self.grad_accum_dtype == "fp32" and self.precision == "fp32":
            raise SpecError("grad_accum_dtype fp32 with fp32 training is the default (auto); drop it")
        if self.grad_accum_dtype == "fp32" and z == 0:
            raise SpecError(
                "grad_accum_dtype fp32 needs ZeRO stage 1-3: without ZeRO DeepSpeed raises "
                "'unsupported mix of model_dtype and grad_accum_dtype' (engine._do_optimizer_sanity_check)"
            )
        if self.overlap_comm and z not in (1, 2):
            raise SpecError(
                "overlap_comm is a ZeRO stage 1-2 choice: stage 3 always overlaps (autotune writes "
                "true, it allocates nothing), stage 0 has no ZeRO reducer"
            )
        if self.reduce_bucket_size and z == 0:
            raise SpecError("reduce_bucket_size needs ZeRO stage 1-3 (stage 0 all-reduces in 5e8-element buffers)")
        if self.allgather_bucket_size and z not in (1, 2):
            raise SpecError("allgather_bucket_size is read at ZeRO stages 1-2 only")
        if self.bf16_master_weights_and_grads and (self.precision != "bf16" or z == 0):
            raise SpecError(
                "bf16_master_weights_and_grads needs bf16 training and ZeRO stage 1-3 "
                "(runtime/config.py asserts the stage)"
            )
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise SpecError("bf16_optimizer_states needs bf16_master_weights_and_grads (runtime/config.py asserts it)")
        if self.bf16_master_weights_and_grads and not self.bf16_optimizer_states and not self.offload_optimizer:
            raise SpecError(
                "bf16_master_weights_and_grads with fp32 optimizer states needs offload_optimizer "
                "(DeepSpeed requires ZeRO-Offload with DeepSpeedCPUAdam then: base_optimizer.py)"
            )
        if self.offload_param != "none" and z != 3:
            raise SpecError("offload_param needs ZeRO stage 3 (only stage 3 partitions the parameters)")
        for name in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "stage3_max_live_parameters"):
            if z != 3 and getattr(self, name):
                raise SpecError(f"{name} is read at ZeRO stage 3 only")
        zpp = self.zero_quantized_weights or self.zero_quantized_gradients or self.zero_hpz_partition_size > 1
        if zpp and z != 3:
            raise SpecError(
                "ZeRO++ (zero_quantized_weights, zero_quantized_gradients, zero_hpz_partition_size) "
                "is built on ZeRO stage 3 (stage3.py); choose --zero 3"
            )
        if self.deepcompile and z == 0:
            raise SpecError(
                "deepcompile needs ZeRO stage 1-3: at stage 0 DeepSpeed falls back to the torch compiler "
                "('Currently DeepCompile supports ZeRO stage 1, 2, or 3 only', runtime/engine.py)"
            )
        if self.allgather_bucket_size % 2:
            raise SpecError(
                "allgather_bucket_size must be even: DeepSpeed asserts a multiple of "
                "nccl_start_alignment_factor 2 (stage_1_and_2.py)"
            )

    @classmethod
    def prechecked(cls, values: dict[str, Any]) -> "TrainConfig":
        """The config of `values` (every field) without `__post_init__`'s checks, for `search_space.expand`,
        which made them (check_value, check_combination) for each of up to tens of thousands of candidates
        (full.yaml, 13B on 4 x A100: 48,996); a frozen dataclass' `__init__` would setattr each field.
        Adapter settings are reset without adapters and an integer dropout made a float, as there."""
        cfg = object.__new__(cls)
        fields = object.__getattribute__(cfg, "__dict__")  # frozen: the instance's dict, filled directly
        fields.update(values)
        if fields.keys() != _FIELD_SET:
            raise ValueError(f"prechecked needs every field and no other: {sorted(_FIELD_SET ^ fields.keys())}")
        if fields["method"] == "full":
            fields.update(_LORA_DEFAULTS)
        elif isinstance(fields["lora_dropout"], int) and not isinstance(fields["lora_dropout"], bool):
            fields["lora_dropout"] = float(fields["lora_dropout"])
        return cfg

    @property
    def alpha(self) -> int:
        """peft's lora_alpha: the field, or 2 x rank for the sentinel 0."""
        return self.lora_alpha or 2 * self.lora_rank

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    def to_dict(self) -> dict:
        # every field is a scalar: no deep copy needed (dataclasses.asdict deep-copies each value,
        # and a search space's expansion calls this per combination)
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    @cached_property
    def _key(self) -> tuple:
        # kept on the instance (frozen: its fields never change); a search asks it of each of
        # tens of thousands of candidates many times (plan, pruning, records)
        return tuple((name, getattr(self, name)) for name in _SORTED_NAMES)

    def key(self) -> tuple:
        """Identity of the candidate, for de-duplication: (field, value) pairs by field name."""
        return self._key

    def short(self) -> str:
        """`z3 bf16 mb4 ga1 ckpt10`, then every other searched setting that is not its default."""
        parts = [
            f"z{self.zero_stage}",
            self.precision,
            f"mb{self.micro_batch}",
            f"ga{self.grad_accum}",
            f"ckpt{self.ckpt_layers}",
        ]
        if self.method != "full":
            parts.append(f"{self.method} r{self.lora_rank}")
        for f in searched_fields():
            v = getattr(self, f.name)
            if f.name in ("method", "lora_rank"):
                continue
            if f.name == "seq_len":
                continue  # printed beside the config where it matters ("seq N"), or a report column
            if f.name == "sequence_parallel_size":
                if v != 1:
                    parts.append(f"sp{v}")
                continue
            if f.metadata["column"] == "varying" and v != f.default:
                parts.append(f.name.replace("_optimizer", "") if v is True else str(v))
        return " ".join(parts)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))
_FIELD_SET = frozenset(_FIELD_NAMES)
_LORA_DEFAULTS = {name: TrainConfig.__dataclass_fields__[name].default for name in LORA_FIELDS}
_SORTED_NAMES = tuple(sorted(_FIELD_NAMES))


STABILITY_RISKS = {
    "bf16_optimizer_states": "bf16 optimizer states and master weights: stability risk. Updates smaller than bf16's "
    "precision are lost and the loss can oscillate late in training (the reference "
    "article); compare its loss curve with fp32 states before a long run",
}
"""Settings that trade training stability for memory, said wherever such a config is shown."""


def risks(cfg: TrainConfig) -> list[str]:
    """The stability risks of `cfg` (STABILITY_RISKS), for the report and `autotune estimate`."""
    return [text for name, text in STABILITY_RISKS.items() if getattr(cfg, name)]


# ---- what the rest of the program derives from the fields ---------------------------------------
@cache
def _types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def searched_fields() -> tuple[dataclasses.Field, ...]:
    """The fields a search space varies (every field with a `space` default), in declaration order."""
    return tuple(f for f in dataclasses.fields(TrainConfig) if f.metadata["space"] is not None)


@cache  # static per field, and called for every field of every config built (a search space's product)
def choices(name: str) -> tuple | None:
    """The allowed values of a Literal field (None for int and bool fields)."""
    t = _types()[name]
    return typing.get_args(t) if typing.get_origin(t) is Literal else None


@cache
def kind(name: str) -> type:
    """int, bool, or the Python type of a Literal field's choices."""
    c = choices(name)
    return type(c[0]) if c else _types()[name]


def allowed_text(name: str) -> str:
    c = choices(name)
    if c:
        return "choose from " + ", ".join(str(v) for v in c)
    if kind(name) is bool:
        return "true or false"
    if kind(name) is float:
        return "a number in [0, 1)"
    low = TrainConfig.__dataclass_fields__[name].metadata["minimum"]
    return "positive integers" if low == 1 else f"integers >= {low}"


_VALID: set[tuple] = set()
"""(field, type, value) seen valid: a space's expansion builds ~1M configs of a few dozen values."""


def check_value(name: str, v: Any) -> None:
    """Raise SpecError unless `v` is a valid value of field `name` (bools are not integers here)."""
    try:
        key = (name, v.__class__, v)
        if key in _VALID:
            return
    except TypeError:  # an unhashable value: checked every time
        key = None
    _check_value(name, v)
    if key is not None:
        _VALID.add(key)


def _check_value(name: str, v: Any) -> None:
    c, k = choices(name), kind(name)
    ok = isinstance(v, k) and (k is bool or not isinstance(v, bool))
    if k is float:  # the dropout probabilities
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1
    if ok and c is not None:
        ok = v in c
    elif ok and k is int:
        ok = v >= TrainConfig.__dataclass_fields__[name].metadata["minimum"]
    if not ok:
        if c is not None:
            want = "one of " + ", ".join(str(x) for x in c)
        elif k is bool:
            want = "true or false"
        elif k is float:
            want = "a number in [0, 1)"
        else:
            low = TrainConfig.__dataclass_fields__[name].metadata["minimum"]
            want = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise SpecError(f"{name} must be {want}, got {v!r}")


def check_config(cfg: TrainConfig, model: ModelSpec, cluster: Cluster) -> None:
    """Raise SpecError if `cfg` cannot run `model` on `cluster`, saying what is allowed."""
    if cfg.ckpt_layers > model.num_layers:
        raise SpecError(
            f"ckpt_layers {cfg.ckpt_layers} exceeds the model's {model.num_layers} layers "
            f"(allowed: 0..{model.num_layers})"
        )
    if cfg.precision == "bf16" and not cluster.gpu.bf16:
        raise SpecError(f"{cluster.gpu.name} has no native bf16 (Ampere or newer needed); use --precision fp16 or fp32")
    if cfg.precision == "fp16" and cluster.gpu.is_cpu:
        raise SpecError(
            "fp16 cannot run on CPU ranks: DeepSpeed refuses it there "
            "('Type fp16 is not supported on your device'); use bf16 or fp32, "
            "or estimate it for a GPU"
        )
    if model.position == "learned" and cfg.seq_len > model.max_seq_len:
        raise SpecError(f"seq_len {cfg.seq_len} exceeds {model.name}'s {model.max_seq_len} learned positions")
    if cfg.attention == "flash_attention_2":
        if cluster.gpu.is_cpu:
            raise SpecError(
                "attention flash_attention_2 runs CUDA kernels only (flash-attn package); "
                "CPU ranks can run sdpa or eager"
            )
        if model.implementation != "hf":
            raise SpecError(
                f"attention flash_attention_2 is a transformers attn_implementation; the "
                f"{model.implementation} code has sdpa or eager"
            )
    supported = None if cfg.attention == "eager" else attentions(model)  # every class runs eager
    if supported is not None and cfg.attention not in supported:
        cls = (model.hf_config or {}).get("architectures", [model.name])[0]
        raise SpecError(
            f"model {model.name}: {cls} has no {cfg.attention} attention in transformers; it runs "
            f"{', '.join(supported)} (transformers picks {supported[0]} for it): use attention "
            f"{supported[0]} (--attention {supported[0]} for estimate and trial, `attention: "
            f"[{supported[0]}]` in a --space file for search)"
        )
    if cfg.method != "full" and model.implementation != "hf":
        raise SpecError(
            f"method {cfg.method} wraps the Hugging Face model with peft; the {model.implementation} "
            f"code cannot take it (use --impl hf, or method full)"
        )
    if cfg.method == "qlora" and cluster.gpu.is_cpu:
        raise SpecError(
            "method qlora needs a GPU: bitsandbytes' 4-bit NF4 kernels run on CUDA only; CPU ranks "
            "can run lora (QLoRA is still estimated and simulated for GPUs)"
        )
    if cfg.method == "qlora" and cfg.precision == "fp32":
        raise SpecError("method qlora computes in a 16-bit dtype (bnb_4bit_compute_dtype); use bf16 or fp16")
    zpp = cfg.zero_quantized_weights or cfg.zero_quantized_gradients or cfg.zero_hpz_partition_size > 1
    if zpp and cluster.gpu.is_cpu:
        raise SpecError(
            "ZeRO++ (qwZ/qgZ/hpZ) needs DeepSpeed's CUDA quantizer kernels: CPU ranks cannot run it; "
            "estimate or simulate it for a GPU"
        )
    if cfg.zero_hpz_partition_size > 1 and (
        cluster.num_nodes == 1 or cluster.gpus_per_node % cfg.zero_hpz_partition_size
    ):
        raise SpecError(
            f"zero_hpz_partition_size {cfg.zero_hpz_partition_size} needs several nodes and must divide "
            f"the {cluster.gpus_per_node} GPUs per node (hpZ partitions within a node)"
        )
    if cfg.optimizer == "adamw8bit" and cluster.gpu.is_cpu:
        raise SpecError("8-bit AdamW (bitsandbytes) needs a GPU; CPU ranks can run adamw")
    check_parallel(cfg, model, cluster)
