"""Tensor parallelism (DeepSpeed AutoTP training) against a model and a cluster: what runs, what DeepSpeed
refuses, and the data-parallel degree ZeRO shards over. train_config.check_config calls `check_parallel`.

Every refusal below was found by running deepspeed 0.19.8 on 2 CPU ranks (gloo); docs/parallelism.md
has the runs. This module imports no other of autotune's but errors, so train_config can import it.
"""

from __future__ import annotations

from autotune.errors import SpecError

AUTOTP_UNSUPPORTED = ("deberta", "flaubert", "fsmt", "gpt2", "led", "longformer", "xlm", "xlnet")
"""Model classes AutoTP refuses: deepspeed/module_inject/auto_tp.py AutoTP.supported's `unsupported`
list (its tp_parser asserts "AutoTP not supported for model. Please use kernel injection since
container policy for model exists."; measured on GPT-2 at ZeRO 0-3, tp 2, 2 CPU ranks)."""


def data_parallel_size(cfg, world_size: int) -> int:
    """Ranks ZeRO shards over and that see different batches: world / tp. The tp ranks of one group
    see one batch (DeepSpeed checks it: engine.py _configure_tensor_parallel_states,
    check_dataloader_inputs_same_across_ranks), so the global batch is micro x dp x grad accum."""
    return world_size // cfg.autotp_size


def global_batch(cfg, world_size: int) -> int:
    """Sequences per optimizer step: micro batch x dp x grad accum."""
    return cfg.micro_batch * data_parallel_size(cfg, world_size) * cfg.grad_accum


def check_parallel(cfg, model, cluster) -> None:
    """Raise SpecError unless `cfg`'s tensor parallelism (and DeepCompile) can run `model` on `cluster`."""
    if cfg.deepcompile and cluster.gpu.is_cpu:
        raise SpecError("deepcompile runs on CUDA only (deepspeed/compile/util.py is_deepcompile_supported: torch >= 2.6 "
                        "and a cuda accelerator); CPU ranks cannot run it (it is still estimated and simulated for GPUs, "
                        "as without it)")
    tp = cfg.autotp_size
    if tp == 1:
        return
    world = cluster.world_size
    if world % tp:
        raise SpecError(f"autotp_size {tp} must divide the world size {world} (dp = world / tp = {world / tp:g} "
                        "is not whole)")
    if model.implementation != "hf":
        raise SpecError(f"autotp_size {tp}: AutoTP shards a Hugging Face model by its tp_plan (DeepSpeed "
                        f"engine._apply_autotp_partitioning); the {model.implementation} code has none (use --impl hf)")
    _check_heads(tp, model)
    model_type = (model.hf_config or {}).get("model_type") or model.family
    if model_type in AUTOTP_UNSUPPORTED:
        raise SpecError(f"autotp_size {tp}: DeepSpeed's AutoTP refuses {model_type} models ('AutoTP not supported "
                        "for model. Please use kernel injection since container policy for model exists.', "
                        "module_inject/auto_tp.py AutoTP.supported); use autotp_size 1")
    if cfg.method != "full":
        # measured: peft LoRA on q/k/v/o of the Llama of benchmarks/hf_memory.py, ZeRO-0 bf16, tp 2
        raise SpecError(f"method {cfg.method} with autotp_size {tp}: DeepSpeed 0.19.8's AutoTP replaces peft's "
                        "adapted nn.Linear wrappers with its own sharded layers and drops lora_A/lora_B, so nothing "
                        "trains and engine.backward fails ('loss must be a scalar tensor'); use autotp_size 1")
    if cfg.offload_param != "none" or cfg.offload_optimizer:
        raise SpecError(f"autotp_size {tp} with ZeRO offload is not measured here (autotune prices AutoTP on "
                        "the device only); use autotp_size 1 to offload")


def _check_heads(tp: int, model) -> None:
    """tp must split the query heads and the key/value heads evenly."""
    if model.num_heads % tp:
        raise SpecError(f"autotp_size {tp} must divide the {model.num_heads} attention heads (the column-sharded "
                        "q projection splits whole heads)")
    if tp > model.num_kv_heads or model.num_kv_heads % tp:
        # engine._apply_autotp_partitioning: ranks past the KV head count get no attention shard ("attention
        # throughput will not scale past that point"), so the ranks' memory differs.
        raise SpecError(f"autotp_size {tp} must divide the {model.num_kv_heads} key/value heads: past them "
                        "DeepSpeed gives the extra ranks no attention shard (their attention work and memory "
                        "differ from the others', and attention does not scale); choose a divisor of "
                        f"{model.num_kv_heads}")
