"""Building a trial's model on one rank: through the seam of autotune/impl/, initialised, with its
checkpointing set, without the full fp32 model ever on the rank (autotune/trial/worker.py calls it)."""

from __future__ import annotations


def build_model(req, device, ds_cfg: dict):
    """The trial's model through the seam (autotune/impl/), initialised, checkpointing set, never a full fp32
    copy on this rank. Every rank and stage starts from the same weights (hf, factory: torch.manual_seed(0);
    builtin: one seed per top-level child).

    hf at ZeRO-3 the Trainer's way: a live HfDeepSpeedConfig makes from_config build under zero.Init and
    initialise each module gathered on rank 0 (transformers' initialize_weights_zero3); factory under
    zero.Init; ZeRO 0-2 on the rank's device in the training dtype. builtin: zero.Init or the meta device
    (cast there, free), then to_empty and builtin.init_weights per top-level child (gathered at ZeRO-3).
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
