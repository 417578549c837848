"""`autotune trial`: run one real DeepSpeed trial on this machine and print what it measured."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from autotune.cli.common import add_model_gpus, add_train_config, specs_from_args
from autotune.errors import SpecError
from autotune.units import fmt_bytes, parse_duration_s

ORDER = 35


def register(sub) -> None:
    p = sub.add_parser(
        "trial",
        help="run one real DeepSpeed trial here and print what it measured",
        description="Run one trial on this machine: N ranks (--gpus) train the model with "
        "DeepSpeed for --steps measured steps. Exit code 0 when the trial's status "
        "is ok, 1 for oom, diverged, timeout or crashed.",
    )
    add_model_gpus(p)
    add_train_config(p)
    p.add_argument("--steps", type=int, default=6, help="measured optimizer steps (default 6)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps before measuring (default 2)")
    p.add_argument("--timeout", default="300", help="kill the trial after this long: 90, 5m (default 300 s)")
    p.add_argument("--out", type=Path, default=None, help="the trial's folder (default trials/adhoc/<time>)")
    p.add_argument("--profile", action="store_true", help="also write a profiler trace (trace.json, Perfetto)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.add_argument("--fault", choices=["nan", "hang", "crash", "exit"], default=None, help=argparse.SUPPRESS)
    add_script(p)
    p.set_defaults(func=run)


def add_script(p: argparse.ArgumentParser) -> None:
    """--script and its options (`autotune trial` and `autotune search`; docs/trials.md "Your own script")."""
    p.add_argument(
        "--script",
        default=None,
        metavar="TRAIN.PY",
        help="run your own DeepSpeed or Hugging Face Trainer script as the trial instead of autotune's loop: each rank "
        "runs `python TRAIN.PY ARGS --deepspeed JSON`, and DeepSpeed's autotuning hook stops it after the warm-up "
        "and measured steps (docs/trials.md)",
    )
    p.add_argument(
        "--script-args", default=None, metavar="ARGS", help="the script's own arguments, one string (split as a shell)"
    )
    p.add_argument(
        "--script-config",
        default=None,
        metavar="DS.JSON",
        help="your own DeepSpeed JSON: the script gets it with only the keys a candidate decides changed "
        "(default: the candidate's JSON in the Trainer's style, \"auto\" where the Trainer fills a value in)",
    )
    p.add_argument(
        "--script-config-flag",
        default=None,
        metavar="FLAG",
        help="the script's option that takes the JSON's path, with or without its dashes: deepspeed_config or "
        "--script-config-flag=--deepspeed_config (default --deepspeed, the Trainer's)",
    )
    p.add_argument(
        "--script-trainer-args",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also pass --per_device_train_batch_size, --gradient_accumulation_steps and --bf16/--fp16 for the "
        "candidate (default: on without --script-config, off with it)",
    )


def script_from_args(args: argparse.Namespace):
    """The ScriptSpec of --script and its options (None without --script); the script options alone are refused."""
    if args.script is None:
        extra = [
            f
            for f in ("script_args", "script_config", "script_config_flag", "script_trainer_args")
            if getattr(args, f) is not None
        ]
        if extra:
            raise SpecError(f"--{extra[0].replace('_', '-')} needs --script")
        return None
    from autotune.trial.script import script_spec

    return script_spec(
        args.script,
        args.script_args or (),
        config=args.script_config,
        config_flag=args.script_config_flag or "--deepspeed",
        trainer_args=args.script_trainer_args,
    )


def run(args) -> int:
    from autotune.deepspeed_config import deepspeed_config
    from autotune.trial import run_trial
    from autotune.trial.record import TrialRequest

    model, cluster, cfg = specs_from_args(args)
    script = script_from_args(args)
    if args.steps < 1 or args.warmup_steps < 0:
        raise SpecError(f"--steps must be >= 1 and --warmup-steps >= 0, got {args.steps}, {args.warmup_steps}")
    try:
        timeout_s = parse_duration_s(args.timeout)
    except ValueError as e:
        raise SpecError(str(e)) from None
    if cluster.num_nodes > 1 and not cluster.gpu.is_cpu:
        raise SpecError(
            f"--gpus {cluster.text}: `autotune trial` runs on this machine only; place multi-node "
            f"trials with `autotune search --ray-address`"
        )
    from autotune.memory import estimate as memory_estimate

    # before the run: a broken estimate fails in a second, not after the trial
    estimate = memory_estimate(model, cluster, cfg).to_json()
    out = args.out or Path("trials", "adhoc", time.strftime("%Y%m%d-%H%M%S"))
    _check_folder(out)
    req = TrialRequest(
        model=model,
        cluster=cluster,
        config=cfg,
        out_dir=out,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        timeout_s=timeout_s,
        profile=args.profile,
        fault=args.fault,
        script=script,
    )
    res = run_trial(req)
    if args.json:
        doc = {
            **res.to_dict(),
            "estimate": estimate,
            "config": {**cfg.to_dict(), "model": model.name, "gpus": cluster.text},
            # a script trial: the JSON its script got (autotune.trial.script.script_config)
            "deepspeed_config": json.loads(Path(out, "deepspeed_config.json").read_text())
            if script is not None
            else deepspeed_config(cfg, model, cluster, res.optimizer_impl or None),
        }
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(summary(req, res, estimate))
    return 0 if res.status == "ok" else 1


def _check_folder(out: Path) -> None:
    """--out names the trial's folder: refuse a file there, or on the way to it, before the trial starts."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise SpecError(f"--out {out}: {p} is a file; --out names the trial's folder")
            return


def summary(req, res, estimate: dict) -> str:
    cfg = req.config
    lines = [
        f"{req.model.name} ({req.model.code_name}) on {req.cluster.describe()}: {cfg.short()}, seq {cfg.seq_len}",
        *([f"script      {res.script} (measured from its DeepSpeed engine)"] if res.script else []),
        f"status      {res.status}{'  (' + res.reason + ')' if res.reason else ''}",
    ]
    if res.samples_per_s is not None:
        mfu = f"MFU {res.mfu:.1%}" if res.mfu is not None else f"MFU n/a (no peak for {req.cluster.gpu.name})"
        lines += [
            f"throughput  {res.samples_per_s:,.2f} samples/s, {res.tokens_per_s:,.0f} tokens/s "
            f"(step {res.step_time_s:.3f} s median, spread {res.step_time_spread_s:.3f} s)",
            f"compute     {res.tflops:.4f} model TFLOPS per device, {mfu}",
        ]
    if res.peak_bytes is not None:
        phases = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in res.phase_peak_bytes.items())
        lines += [
            f"memory      peak {fmt_bytes(res.peak_bytes)} per rank (max over ranks), init "
            f"{fmt_bytes(res.init_peak_bytes)}; last step: {phases}" + ("; LEAK: grows per step" if res.leak else ""),
            f"cap         {fmt_bytes(req.cluster.capacity_bytes)} per rank",
        ]
    lines.append(
        f"estimate    {fmt_bytes(estimate['tensor_peak_bytes'])} tensor peak, {fmt_bytes(estimate['total_bytes'])} "
        f"with the framework allowance (memory model, estimated)"
    )
    if res.losses:
        lines.append(
            f"loss        {res.losses[0]:.4f} -> {res.losses[-1]:.4f} over {len(res.losses)} steps "
            f"({req.warmup_steps} warm-up)"
        )
    if res.overhead_s is not None:
        parts = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in res.timings_s.items() if k != "measured_s")
        lines.append(f"overhead    {res.overhead_s:.2f} s outside the measured steps ({parts})")
    lines.append(f"files       {res.out_dir}")
    if res.status != "ok" and res.log_tail:
        lines += ["log tail:", res.log_tail]
    return "\n".join(lines)
