"""One training step of a model on real CPU tensors, measured as a trial measures it: what the traced
memory tiers (tests/test_traced.py, tests/test_memory_hf.py) are checked against."""

from __future__ import annotations

import gc

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from autotune.impl import default_dtype, impl_for
from autotune.trial.memprof import CpuCurve, enable_cpu_memory_reporting

enable_cpu_memory_reporting()  # before any tensor the profiler must count (memprof docstring)


def live_bytes_now() -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(1)
    return CpuCurve.from_profiler(prof).live_bytes[-1]


def measure_cpu(s, cfg) -> dict[str, int]:
    """The traced program on real CPU tensors (the model through the seam: impl.build, impl.loss;
    AdamW foreach=False; one process), measured as a trial is (memprof.CpuCurve): the second step's
    phase peaks and the bytes alive after its forward, relative to the live bytes before the model
    is built. LoRA (`cfg.method`): peft's adapters through the seam, only they stepped."""
    impl = impl_for(s, cfg if cfg.method != "full" else None)
    dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16
    gc.collect()
    gc.disable()  # a collection inside the window would free unrelated tensors and lower the count
    try:
        base = live_bytes_now()
        torch.manual_seed(0)
        with default_dtype(dtype):
            model = impl.build(s, dtype=dtype, attention=cfg.attention)
        impl.checkpoint_first(model, cfg.ckpt_layers)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
        batch = torch.randint(0, s.vocab_size, (cfg.micro_batch, cfg.seq_len + 1))
        impl.loss(model, batch).backward()  # the first step makes the optimizer states
        opt.step()
        opt.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("autotune.step1"):
                with record_function("autotune.forward"):
                    loss = impl.loss(model, batch)
                with record_function("autotune.backward"):
                    loss.backward()
                with record_function("autotune.optimizer"):
                    opt.step()
    finally:
        gc.enable()
    curve = CpuCurve.from_profiler(prof)
    shift = curve.baseline_bytes - base
    out = {phase: peak + shift for phase, peak in curve.phase_peaks("autotune.step1").items()}
    return {**out, "after_forward": curve.live_at(curve.span("autotune.forward")[1]) - base}
