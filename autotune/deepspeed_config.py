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


def deepspeed_config(cfg: TrainConfig, model: ModelSpec, cluster: Cluster, optimizer_impl: str | None = None) -> dict:
    """The DeepSpeed JSON for `cfg` (consistent batch sizes, ZeRO, precision, optimizer). `optimizer_impl`: the
    optimizer code the trial runs (OPTIMIZER_IMPLS; a trial's TrialResult.optimizer_impl for `autotune export`), by
    default default_optimizer_impl's."""
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
        "steps_per_print": 10**9,
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
