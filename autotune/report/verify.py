"""`autotune export --verify`: run the exported winner once through the Hugging Face Trainer, with the files the export
wrote, on the study's cluster, and show its measured samples/s and peak beside the study's (docs/trials.md, "Checking
the winner in the Trainer").

The run is a script trial (autotune/trial/script.py) of autotune/trial/trainer_run.py, placed by the same Ray
executor as the study's trials: the script gets the exported JSON as it is (ScriptSpec.as_given), plus DeepSpeed's
`autotuning` section that stops it after the study's warm-up and measured steps, and the TrainingArguments for what
the JSON leaves to the Trainer ("auto") or fixes (so that the Trainer's consistency check passes:
transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process, fill_match).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import optuna

from autotune import executors
from autotune.errors import SpecError
from autotune.report.export import fixed_for_trainer
from autotune.search import study as st
from autotune.search.space import parse_space
from autotune.trial.record import ScriptSpec, TrialRequest, TrialResult
from autotune.units import fmt_bytes


def verify_request(
    study: optuna.Study, trial: optuna.trial.FrozenTrial, json_path: Path, out_dir: Path
) -> TrialRequest:
    """The script trial that runs trial `trial`'s configuration through the Trainer with the exported `json_path`."""
    from autotune.trial import trainer_run

    model, cluster, a = st.specs_of(study)
    if model.implementation != "hf":
        raise SpecError(
            f"--verify runs the Hugging Face Trainer, which trains a transformers model; study {study.study_name!r} "
            f"measured model code {model.code_name}"
        )
    record = st.record_of(trial)
    cfg = record.config
    ds = json.loads(Path(json_path).read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    model_json = out_dir / "model.json"
    model_json.write_text(json.dumps(dataclasses.asdict(model), default=str))
    args = ["--autotune_model", str(model_json.resolve()), "--seq_len", str(cfg.seq_len)]
    args += ["--output_dir", str((out_dir / "trainer_output").resolve())]
    args += ["--attention", cfg.attention] if cfg.attention else []
    # the values the JSON fixes, repeated as the Trainer demands (fill_match); "auto" ones are left to the Trainer
    args += [x for k, v in fixed_for_trainer(ds)[1].items() for x in (f"--{k}", str(v))]
    script = ScriptSpec(
        path=trainer_run.__file__,
        args=tuple(args),
        template=ds,
        template_path=str(Path(json_path).resolve()),
        trainer_args=True,  # the micro batch, grad accum and precision as TrainingArguments (script.script_argv)
        cwd=str(Path.cwd()),
        as_given=True,
    )
    t = parse_space(a["space_text"], a["space_path"]).trial
    impl = record.result.optimizer_impl if record.result else ""
    return TrialRequest(
        model=model,
        cluster=cluster,
        config=cfg,
        out_dir=out_dir,
        steps=t.steps,
        warmup_steps=t.warmup_steps,
        timeout_s=t.timeout_s,
        trial_id=trial.number,
        optimizer_impl=impl or None,
        script=script,
    )


def run_verify(req: TrialRequest, ray_address: str | None = None) -> TrialResult:
    """The request, placed and run by the Ray executor as a study's trial is (autotune/executors/ray_executor.py)."""
    ex = executors.make("ray", req.cluster, ray_address)
    try:
        if getattr(ex, "cluster", req.cluster) != req.cluster:
            req = dataclasses.replace(req, cluster=ex.cluster)
        ticket = ex.submit(req)
        while True:
            for t, res in ex.wait_any(timeout_s=5):
                if t == ticket:
                    return res
    finally:
        ex.close()


def verify(
    study: optuna.Study,
    trial: optuna.trial.FrozenTrial,
    json_path: Path,
    *,
    out_dir: Path | None = None,
    ray_address: str | None = None,
) -> tuple[TrialResult, str]:
    """Run the check and say what it measured beside the study's trial; the text names each figure's source."""
    _, cluster, _ = st.specs_of(study)
    kind, how = executors.choose("auto", cluster, ray_address)
    if kind != "ray":
        raise SpecError(f"--verify runs the winner on the study's cluster ({cluster.describe()}): {how}")
    out_dir = out_dir or st.study_dir(study.study_name) / f"verify-{time.strftime('%Y%m%d-%H%M%S')}"
    req = verify_request(study, trial, json_path, out_dir)
    res = run_verify(req, ray_address)
    return res, text(st.record_of(trial), res, json_path, req)


def text(record: st.TrialRecord, res: TrialResult, json_path: Path, req: TrialRequest) -> str:
    was = record.result
    source = record.source or "measured"
    lines = [
        f"verify: trial {record.number}'s configuration ({record.config.short()}) ran through the Hugging Face Trainer "
        f"with {json_path} on {req.cluster.describe()}, {req.warmup_steps} warm-up + {req.steps} measured steps: "
        f"{res.status}" + (f" ({res.reason})" if res.reason else "")
    ]
    if res.samples_per_s is not None:
        study_speed = f"{was.samples_per_s:.4g} samples/s {source}" if was and was.samples_per_s else "none recorded"
        lines.append(f"  samples/s  {res.samples_per_s:.4g} (measured, the Trainer)   study: {study_speed}")
    if res.peak_bytes is not None:
        study_peak = f"{fmt_bytes(was.peak_bytes)} {source}" if was and was.peak_bytes is not None else "none recorded"
        est = record.estimate.get("total_bytes")
        lines.append(
            f"  peak       {fmt_bytes(res.peak_bytes)} per rank (measured, tensor bytes)   study: {study_peak}"
            + (f"; estimated {fmt_bytes(est)}" if est else "")
            + f"; cap {fmt_bytes(req.cluster.capacity_bytes)}"
        )
    lines.append(f"  files      {res.out_dir}")
    if res.status != "ok" and res.log_tail:
        lines += ["log tail:", res.log_tail]
    return "\n".join(lines)
