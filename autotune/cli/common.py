"""Arguments several sub-commands share, and how they become specs."""

from __future__ import annotations

import argparse

from autotune.hardware import Cluster, parse_gpus
from autotune.models import ModelSpec, resolve_model
from autotune.space import TrainConfig, check_config


def add_model_gpus(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="preset name or alias (`autotune models`), a Hugging Face config.json, a directory "
                        "holding one, or a hub id already in the local Hugging Face cache (docs/models.md)")
    add_impl(p)
    p.add_argument("--gpus", required=True,
                   help="[NODESx]COUNTxTYPE[@MEM], e.g. 4xA100, 16xH100, 2xcpu (`autotune gpus`)")


def add_impl(p: argparse.ArgumentParser) -> None:
    """--impl and --model-factory: whose code trials run and the memory model prices."""
    p.add_argument("--impl", default="hf", choices=["hf", "builtin", "factory"],
                   help="model code: hf (transformers, default), builtin (autotune's stand-in), "
                        "factory (--model-factory)")
    p.add_argument("--model-factory", default=None, metavar="PKG.MODULE:FUNCTION",
                   help="your own torch module: function(spec, attention=...) -> nn.Module (docs/models.md)")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    return resolve_model(args.model, implementation=getattr(args, "impl", "hf"),
                         factory=getattr(args, "model_factory", None))


def add_train_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward")
    p.add_argument("--grad-accum", type=int, default=1, help="micro batches per optimizer step")
    p.add_argument("--ckpt-layers", type=int, default=0, help="activation-checkpointed layers (first k)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit"])
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload of optimizer states")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(2048, model max))")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"],
                   help="attention implementation, transformers' names (flash_attention_2: GPU, hf only)")


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, Cluster, TrainConfig]:
    model = model_from_args(args)
    cluster = parse_gpus(args.gpus)
    seq = args.seq_len or min(2048, model.max_seq_len)
    cfg = TrainConfig(zero_stage=args.zero, ckpt_layers=args.ckpt_layers, micro_batch=args.micro_batch,
                      grad_accum=args.grad_accum, precision=args.precision, optimizer=args.optimizer,
                      offload_optimizer=args.offload_optimizer, seq_len=seq, attention=args.attention)
    check_config(cfg, model, cluster)
    return model, cluster, cfg
