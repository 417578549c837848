"""`autotune search`: find the fastest DeepSpeed configuration (see autotune/search/loop.py)."""

from __future__ import annotations

import argparse
import signal
import sys

from autotune.cli.common import add_impl
from autotune.cli.trial import add_script, script_from_args
from autotune.errors import SpecError

ORDER = 30

NO_RESULT = 3
"""Exit code of a search that ended with no successful run in its study: nothing fits, every run failed, or
--timeout / --n-trials ended it before one finished. Not 1 (an error), 2 (bad input) or 130 (interrupted)."""

EXIT_CODES = (
    "exit codes: 0 the study has a successful run (its winner: `autotune export`); "
    f"{NO_RESULT} the search ended and the study has no successful run, so nothing to export (nothing fits, every run "
    "failed, or --timeout / --n-trials ended it first); 2 bad input, or a study of that name with other inputs; "
    "130 interrupted (Ctrl-C or SIGTERM; completed trials are kept); 1 an unexpected error"
)


def register(sub) -> None:
    p = sub.add_parser(
        "search",
        help="search the fastest DeepSpeed configuration (Optuna, memory-pruned)",
        description="Search the fastest DeepSpeed configuration: the memory model prunes what "
        "cannot fit, the rest runs (or is simulated), ranked by samples/s (or --objective tokens). "
        "The study keeps its inputs and settings: the same command again continues it (no completed trial "
        "runs again; with nothing left to run it shows the result), and a setting given again replaces the study's.",
        epilog=EXIT_CODES,
    )
    p.add_argument(
        "--model",
        help="preset, alias (`autotune models`), a Hugging Face config.json, a directory "
        "holding one, or a cached hub id (docs/models.md); optional with --resume",
    )
    add_impl(p)
    p.add_argument("--gpus", help="[NODESx]COUNTxTYPE[@MEM], e.g. 4xA100, 2xcpu@2GiB; optional with --resume")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(2048, model max))")
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step: grad accum = global / (micro batch * devices)",
    )
    p.add_argument(
        "--objective",
        choices=["samples", "tokens"],
        default=None,
        help="maximise samples/s (default) or tokens/s; they rank differently once the space varies seq_len",
    )
    p.add_argument("--space", default=None, help="search space YAML (default: search_spaces/default.yaml)")
    p.add_argument(
        "--n-trials",
        type=int,
        default=None,
        help="run at most this many trials in the study (counted across --resume); "
        "pruned candidates cost none. Default: until the feasible space is exhausted (a continued study: its own)",
    )
    p.add_argument(
        "--tolerance",
        default=None,
        help="stop when no unrun candidate can beat the best measured by more than this "
        "(percent: 2 or 2%%; docs/search.md, 'When the search stops'). Default 2%% (a continued study: its own)",
    )
    p.add_argument(
        "--exhaustive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every feasible group instead (no stopping rule); --n-trials and --timeout still cap. "
        "Default: the stopping rule (a continued study: its own; --no-exhaustive turns it back on)",
    )
    p.add_argument("--timeout", default=None, help="stop starting trials after this long: 90, 15m, 1h30m")
    p.add_argument("--study", default=None, help="study name (default: MODEL_GPUS); its folder is trials/NAME")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite:///trials/NAME/study.db)")
    p.add_argument(
        "--executor",
        choices=["auto", "ray", "simulated"],
        default="auto",
        help="ray: real DeepSpeed trials; simulated: the cost model; auto: ray when the devices "
        "are here, else simulated",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an existing study with its own inputs and settings (no other flag needed); "
        "no completed trial reruns",
    )
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start one locally)")
    p.add_argument(
        "--concurrent-trials",
        type=int,
        default=None,
        help="trials that may run at once on the same devices (default 1: each trial has its "
        "cores to itself, so its samples/s do not depend on what else runs; a continued study: its own)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="place the first trials with Ray and start their ranks, which stop before the first CUDA call; print each "
        "rank's plan (environment, DeepSpeed accelerator, backend, optimizer, threads). Nothing is measured or stored. "
        "Without --ray-address the local Ray cluster has --gpus declared; --n-trials sets how many trials (default: one "
        "per slot)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_script(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autotune import interrupts, report
    from autotune.search import study as st
    from autotune.search.session import open_search
    from autotune.units import parse_duration_s

    # `kill` ends a search like Ctrl-C: running trials are recorded as interrupted, the rest is kept.
    signal.signal(signal.SIGTERM, interrupts.raise_interrupted)
    try:
        timeout_s = parse_duration_s(args.timeout) if args.timeout else None
    except ValueError as e:
        raise SpecError(f"--timeout: {e}") from None
    if args.n_trials is not None and args.n_trials < 1:
        raise SpecError(f"--n-trials must be at least 1, got {args.n_trials}")
    tolerance = None if args.tolerance is None else _percent(args.tolerance)
    session = open_search(
        model=args.model,
        impl=args.impl,
        model_factory=args.model_factory,
        gpus=args.gpus,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        space=args.space,
        study=args.study,
        storage=args.storage,
        executor=args.executor,
        resume=args.resume,
        ray_address=args.ray_address,
        concurrent_trials=args.concurrent_trials,
        objective=args.objective,
        exhaustive=args.exhaustive,
        tolerance=tolerance,
        n_trials=args.n_trials,
        dry_run=args.dry_run,
        script=script_from_args(args),
    )
    study, model, cluster = session.study, session.inputs.model, session.inputs.cluster
    print(f"{model.describe()}\non {cluster.describe()}{'; ' + cluster.note if cluster.note else ''}")
    print(f"executor: {session.how}")
    if session.search.script is not None:
        print(f"script: {session.search.script.label()} (each trial runs it; measured from its DeepSpeed engine)")
    for line in session.notes:  # a study continued, and with which settings
        print(line)
    if args.dry_run:
        with session:
            session.run(timeout_s=timeout_s, progress=False)
            print(session.executor.dry_run_text())
        return 0
    try:
        with session:
            _print_plan(session.search, study.study_name, session.inputs.space.path)
            summary = session.run(timeout_s=timeout_s, progress=not args.no_progress)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: every completed trial is kept; continue with "
            f"`autotune search --resume --study {study.study_name}`",
            file=sys.stderr,
        )
        raise
    stop = {
        "exhausted": "every feasible candidate is decided",
        "n-trials": "--n-trials reached",
        "timeout": "--timeout reached",
        "bound": summary.bound.get("line"),
    }.get(summary.stop, summary.stop)
    print(
        f"\nstopped: {stop}. {summary.ok} ok, {summary.failed} failed, {summary.pruned} pruned without a run"
        + (f", {summary.interrupted} interrupted (below: what became of each)" if summary.interrupted else "")
    )
    corr = session.correction.summary()
    if corr["measured_trials"] or corr["oom_trials"]:
        print(
            f"memory model: x{corr['factor']:.3f} after {corr['measured_trials']} measured and "
            f"{corr['oom_trials']} out-of-memory trials; |error| median "
            f"{_pct(corr['median_abs_error_before'])} -> {_pct(corr['median_abs_error_after'])}, max "
            f"{_pct(corr['max_abs_error_before'])} -> {_pct(corr['max_abs_error_after'])}"
        )
    recs = st.records(study)  # read once for the table and every part of the report
    print(report.render(study, "table", top=10, recs=recs))
    files = report.write_outputs(study, recs=recs)
    if summary.best_trial is None:  # counts the study's earlier runs too (Search replays them)
        print(
            f"report: {files[0]}\nno successful run in study {study.study_name}: nothing to export ({_why_none(summary)})"
        )
        return NO_RESULT
    print(f"report: {files[0]}; export the winner: autotune export --study {study.study_name} --out ds_config.json")
    return 0


def _why_none(summary) -> str:
    """Why a search ended without a successful run, from its summary (the study's counts, earlier runs included)."""
    if summary.ran:
        return f"all {summary.ran} runs failed: see 'failed' above"
    if summary.stop == "timeout":
        return "--timeout ended it before any trial started"
    if summary.stop == "n-trials":
        return "--n-trials reached"
    return "nothing fits: the memory model pruned every candidate, see 'pruned' above"


def _percent(text: str) -> float:
    """`--tolerance`: "2", "2%" or "0.5%" -> 0.02, 0.005 (a fraction)."""
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        raise SpecError(f"--tolerance: expected a percentage such as 2 or 2%, got {text!r}") from None
    if not 0 <= value < 100:
        raise SpecError(f"--tolerance must be at least 0% and below 100%, got {text!r}")
    return value / 100


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _print_plan(search, name: str, space_path: str) -> None:
    s = search.summary
    excluded = sum(s.excluded.values())
    print(
        f"study {name}: {s.candidates} candidates from {space_path}"
        + (f" ({excluded} combinations left out as invalid)" if excluded else "")
        + f"; {s.pruned} pruned so far, {len(search.plan.available(set()))} groups to try"
        + (f"; resumed: {s.ran} trials already run" if s.ran else "")
    )
    sys.stdout.flush()
