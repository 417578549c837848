"""The one seam for model code: what a trial trains, the CPU prior times and the memory model traces.

A `ModelImpl` is named by `ModelSpec.implementation` (torchtitan's TrainSpec idea: a small protocol,
registered by name):

- `hf`      autotune/impl/hf.py: the Hugging Face transformers model of the spec's config (the default);
- `builtin` autotune/impl/builtin.py: autotune's own stand-in transformer;
- `factory` the user's module from `ModelSpec.factory` ("package.module:function"; docs/models.md).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from autotune.errors import SpecError
from autotune.models import ModelSpec

if TYPE_CHECKING:
    import torch
    from torch import nn


class ModelImpl(Protocol):
    name: str

    def build(self, spec: ModelSpec, *, dtype: torch.dtype, attention: str, num_layers: int | None = None) -> nn.Module:
        """The model of `spec` (with `num_layers` decoder layers instead of spec.num_layers if
        given), parameters in `dtype`, allocated on the CURRENT default device / mode: the caller
        wraps the call in torch.device("meta"), FakeTensorMode or deepspeed.zero.Init (for `hf`
        under ZeRO-3: a live transformers HfDeepSpeedConfig, as the Trainer does). No weight init
        beyond what the constructor does (`hf`: the model's own _init_weights; `builtin`:
        nn.Linear's default, the worker then runs builtin.init_weights). Returned in train
        mode: dropout as the config says. `attention`: transformers' names, sdpa | eager |
        flash_attention_2 (`hf` only)."""
        ...

    def layers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers, in order."""
        ...

    def loss(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, s+1) int64 -> scalar next-token loss. `model` is the module or anything that
        calls it (a DeepSpeed engine). builtin and factory predict tokens[:, 1:] from
        tokens[:, :-1]; hf runs the Trainer's call, input_ids = labels = tokens[:, :-1] (the model
        shifts the labels itself: s-1 predictions), so all three run s tokens per sequence."""
        ...

    def checkpoint_first(self, model: nn.Module, k: int) -> None:
        """Recompute the first k decoder layers in backward (0: none), in place."""
        ...


@contextlib.contextmanager
def default_dtype(dtype):
    """Parameters created inside are `dtype` (as transformers' from_config(dtype=...) does)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _next_token_loss(logits, tokens):
    """Cross entropy of logits (b, s, V) against tokens[:, 1:], logits upcast to fp32 as
    transformers' ForCausalLMLoss does."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class BuiltinImpl:
    """`builtin`: autotune.impl.builtin.Transformer, the stand-in that computes its own loss."""

    name = "builtin"

    def build(self, spec, *, dtype, attention, num_layers=None):
        from autotune.impl.builtin import Transformer

        if attention not in ("sdpa", "eager"):
            raise SpecError(f"the builtin model has attention sdpa or eager, not {attention!r}")
        if num_layers is not None:
            spec = replace(spec, num_layers=num_layers)
        with default_dtype(dtype):
            return Transformer(spec, attention=attention).train()

    def layers(self, model):
        return list(model.blocks)

    def loss(self, model, tokens):
        return model(tokens[:, :-1], tokens[:, 1:])

    def checkpoint_first(self, model, k):
        _check_k(k, len(model.blocks))
        model.ckpt_layers = k


def _check_k(k, n: int) -> None:
    if not isinstance(k, int) or not 0 <= k <= n:
        raise SpecError(f"checkpointed layers must be 0..{n}, got {k!r}")


def load_factory(text: str):
    """The function `package.module:function` names; SpecError saying what is wrong."""
    mod, _, fn = text.partition(":")
    if not mod or not fn:
        raise SpecError(f"--model-factory must be package.module:function, got {text!r}")
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise SpecError(
            f"--model-factory {text}: cannot import {mod!r} ({e}); it must be importable "
            f"from the current directory or PYTHONPATH"
        ) from None
    f = getattr(module, fn, None)
    if not callable(f):
        raise SpecError(f"--model-factory {text}: {mod} has no function {fn!r}")
    return f


class FactoryImpl:
    """`factory`: the user's module (contract in docs/models.md)."""

    name = "factory"

    def build(self, spec, *, dtype, attention, num_layers=None):
        if num_layers is not None:
            spec = replace(spec, num_layers=num_layers)
        with default_dtype(dtype):
            model = load_factory(spec.factory)(spec, attention=attention)
        from torch import nn

        if not isinstance(model, nn.Module):
            raise SpecError(f"--model-factory {spec.factory} returned {type(model).__name__}, not a torch.nn.Module")
        return model.train()

    def layers(self, model):
        from torch import nn

        if callable(getattr(model, "decoder_layers", None)):
            return list(model.decoder_layers())
        for path in ("layers", "model.layers", "transformer.h", "blocks"):
            obj = model
            for part in path.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, nn.ModuleList):
                return list(obj)
        raise SpecError(
            f"{type(model).__name__}: no decoder layers found; give it a decoder_layers() "
            f"method or an nn.ModuleList at .layers, .model.layers, .transformer.h or .blocks"
        )

    def loss(self, model, tokens):
        out = model(tokens[:, :-1])
        return _next_token_loss(getattr(out, "logits", out), tokens)

    def checkpoint_first(self, model, k):
        layers = self.layers(model)
        _check_k(k, len(layers))
        for i, layer in enumerate(layers):
            _set_checkpointed(layer, i < k)


def _set_checkpointed(layer, on: bool) -> None:
    """Run `layer`'s forward under non-reentrant torch.utils.checkpoint (an instance-level forward:
    the layer's own hooks run once, around the checkpointed call; its submodules' hooks, such as
    ZeRO-3's parameter fetch, run again on the recompute, since the forward calls them)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    if "forward" in vars(layer):
        del layer.forward
    if on:
        plain = layer.forward
        layer.forward = functools.partial(checkpoint, plain, use_reentrant=False)


IMPLS: dict[str, str] = {
    "hf": "autotune.impl.hf:HfImpl",
    "builtin": "autotune.impl:BuiltinImpl",
    "factory": "autotune.impl:FactoryImpl",
}
"""Name -> "module:class"; imported on use, so transformers loads only when the hf code is asked for."""


def impl_for(spec: ModelSpec, cfg=None, as_trained: bool = False) -> ModelImpl:
    """The ModelImpl that `spec.implementation` names; with a TrainConfig `cfg` whose method is lora
    or qlora, that ModelImpl wrapped with peft's adapters (autotune/impl/lora.py `LoraImpl`; `as_trained`:
    its adapters in the dtype DeepSpeed trains them in, for a build no deepspeed.initialize casts)."""
    if spec.implementation not in IMPLS:
        raise SpecError(f"model {spec.name}: unknown implementation {spec.implementation!r}; known: {', '.join(IMPLS)}")
    mod, _, cls = IMPLS[spec.implementation].partition(":")
    impl = getattr(importlib.import_module(mod), cls)()
    if cfg is not None and cfg.method != "full":
        from autotune.impl.lora import LoraImpl

        impl = LoraImpl(impl, cfg, as_trained=as_trained)
    return impl
