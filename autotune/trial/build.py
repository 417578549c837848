"""Building a trial's model on one rank: through the seam of autotune/impl/, initialised, with its
checkpointing set, without the full fp32 model ever on the rank (autotune/trial/worker.py calls it)."""

from __future__ import annotations


def build_model(req, device, ds_cfg: dict):
    """The trial's model through the seam (autotune/impl/), initialised, checkpointing set,
    without the full fp32 model ever on this rank.

    hf: AutoModelForCausalLM.from_config initialises with the model's own _init_weights. ZeRO-3
    the Trainer's way: a live HfDeepSpeedConfig makes from_config build under deepspeed.zero.Init
    and initialise each module gathered on rank 0 (transformers' initialize_weights_zero3); ZeRO 0-2
    build on the rank's device in the training dtype. torch.manual_seed(0) first, so every rank and
    every stage draws from the same stream (DeepSpeed broadcasts rank 0's weights at 0-2 anyway).
    factory: the same, under deepspeed.zero.Init for ZeRO-3; its constructor initialises.
    builtin: built under deepspeed.zero.Init (ZeRO-3) or on the meta device, cast to the training
    dtype there (free), materialised once with to_empty, then builtin.init_weights per
    top-level child (under GatheredParameters at ZeRO-3) with the same seeds, so every stage starts
    from the same weights.
    """
    import deepspeed
    import torch

    from autotune.impl import impl_for
    from autotune.train_config import torch_dtype

    cfg = req.config
    impl = impl_for(req.model, cfg)  # with the config's LoRA adapters, if any (autotune/impl/lora.py)
    dtype = torch_dtype(cfg.precision)
    make = lambda: impl.build(req.model, dtype=dtype, attention=cfg.attention)  # noqa: E731
    if impl.name == "builtin":
        model = _build_builtin(make, cfg, device, ds_cfg, dtype)
    else:
        torch.manual_seed(0)
        if cfg.zero_stage == 3 and impl.name == "hf":
            from transformers.integrations import HfDeepSpeedConfig
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            keep = HfDeepSpeedConfig(ds_cfg)  # noqa: F841 - transformers holds only a weak reference
            try:
                model = make()
            finally:
                unset_hf_deepspeed_config()  # the next config on this rank may be another stage
        elif cfg.zero_stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
                model = make()
        else:
            with torch.device(device):
                model = make()
    impl.checkpoint_first(model, cfg.ckpt_layers)
    return model


def _build_builtin(make, cfg, device, ds_cfg: dict, dtype):
    import contextlib

    import deepspeed
    import torch

    from autotune.impl.builtin import init_weights

    if cfg.zero_stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
            model = make()
        gather = lambda m: deepspeed.zero.GatheredParameters(list(m.parameters()), modifier_rank=0)  # noqa: E731
    else:
        with torch.device("meta"):
            model = make()
        model = model.to(dtype).to_empty(device=device)
        gather = lambda m: contextlib.nullcontext()  # noqa: E731
    children = [c for name, c in model.named_children() if name != "blocks"]
    for seed, child in enumerate([*children, *model.blocks]):
        with gather(child):
            init_weights(child, seed=seed)
    return model
