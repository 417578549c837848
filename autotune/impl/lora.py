"""LoRA and QLoRA through the model seam: `LoraImpl` builds the base through its own ModelImpl, then
wraps it with peft (`get_peft_model`), so trials, the CPU prior and the traced memory model run the same
adapted module.

- Targets: `attention` is every linear projection of each layer's attention block (q, k, v, o, fused or
  not), named relative to the layer, since peft matches a name suffix and GPT-2's MLP has a c_proj too;
  `all-linear` is peft's own (every linear layer but the output layer).
- Dtype: peft's default, as users run it: `get_peft_model` upcasts 16-bit adapters to fp32
  (autocast_adapter_dtype=True, tuners_utils.py cast_adapter_dtype). `deepspeed.initialize` casts every parameter to
  the training dtype again, except a zero.Init model's (engine.py _cast_module_mixed_precision: "ZeRO-Init params are
  already at the configured dtype"), which every ZeRO-3 build is: there the adapters train in fp32, and peft casts
  each adapted layer's input to fp32 (lora/layer.py `_cast_input_dtype`). `adapters_stay_fp32` says where; a build
  on fake tensors, which DeepSpeed never casts, makes them in the dtype they train in (`LoraImpl.as_trained`).
- Checkpointing: the base's `checkpoint_first`, then `enable_input_require_grads()` (else a checkpointed
  bottom layer below the frozen embedding has no graph).
- QLoRA's 4-bit NF4 base needs bitsandbytes on a GPU: priced analytically (autotune/memory/lora.py) on
  the 16-bit LoRA trace, whose activations are the same but for the dequantised weight; a build is refused.
"""

from __future__ import annotations

import contextlib

from autotune.errors import SpecError
from autotune.models import ModelSpec

LINEAR_TYPES = ("Linear", "Conv1D")
"""Module class names peft's LoRA wraps as linear layers (torch nn.Linear, transformers' Conv1D)."""


def adapters_stay_fp32(cfg) -> bool:
    """Whether LoRA's adapters train in fp32 under DeepSpeed (the module docstring): peft's fp32 adapters of a 16-bit
    base, at ZeRO-3, whose zero.Init model deepspeed.initialize does not cast. QLoRA's base is not built under
    zero.Init here (bitsandbytes' 4-bit layers; estimated, not run): its adapters are priced in the training dtype."""
    return cfg.method == "lora" and cfg.zero_stage == 3 and cfg.precision in ("bf16", "fp16")


def _linear(module) -> bool:
    return type(module).__name__ in LINEAR_TYPES


def attention_targets(layers) -> list[str]:
    """Names (relative to a decoder layer) of the linear layers inside the attention blocks of the
    decoder `layers`: in each layer the child module whose name says attn/attention, every linear
    layer under it; over all of them, as a hybrid stack has attention in some layers only (Jamba's
    Mamba layers have none, and its first layer is one of them)."""
    found: list[str] = []
    for layer in layers:
        for name, child in layer.named_children():
            if "attn" in name.lower() or "attention" in name.lower():
                names = [f"{name}.{n}" for n, m in child.named_modules() if n and _linear(m)]
                if names:
                    found += [n for n in names if n not in found]
                    break
    if not found:
        raise SpecError(
            f"{type(layers[0]).__name__}: no attention block with linear layers found (a child named "
            f"*attn* or *attention*); use --lora-targets all-linear"
        )
    return found


def target_modules(cfg, layers) -> list[str] | str:
    """peft's target_modules for `cfg.lora_targets` on the code of these decoder layers."""
    return "all-linear" if cfg.lora_targets == "all-linear" else attention_targets(layers)


def lora_config_dict(cfg, targets) -> dict:
    """The LoraConfig keyword arguments of `cfg` (what `autotune export` writes as JSON)."""
    return {
        "r": cfg.lora_rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": targets,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }


@contextlib.contextmanager
def _fake_moves():
    """peft moves each new adapter to its base layer's device and dtype (`module.to(...)`); a fake
    parameter cannot be moved in place (torch swaps fakes' tensors, which a weak reference
    forbids: '_apply(): Couldn't swap Linear.weight'). The adapters are already made on the CPU in
    the training dtype (the default dtype while the model is built), so those moves are no-ops:
    skip them when nothing would change. A change of dtype (peft's adapter of a parameter kept in
    fp32, DeepSeek's router weight) replaces the new adapter's tensors, which nothing refers to yet."""
    import torch

    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if all(
            (device is None or t.device == device) and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
            for t in tensors
        ):
            return self
        if device is not None and any(t.device != device for t in tensors):
            return original(self, *args, **kwargs)
        for module in self.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_floating_point():
                    module._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), p.requires_grad)
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point():
                    module._buffers[name] = b.to(dtype)
        return self

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


class LoraImpl:
    """The base ModelImpl with peft adapters (`cfg.method` lora or qlora). `name` is the base's, so
    callers build it as they build the base (hf under ZeRO-3: a live HfDeepSpeedConfig)."""

    def __init__(self, base, cfg, as_trained: bool = False) -> None:
        """`as_trained`: make the adapters in the dtype DeepSpeed trains them in (`adapters_stay_fp32`), for a
        module no deepspeed.initialize will cast (the memory model's fake-tensor trace); else peft's default, as
        users run it (the trial), which initialize then casts where it does."""
        # peft's import makes module-level tensors (peft.tuners.loha's `scale=torch.tensor(1)` defaults): made
        # here, before a trace builds the model, a trace never counts them (16 B in a process's first program)
        import peft  # noqa: F401

        self.base, self.cfg, self.name = base, cfg, base.name
        self.autocast_adapter_dtype = adapters_stay_fp32(cfg) if as_trained else True

    def build(self, spec: ModelSpec, *, dtype, attention: str, num_layers: int | None = None):
        """The base's `build`, then `get_peft_model`: only the adapters require grad."""
        from peft import LoraConfig, get_peft_model
        from torch._subclasses.fake_tensor import FakeTensor

        model = self.base.build(spec, dtype=dtype, attention=attention, num_layers=num_layers)
        probe = next(model.parameters())
        if self.cfg.method == "qlora" and not (isinstance(probe, FakeTensor) or probe.device.type == "meta"):
            raise SpecError(
                "method qlora loads the frozen base in 4-bit NF4 through bitsandbytes (CUDA only); "
                "this build runs 16-bit LoRA code only: QLoRA is estimated and simulated"
            )
        config = LoraConfig(**lora_config_dict(self.cfg, target_modules(self.cfg, self.base.layers(model))))
        moves = _fake_moves() if isinstance(probe, FakeTensor) else contextlib.nullcontext()
        with moves:
            model = get_peft_model(model, config, autocast_adapter_dtype=self.autocast_adapter_dtype)
        return model.train()

    def layers(self, model):
        return self.base.layers(model)

    def loss(self, model, tokens):
        return self.base.loss(model, tokens)

    def checkpoint_first(self, model, k: int) -> None:
        """The base's checkpointing; with k > 0 the frozen embedding's output also requires grad."""
        self.base.checkpoint_first(model.get_base_model(), k)
        if k:
            model.enable_input_require_grads()
