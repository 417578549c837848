"""The user's own training script as the trial (`autotune search --script train.py`, docs/trials.md "Your own
script"): what the script gets, and what its ranks' reports make of a TrialResult. The ranks themselves run in
autotune/trial/script_rank.py.

    script_spec(...)        -> ScriptSpec, checked (SpecError, exit 2, for a missing file or a bad template)
    script_config(req)      -> the DeepSpeed JSON the script gets: THE one call of deepspeed_config() for it
    script_argv(req, json)  -> the script's sys.argv
    finish(req, res, ranks) -> the TrialResult read from the engine (samples per step, tokens, the per-rank cap)

The stop: DeepSpeed's own `autotuning` section (deepspeed/autotuning/config.py; runtime/engine.py step() calls
`_autotuning_exit` once `global_steps == end_profile_step + 1`, where rank 0 writes its metric to `metric_path` and
every rank calls exit()), so any DeepSpeed script, the Trainer's included, stops after the warm-up and measured steps.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shlex
import statistics
from pathlib import Path

from autotune.deepspeed_config import deepspeed_config
from autotune.errors import SpecError
from autotune.parallel import data_parallel_size
from autotune.trial.record import RankReport, ScriptSpec, TrialRequest, TrialResult
from autotune.units import TFLOPS

METRIC_FILE = "autotuning_metric.json"
"""Where DeepSpeed's `_autotuning_exit` writes its metric (rank 0), in the trial's folder."""


def script_spec(
    path: str | Path,
    args: str | list[str] | tuple[str, ...] = (),
    *,
    config: str | Path | None = None,
    config_flag: str = "--deepspeed",
    trainer_args: bool | None = None,
    cwd: str | Path | None = None,
) -> ScriptSpec:
    """`--script`, `--script-args` (one string, split as a shell would), `--script-config`, `--script-config-flag`
    and `--script-trainer-args` as a ScriptSpec; paths resolved against `cwd` (default: here). `trainer_args` None:
    on for the Trainer-style JSON, off with a template of the user's own (a plain deepspeed.initialize script)."""
    cwd = Path(cwd or os.getcwd()).resolve()
    script = (cwd / path).resolve()
    if not script.is_file():
        raise SpecError(f"--script {path}: no such file")
    if isinstance(args, str):
        try:
            args = shlex.split(args)
        except ValueError as e:
            raise SpecError(f"--script-args {args!r}: {e}") from None
    if not config_flag.startswith("-"):  # `--script-config-flag deepspeed_config` (argparse takes no `--x` value)
        config_flag = "--" + config_flag
    if not config_flag.strip("-") or any(c.isspace() or c == "=" for c in config_flag):
        raise SpecError(f"--script-config-flag {config_flag!r}: expected an option name such as deepspeed_config")
    template, template_path = None, ""
    if config is not None:
        p = (cwd / config).resolve()
        try:
            template = json.loads(p.read_text())
        except OSError as e:
            raise SpecError(f"--script-config {config}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise SpecError(f"--script-config {config}: not JSON ({e})") from None
        if not isinstance(template, dict):
            raise SpecError(f"--script-config {config}: expected a JSON object (a DeepSpeed config)")
        template_path = str(p)
    return ScriptSpec(
        path=str(script),
        args=tuple(args),
        config_flag=config_flag,
        template=template,
        template_path=template_path,
        trainer_args=template is None if trainer_args is None else trainer_args,
        cwd=str(cwd),
    )


def script_config(req: TrialRequest) -> dict:
    """The DeepSpeed JSON a script trial gets: the candidate's (deepspeed_config, the function every trial and
    `autotune export` use), in the Trainer's style ("auto" where the Trainer fills the value) or, given the user's
    template, its concrete values merged into it (only the tuned keys changed, as `export --into` does), plus the
    stop hook. The one call of deepspeed_config() for scripts."""
    s = req.script
    if s.as_given:  # autotune export --verify: the exported file as it is
        ds = copy.deepcopy(s.template)
    else:
        style = "trainer" if s.template is None else "concrete"
        ds = deepspeed_config(req.config, req.model, req.cluster, req.optimizer_impl, style=style, base=s.template)
    ds["autotuning"] = stop_section(req)
    return ds


def stop_section(req: TrialRequest) -> dict:
    """DeepSpeed's `autotuning` section that ends the script after warmup_steps + steps optimizer steps: the engine
    exits once global_steps == end_profile_step + 1 (runtime/engine.py step), so end_profile_step is the last
    step's index. start_profile_step is the step whose forward DeepSpeed's flops profiler wraps on rank 0 (its
    functional patches slow that step): the last warm-up step, so no measured step carries it. The section also
    turns the engine's global timers on (runtime/engine.py EngineTimers: enable_global_timers=wall_clock_breakdown or
    flops_profiler_enabled, which autotuning sets), logged on rank 0 at each step (docs/trials.md)."""
    last = req.warmup_steps + req.steps - 1
    return {
        "enabled": True,
        "start_profile_step": max(0, req.warmup_steps - 1),
        "end_profile_step": last,
        "metric_path": str(Path(req.out_dir, METRIC_FILE).resolve()),
    }


def script_argv(req: TrialRequest, json_path: Path) -> list[str]:
    """sys.argv of the script: its path, its own arguments, then the JSON's (and with trainer_args the Trainer's
    arguments for the candidate's batch and precision, as DeepSpeed's autotuner's arg_mappings pass them)."""
    s, cfg = req.script, req.config
    argv = [s.path, *s.args, s.config_flag, str(json_path)]
    if s.trainer_args:
        argv += ["--per_device_train_batch_size", str(cfg.micro_batch), "--gradient_accumulation_steps"]
        argv += [str(cfg.grad_accum)]
        argv += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(cfg.precision, [])
    return argv


# ---- what the ranks' reports make of the result (launch.aggregate calls it) ------------------------------------
def finish(req: TrialRequest, res: TrialResult, ranks: list[RankReport]) -> TrialResult:
    """A script trial's TrialResult from what its engine ran: samples per step from the engine's train_batch_size,
    tokens from its forwards' input_ids, and the per-rank cap held against the measured peaks (the worker's ranks
    decide that among themselves, autotune/trial/worker.py classify; a script's ranks report, this decides)."""
    r0 = next((d for d in ranks if d.engine), None)
    res.script = req.script.label()
    res.implementation = f"script:{req.script.name}"
    if r0 is None:
        return res
    res.engine = dict(r0.engine)
    cfg, world = req.config, req.cluster.world_size
    if res.step_time_s:
        res.samples_per_s = r0.engine["train_batch_size"] / res.step_time_s
        steps = [d.engine.get("tokens_per_step") or [] for d in ranks]
        if all(steps) and len({len(s) for s in steps}) == 1:
            # each data-parallel group's ranks see its batch once: tokens over all ranks / (tp x sp)
            per_step = [sum(t) / (world // data_parallel_size(cfg, world)) for t in zip(*steps)]
            res.tokens_per_s = statistics.median(per_step) / res.step_time_s
        else:  # no input_ids seen in the script's forwards: the study's sequence length, as for autotune's loop
            res.tokens_per_s = res.samples_per_s * cfg.seq_len
            res.engine["tokens"] = f"not seen in the forwards' arguments: samples/s x the study's seq len {cfg.seq_len}"
        per_token = req.model.flops_per_token(cfg.seq_len)
        res.tflops = per_token * res.tokens_per_s / world / TFLOPS
        peak = req.cluster.gpu.peak_flops(cfg.precision)
        res.mfu = res.tflops * TFLOPS / peak if peak else None
    cap = req.cluster.capacity_bytes
    if res.status == "ok":
        for what, value in (
            ("the script's steps", res.peak_bytes),
            ("the script up to deepspeed.initialize", res.init_peak_bytes),
        ):
            if value is not None and value > cap:
                res.status = "oom"
                res.reason = (
                    f"measured peak of {int(value):,} tensor bytes in {what} exceeds the per-rank cap of {cap:,} "
                    f"bytes (--gpus {req.cluster.text or req.cluster.gpu.name})"
                )
                break
    return res


def engine_mismatch(req: TrialRequest, engine: dict) -> str:
    """Why the script's engine did not run the candidate ("" when it did): its micro batch, grad accum, ZeRO stage
    and precision are read from the engine, and its longest sequence from its forwards (longer than the study's
    --seq-len: the memory model priced shorter ones). A script that ignores the JSON measures something else."""
    cfg = req.config
    want = {
        "micro_batch": cfg.micro_batch,
        "grad_accum": cfg.grad_accum,
        "zero_stage": cfg.zero_stage,
        "precision": cfg.precision,
    }
    off = [f"{k} {engine.get(k)} (the candidate's: {v})" for k, v in want.items() if k in engine and engine[k] != v]
    longest = max(engine.get("seq_lens") or [0])
    if longest > cfg.seq_len:
        off.append(f"sequences of {longest} tokens (the study's --seq-len: {cfg.seq_len})")
    if not off:
        return ""
    hint = (
        "pass the JSON's values on (the Trainer: --per_device_train_batch_size and friends come with "
        "--script-trainer-args)"
        if req.script.template is None
        else "read them from the JSON it gets"
    )
    return f"the script's DeepSpeed engine did not run the candidate: {'; '.join(off)}. The script must {hint}"


def finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)
