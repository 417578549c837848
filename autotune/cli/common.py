"""Arguments several sub-commands share, and how they become specs. The training-config flags are
derived from TrainConfig's fields (autotune/train_config.py): a new setting gets its flag there."""

from __future__ import annotations

import argparse
import dataclasses

from autotune.hardware import Cluster
from autotune.models import ModelSpec, resolve_model
from autotune.train_config import TrainConfig, choices, kind


def add_model_gpus(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="preset name or alias (`autotune models`), a Hugging Face config.json, a directory "
        "holding one, or a hub id already in the local Hugging Face cache (docs/models.md)",
    )
    add_impl(p)
    p.add_argument(
        "--gpus", required=True, help="[NODESx]COUNTxTYPE[@MEM], e.g. 4xA100, 16xH100, 2xcpu (`autotune gpus`)"
    )


def add_impl(p: argparse.ArgumentParser) -> None:
    """--impl and --model-factory: whose code trials run and the memory model prices."""
    p.add_argument(
        "--impl",
        default=None,
        choices=["hf", "builtin", "factory"],
        help="model code: hf (transformers, default), builtin (autotune's stand-in), factory (--model-factory)",
    )
    p.add_argument(
        "--model-factory",
        default=None,
        metavar="PKG.MODULE:FUNCTION",
        help="your own torch module: function(spec, attention=...) -> nn.Module (docs/models.md)",
    )


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    return resolve_model(
        args.model, implementation=getattr(args, "impl", None) or "hf", factory=getattr(args, "model_factory", None)
    )


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_train_config(p: argparse.ArgumentParser) -> None:
    """One option per TrainConfig field, typed by the field (values are checked by TrainConfig itself)."""
    for f in dataclasses.fields(TrainConfig):
        help = f.metadata["help"]
        if kind(f.name) is bool:
            p.add_argument(_flag(f), dest=f.name, action="store_true", help=help)
            continue
        # seq_len: the model's own maximum, up to 2048; attention: what transformers picks for the class
        default = None if f.name in ("seq_len", "attention") else f.default
        c = choices(f.name)
        p.add_argument(
            _flag(f),
            dest=f.name,
            type=kind(f.name),
            default=default,
            choices=list(c) if c else None,
            help=help + ("" if default is None else f" (default {default})"),
        )


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, Cluster, TrainConfig]:
    """--model, --impl, --model-factory, --gpus and the training-config flags as specs (autotune.estimate.resolve)."""
    from autotune.estimate import resolve

    config = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    return resolve(
        args.model,
        args.gpus,
        impl=getattr(args, "impl", None),
        model_factory=getattr(args, "model_factory", None),
        **config,
    )
