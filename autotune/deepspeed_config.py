"""TrainConfig -> DeepSpeed JSON: the one function both a trial and `autotune export` use.

Keys and defaults are DeepSpeed's (docs: deepspeed.ai/docs/config-json; code:
deepspeed/runtime/zero/config.py, deepspeed/runtime/fp16/loss_scaler.py). The result is checked
by DeepSpeed's own parser in the tests (deepspeed.runtime.config.DeepSpeedConfig).
"""

from __future__ import annotations

from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.parallel import global_batch
from autotune.train_config import TrainConfig

# Optimizer hyper-parameters written into the config. They do not change memory or speed;
# they are the usual LLM pre-training values (Touvron et al. 2023, Llama 2, sec. 2.2:
# AdamW beta1 0.9, beta2 0.95, eps 1e-5, weight decay 0.1; gradient clipping 1.0).
ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 0.1}
GRADIENT_CLIPPING = 1.0

# fp16 dynamic loss scaling: the reference article's settings (initial scale 2^16, growth every
# 2000 clean steps, backoff 0.5). DeepSpeed's DynamicLossScaler halves the scale on overflow
# (scale_factor 2.0, deepspeed/runtime/fp16/loss_scaler.py), which is the article's backoff 0.5;
# hysteresis 2 and min scale 1 are DeepSpeed's defaults.
FP16_LOSS_SCALER = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 2000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}

OPTIMIZER_IMPLS = {
    "fused_adam": "DeepSpeed's FusedAdam (its fused_adam op: prebuilt, or compiled with nvcc at first use)",
    "torch_adamw_fused": "torch.optim.AdamW(fused=True): torch's own fused CUDA kernel, nothing to build",
    "torch_adamw": "torch.optim.AdamW (CPU ranks)",
    "cpu_adam": "DeepSpeed's DeepSpeedCPUAdam on the offloaded fp32 partition (its cpu_adam op, C++, built at first use)",
    "bnb_adamw8bit": "bitsandbytes.optim.AdamW8bit, passed to deepspeed.initialize as a client optimizer",
}
"""Which code steps the optimizer: what a trial ran (TrialResult.optimizer_impl) and what `autotune export` writes the
JSON for. DeepSpeed picks it from the JSON (runtime/engine.py get_optimizer_configuration): `torch_adam` gives
torch.optim.AdamW with the remaining params as its arguments (so `fused` reaches it), else an offloaded optimizer
DeepSpeedCPUAdam, else FusedAdam."""


def default_optimizer_impl(cfg: TrainConfig, cluster: Cluster) -> str:
    """The implementation a config runs with when nothing is known of the node (export of an old study): CPU ranks
    torch's AdamW, 8-bit AdamW bitsandbytes', an offloaded optimizer DeepSpeedCPUAdam, else FusedAdam."""
    if cfg.optimizer == "adamw8bit":
        return "bnb_adamw8bit"
    if cluster.gpu.is_cpu:
        return "torch_adamw"
    return "cpu_adam" if cfg.offload_optimizer else "fused_adam"


def check_optimizer_impl(cfg: TrainConfig, cluster: Cluster, impl: str) -> None:
    """`impl` must be one the config can run with; ValueError otherwise (a caller's bug, not the user's input)."""
    allowed = (
        {"bnb_adamw8bit"}
        if cfg.optimizer == "adamw8bit"
        else (
            {"torch_adamw"}
            if cluster.gpu.is_cpu
            else {"cpu_adam", "torch_adamw_fused"}
            if cfg.offload_optimizer
            else {"fused_adam", "torch_adamw_fused"}
        )
    )
    if impl not in allowed:
        raise ValueError(
            f"optimizer implementation {impl!r} cannot run {cfg.short()} on {cluster.describe()}: {allowed}"
        )


STAGE3_MAX_LIVE_PARAMETERS = int(1e9)
STAGE3_MAX_REUSE_DISTANCE = int(1e9)
"""DeepSpeed's defaults (runtime/zero/config.py max_live_parameters, max_reuse_distance)."""


def bucket_sizes(model: ModelSpec, cfg: TrainConfig | None = None) -> dict[str, int]:
    """ZeRO bucket sizes in elements: the config's own where it sets one (non-zero), else scaled to
    the model as Hugging Face's "auto" values do.

    transformers/integrations/deepspeed.py (HfTrainerDeepSpeedConfig.trainer_config_finalize):
    reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 * hidden^2,
    stage3_param_persistence_threshold = 10 * hidden. DeepSpeed's fixed defaults (5e8 elements,
    about 2 GB of fp32 per bucket) would dominate the memory of any model under ~1B parameters.
    stage3_max_live_parameters and stage3_max_reuse_distance keep DeepSpeed's 1e9
    (runtime/zero/config.py), which Hugging Face's auto leaves alone too.
    """
    h2 = model.hidden_size * model.hidden_size
    return {
        "reduce_bucket_size": (cfg and cfg.reduce_bucket_size) or h2,
        "allgather_bucket_size": (cfg and cfg.allgather_bucket_size) or h2 + h2 % 2,  # DeepSpeed asserts even
        "stage3_prefetch_bucket_size": (cfg and cfg.stage3_prefetch_bucket_size) or int(0.9 * h2),
        "stage3_max_live_parameters": (cfg and cfg.stage3_max_live_parameters) or STAGE3_MAX_LIVE_PARAMETERS,
        "stage3_max_reuse_distance": STAGE3_MAX_REUSE_DISTANCE,
        "stage3_param_persistence_threshold": (cfg and cfg.stage3_param_persistence_threshold)
        or 10 * model.hidden_size,
    }


def zero_section(cfg: TrainConfig, model: ModelSpec) -> dict:
    """The zero_optimization section. overlap_comm at stage 3 is DeepSpeed's own default (true,
    runtime/zero/config.py overlap_comm_valid): it only moves the gathers and reduce-scatters to side
    streams (stage3.py reduce_and_partition_stream, parameter_offload.py allgather stream; no stream
    at all on CPU) and allocates nothing more. At stages 1-2 it is the config's choice: true adds a
    second reduce bucket (stage_1_and_2.py setup_buckets) and, at stage 1, reduces during backward."""
    b = bucket_sizes(model, cfg)
    z: dict = {"stage": cfg.zero_stage}
    if cfg.zero_stage in (1, 2):
        z.update(
            reduce_bucket_size=b["reduce_bucket_size"],
            allgather_bucket_size=b["allgather_bucket_size"],
            contiguous_gradients=True,
            overlap_comm=cfg.overlap_comm,
            reduce_scatter=True,
        )
    elif cfg.zero_stage == 3:
        z.update(
            reduce_bucket_size=b["reduce_bucket_size"],
            stage3_prefetch_bucket_size=b["stage3_prefetch_bucket_size"],
            stage3_param_persistence_threshold=b["stage3_param_persistence_threshold"],
            stage3_max_live_parameters=b["stage3_max_live_parameters"],
            stage3_max_reuse_distance=b["stage3_max_reuse_distance"],
            contiguous_gradients=True,
            overlap_comm=True,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if cfg.zero_stage == 3:  # ZeRO++ keys (runtime/zero/config.py); DeepSpeed's defaults when off
        z.update(
            zero_quantized_weights=cfg.zero_quantized_weights,
            zero_quantized_gradients=cfg.zero_quantized_gradients,
            zero_hpz_partition_size=cfg.zero_hpz_partition_size,
        )
    if cfg.offload_param != "none":
        z["offload_param"] = {"device": cfg.offload_param, "pin_memory": True}
    if cfg.offload_optimizer:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return z


def deepspeed_config(
    cfg: TrainConfig,
    model: ModelSpec,
    cluster: Cluster,
    optimizer_impl: str | None = None,
    *,
    style: str = "concrete",
    base: dict | None = None,
) -> dict:
    """The DeepSpeed JSON for `cfg` (consistent batch sizes, ZeRO, precision, optimizer). `optimizer_impl`: the
    optimizer code the trial runs (OPTIMIZER_IMPLS; a trial's TrialResult.optimizer_impl for `autotune export`), by
    default default_optimizer_impl's.

    `style` (STYLES): "concrete", every value a number, what autotune's own trials run and a plain
    `deepspeed.initialize` loop takes (DeepSpeed resolves no "auto"); "trainer", "auto" at TRAINER_AUTO, the keys
    the Hugging Face Trainer fills from its TrainingArguments (the batch sizes then reach it as
    per_device_train_batch_size and gradient_accumulation_steps: trainer_arguments()). `base`: a user's own
    DeepSpeed config, kept but for the keys autotune tuned (merge_into); the result is a new dict."""
    if style not in STYLES:
        raise ValueError(f"style {style!r}: one of {STYLES}")
    ds = _concrete(cfg, model, cluster, optimizer_impl)
    if style == "trainer":
        for path in TRAINER_AUTO:
            if _has(ds, path):
                _set(ds, path, "auto")
    return ds if base is None else merge_into(base, ds, style)


def _concrete(cfg: TrainConfig, model: ModelSpec, cluster: Cluster, optimizer_impl: str | None) -> dict:
    """deepspeed_config's concrete style, without a base."""
    impl = optimizer_impl or default_optimizer_impl(cfg, cluster)
    check_optimizer_impl(cfg, cluster, impl)
    ds: dict = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        # micro x grad accum x dp (autotune/parallel.py): with sequence_parallel_size DeepSpeed divides the world
        # by it before checking (runtime/config.py DeepSpeedConfig.__init__)
        "train_batch_size": global_batch(cfg, cluster.world_size),
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_optimization": zero_section(cfg, model),
        # no steps_per_print: DeepSpeed's default (None in 0.19.8, runtime/constants.py STEPS_PER_PRINT_DEFAULT)
        # prints no progress line, trials and users alike; a user's own value is kept (merge_into)
        "wall_clock_breakdown": False,
    }
    if cfg.autotp_size > 1:
        # AutoTP: the tp ranks of a group see one batch, so the global batch is micro x dp x grad accum
        # (autotune/parallel.py). train_batch_size is left out: DeepSpeed 0.19.8 checks it against the
        # whole world before AutoTP makes its groups (runtime/config.py _batch_assertion, no mpu yet) and
        # derives it from the other two when absent (_configure_train_batch_size).
        del ds["train_batch_size"]
        ds["tensor_parallel"] = {"autotp_size": cfg.autotp_size}
    if cfg.sequence_parallel_size > 1:
        # Ulysses (runtime/sequence_parallel/ulysses_sp.py): the key DeepSpeed's config reads to divide the world
        # (runtime/config.py DeepSpeedConfig.__init__, "HF zero.init case where there is no mpu"); the groups
        # themselves come from the mpu that register_with_transformers returns (autotune/trial/worker.py).
        # train_batch_size is left out, as for tp: DeepSpeed derives micro x grad accum x world / sp from the other
        # two (_configure_train_batch_size), and the HF Trainer refuses the key written, computing world x micro x
        # grad accum without sp ("ds train_batch_size=2 vs hf train_batch_size (calculated)=4", measured in
        # tests/test_export_sp.py; transformers/integrations/deepspeed.py trainer_config_process, fill_match)
        ds.pop("train_batch_size", None)
        ds["sequence_parallel_size"] = cfg.sequence_parallel_size
    if cfg.deepcompile:
        # compile.deepcompile (deepspeed/compile/config.py CompileConfig); the trial then calls engine.compile()
        ds["compile"] = {"deepcompile": True}
    if cfg.grad_accum_dtype != "auto":
        ds["data_types"] = {"grad_accum_dtype": cfg.grad_accum_dtype}
    if cfg.precision == "bf16":
        ds["bf16"] = {"enabled": True}
        if cfg.bf16_master_weights_and_grads:
            ds["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=cfg.bf16_optimizer_states)
    elif cfg.precision == "fp16":
        ds["fp16"] = {"enabled": True, **FP16_LOSS_SCALER}
    if cfg.optimizer == "adamw":
        params = dict(ADAMW)
        if impl in ("torch_adamw", "torch_adamw_fused"):
            # torch_adam: torch.optim.AdamW instead of FusedAdam, which DeepSpeed compiles at first use (66 s measured
            # on CPU; with nvcc only on a GPU) and which has no CPU kernel. DeepSpeed passes the params it does not
            # pop to torch's constructor (runtime/engine.py get_optimizer_configuration, _configure_basic_optimizer):
            # `fused` selects torch's fused kernel (torch/optim/adamw.py), CUDA and CPU tensors alike
            params["torch_adam"] = True
            if impl == "torch_adamw_fused":
                params["fused"] = True
        ds["optimizer"] = {"type": "AdamW", "params": params}
    else:
        # adamw8bit: bitsandbytes' AdamW8bit is passed to deepspeed.initialize as a client optimizer; DeepSpeed's
        # config has no type for it (see `autotune export`'s instructions). At ZeRO 1-3 DeepSpeed asserts that a
        # client optimizer is one it tested (runtime/engine.py _do_optimizer_sanity_check: is_zero_supported_optimizer,
        # runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS has no bitsandbytes) unless this key says otherwise.
        if cfg.zero_stage >= 1:
            ds["zero_allow_untested_optimizer"] = True
    if cfg.ckpt_layers:
        # Which layers are checkpointed is the model's code (torch.utils.checkpoint around the
        # first k blocks); DeepSpeed's section records the count and keeps its own options off.
        ds["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
            "number_checkpoints": cfg.ckpt_layers,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    return ds


STYLES = ("concrete", "trainer")
"""deepspeed_config's styles: "concrete" for autotune's trials and a plain deepspeed.initialize loop, "trainer" for the
Hugging Face Trainer (and accelerate), with "auto" where it fills the value in."""

TRAINER_FILLED = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "train_batch_size": (),  # world x per_device_train_batch_size x gradient_accumulation_steps
    "gradient_clipping": ("max_grad_norm",),
    "optimizer.params.lr": ("learning_rate",),
    "optimizer.params.betas": ("adam_beta1", "adam_beta2"),
    "optimizer.params.eps": ("adam_epsilon",),
    "optimizer.params.weight_decay": ("weight_decay",),
    "scheduler.params.warmup_min_lr": None,  # fill_only: 0, never checked
    "scheduler.params.warmup_max_lr": ("learning_rate",),
    "scheduler.params.total_num_steps": (),  # the Trainer's own count of steps (max_steps, or epochs x data)
    "scheduler.params.warmup_num_steps": ("warmup_steps",),
    "fp16.enabled": ("fp16",),
    "bf16.enabled": ("bf16",),
}
"""Every key the Hugging Face Trainer fills from its TrainingArguments where it is "auto" and, where it is not, checks
against them (a mismatch is a ValueError), with the arguments a fixed value must then be repeated in (None: never
checked): transformers 5.24 integrations/deepspeed.py HfTrainerDeepSpeedConfig trainer_config_process and
trainer_config_finalize, fill_match. The ZeRO bucket keys it also fills are tuned here (bucket_sizes) and stay numbers."""

TRAINER_AUTO = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
)
"""The keys the "trainer" style writes as "auto": those of TRAINER_FILLED that deepspeed_config writes, but precision,
which is tuned and stays a number (the Trainer checks it against bf16= / fp16=). The batch sizes are tuned too: they
reach the Trainer as its arguments (trainer_arguments). No scheduler section is written: the Trainer's own
(lr_scheduler_type, warmup_steps) runs (integrations/deepspeed.py deepspeed_optim_sched)."""

HYPERPARAMETERS = (
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
)
"""TRAINER_AUTO less the batch sizes: the training's hyperparameters, which autotune does not tune (ADAMW,
GRADIENT_CLIPPING fill them in the concrete style only)."""

PRECISION_FLAGS = ("bf16.enabled", "bfloat16.enabled", "fp16.enabled", "amp.enabled", "torch_autocast.enabled")
"""A precision section's switch (deepspeed runtime/constants.py BFLOAT16, BFLOAT16_OLD, FP16, AMP, TORCH_AUTOCAST):
merge_into sets a user's to false where the tuned config runs another precision."""

TUNED_KEYS = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    *(
        "zero_optimization." + k
        for k in (
            "stage",
            "reduce_bucket_size",
            "allgather_bucket_size",
            "contiguous_gradients",
            "overlap_comm",
            "reduce_scatter",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "zero_quantized_weights",
            "zero_quantized_gradients",
            "zero_hpz_partition_size",
            "offload_param",
            "offload_optimizer",
        )
    ),
    *PRECISION_FLAGS,
    "bf16.bf16_master_weights_and_grads",
    "bf16.bf16_optimizer_states",
    "data_types.grad_accum_dtype",
    "tensor_parallel.autotp_size",
    "sequence_parallel_size",
    "compile.deepcompile",
    "optimizer.type",
    "optimizer.params.torch_adam",
    "optimizer.params.fused",
    "zero_allow_untested_optimizer",
    "activation_checkpointing.number_checkpoints",
)
"""The keys whose values decide the memory and speed a trial measured: with a user's config as `base` each gets the
tuned config's value, or goes where the tuned config has none (an offload section the winner runs without, a
train_batch_size under tp or sp), or, for PRECISION_FLAGS, becomes false. Every other key of the user's stays as
it is; the tuned config's other keys fill in only what the user's lacks."""

MISSING = "(absent)"
"""How config_changes names a key that is not there."""


def _get(d: dict, path: str):
    for k in path.split("."):
        if not isinstance(d, dict) or k not in d:
            return MISSING
        d = d[k]
    return d


def _has(d: dict, path: str) -> bool:
    return _get(d, path) is not MISSING


def _set(d: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for k in parents:
        if not isinstance(d.get(k), dict):
            d[k] = {}
        d = d[k]
    d[last] = value


def _remove(d: dict, path: str) -> None:
    """Remove the key, and the sections left empty by it."""
    *parents, last = path.split(".")
    chain = [d]
    for k in parents:
        if not isinstance(chain[-1].get(k), dict):
            return
        chain.append(chain[-1][k])
    chain[-1].pop(last, None)
    for k, parent in zip(reversed(parents), reversed(chain[:-1])):
        if parent[k]:
            break
        del parent[k]


def leaves(d: dict, prefix: str = "") -> dict[str, object]:
    """{dotted path: value} of every non-dict value of `d` (lists are values)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        path = prefix + str(k)
        if isinstance(v, dict) and v:
            out.update(leaves(v, path + "."))
        else:
            out[path] = v
    return out


def merge_into(base: dict, tuned: dict, style: str) -> dict:
    """A user's DeepSpeed config `base` with the keys autotune tuned (TUNED_KEYS) taken from `tuned` (deepspeed_config
    of `style`), removed where `tuned` has none (precision switches: false), and `tuned`'s other keys filling in only
    what `base` lacks; `base` is not changed. The tuned config's optimizer is DeepSpeed's AdamW or, for 8-bit AdamW,
    none (a client optimizer): a user's optimizer section of another type is replaced, or removed.

    Concrete style: DeepSpeed resolves no "auto" (runtime/config.py takes values as they are), so a user's "auto"
    hyperparameter (HYPERPARAMETERS) gets autotune's value, and an "auto" left anywhere else is a SpecError."""
    import copy

    from autotune.errors import SpecError

    if not isinstance(base, dict):
        raise SpecError(f"a DeepSpeed config is a JSON object, not {type(base).__name__}")
    out = copy.deepcopy(base)
    if "optimizer" not in tuned:
        out.pop("optimizer", None)
    elif isinstance(out.get("optimizer"), dict) and _get(out, "optimizer.type") != tuned["optimizer"]["type"]:
        # another optimizer's params (Lion's, SGD's) may not be AdamW's: the user's lr, betas, eps, weight decay stay
        params = _get(out, "optimizer.params")
        keep = (
            {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}
            if isinstance(params, dict)
            else {}
        )
        out["optimizer"] = {"type": tuned["optimizer"]["type"], "params": keep}
    for path in TUNED_KEYS:
        if path == "optimizer.type" and str(_get(out, path)).lower() == str(_get(tuned, path)).lower():
            continue  # DeepSpeed lower-cases its own types (runtime/config.py DeepSpeedConfig._initialize_params)
        if _has(tuned, path):
            _set(out, path, copy.deepcopy(_get(tuned, path)))
        elif path in PRECISION_FLAGS and _has(out, path):
            _set(out, path, False)
        else:
            _remove(out, path)
    for path, value in leaves(tuned).items():
        if not _has(out, path):
            _set(out, path, copy.deepcopy(value))
    if style == "concrete":
        for path in HYPERPARAMETERS:
            if _get(out, path) == "auto":
                _set(out, path, copy.deepcopy(_get(tuned, path)))
        left = [p for p, v in leaves(out).items() if v == "auto"]
        if left:
            raise SpecError(
                'DeepSpeed resolves no "auto", and autotune has no value for ' + ", ".join(left) + " of your "
                'config: give numbers there, or use it with the Hugging Face Trainer (the "trainer" style), '
                "which fills them in"
            )
    return out


def config_changes(before: dict, after: dict) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every value that differs between two configs, MISSING for an absent one;
    in the order of `after`'s keys, then the removed ones."""
    a, b = leaves(before), leaves(after)
    changed = [(p, a.get(p, MISSING), v) for p, v in b.items() if a.get(p, MISSING) != v]
    return changed + [(p, v, MISSING) for p, v in a.items() if p not in b]


def trainer_arguments(cfg: TrainConfig, model: ModelSpec) -> dict:
    """The Hugging Face TrainingArguments autotune tuned, to go with the "trainer" style's JSON, whose batch sizes are
    "auto" (filled from per_device_train_batch_size and gradient_accumulation_steps: HfTrainerDeepSpeedConfig
    trainer_config_process) and whose precision is checked against bf16= / fp16=. Nothing else: the learning rate,
    weight decay, warmup, scheduler and clipping are the user's. gradient_checkpointing covers every layer; a
    partial k (0 < k < layers) is set on the model instead (`autotune export` prints how)."""
    args: dict = {
        "per_device_train_batch_size": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_checkpointing": cfg.ckpt_layers >= model.num_layers,
    }
    if cfg.precision in ("bf16", "fp16"):
        args[cfg.precision] = True
    return args
