"""`autotune search`: find the fastest DeepSpeed configuration (see autotune/search.py)."""

from __future__ import annotations

import argparse
import signal
import sys

from autotune.cli.common import add_impl
from autotune.memory.correction import Correction
from autotune.models import SpecError

ORDER = 30


def register(sub) -> None:
    p = sub.add_parser("search", help="search the fastest DeepSpeed configuration (Optuna, memory-pruned)",
                       description="Search the fastest DeepSpeed configuration: the memory model prunes what "
                                   "cannot fit, the rest runs (or is simulated), ranked by samples/s.")
    p.add_argument("--model", help="preset, alias (`autotune models`), a Hugging Face config.json, a directory "
                                   "holding one, or a cached hub id (docs/models.md); optional with --resume")
    add_impl(p)
    p.add_argument("--gpus", help="[NODESx]COUNTxTYPE[@MEM], e.g. 4xA100, 2xcpu@2GiB; optional with --resume")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(2048, model max))")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step: grad accum = global / (micro batch * devices)")
    p.add_argument("--space", default=None, help="search space YAML (default: search_spaces/default.yaml)")
    p.add_argument("--n-trials", type=int, default=None,
                   help="run at most this many trials in the study (counted across --resume); "
                        "pruned candidates cost none. Default: until the feasible space is exhausted")
    p.add_argument("--timeout", default=None, help="stop starting trials after this long: 90, 15m, 1h30m")
    p.add_argument("--study", default=None, help="study name (default: MODEL_GPUS); its folder is trials/NAME")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL (default: sqlite:///trials/NAME/study.db)")
    p.add_argument("--executor", choices=["auto", "ray", "simulated"], default="auto",
                   help="ray: real DeepSpeed trials; simulated: the cost model; auto: ray when the devices "
                        "are here, else simulated")
    p.add_argument("--resume", action="store_true", help="continue an existing study; no completed trial reruns")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start one locally)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _sigterm(signum, frame):
    # `kill` ends a search like Ctrl-C: running trials are recorded as interrupted, the rest is kept.
    raise KeyboardInterrupt


def _specs(args: argparse.Namespace, study=None):
    """Model, cluster, seq len, space: from the arguments, or from a resumed study (which must agree)."""
    from autotune import study as st
    from autotune.hardware import parse_gpus
    from autotune.cli.common import model_from_args
    from autotune.search_space import load_space, parse_space

    if study is None:
        if not args.model or not args.gpus:
            raise SpecError("--model and --gpus are needed to start a search (only --resume can omit them)")
        model, cluster = model_from_args(args), parse_gpus(args.gpus)
        seq = args.seq_len or min(2048, model.max_seq_len)
        return model, cluster, seq, args.global_batch, load_space(args.space)
    model, cluster, a = st.specs_of(study)
    m = model_from_args(args) if args.model else None
    given = {"--model": m and m.name, "--gpus": args.gpus, "--impl": m and m.implementation,
             "--seq-len": args.seq_len, "--global-batch": args.global_batch,
             "--space": args.space and load_space(args.space).text}
    stored = {"--model": model.name, "--impl": model.implementation, "--gpus": a["gpus"], "--seq-len": a["seq_len"],
              "--global-batch": a["global_batch"], "--space": a["space_text"]}
    for flag, v in given.items():
        if v is not None and v != stored[flag]:
            shown = "a different file" if flag == "--space" else repr(v)
            raise SpecError(f"--resume: study {study.study_name!r} was searched with {flag} "
                            f"{stored[flag] if flag != '--space' else a['space_path']!r}, not {shown}; "
                            f"drop {flag} or start another --study")
    return model, cluster, a["seq_len"], a["global_batch"], parse_space(a["space_text"], a["space_path"])


def _open_study(args: argparse.Namespace):
    from autotune import study as st

    if args.resume:
        name = args.study
        if name is None and args.model and args.gpus:
            from autotune.hardware import parse_gpus
            from autotune.cli.common import model_from_args

            name = st.default_name(model_from_args(args), parse_gpus(args.gpus))
        study = st.load_study(name, args.storage)
        return study, _specs(args, study)
    specs = _specs(args)
    return None, specs


def run(args: argparse.Namespace) -> int:
    from autotune import report
    from autotune import study as st
    from autotune.search import Search
    from autotune.units import parse_duration_s

    try:
        timeout_s = parse_duration_s(args.timeout) if args.timeout else None
    except ValueError as e:
        raise SpecError(f"--timeout: {e}") from None
    for flag, v in (("--n-trials", args.n_trials), ("--global-batch", args.global_batch)):
        if v is not None and v < 1:
            raise SpecError(f"{flag} must be at least 1, got {v}")
    study, (model, cluster, seq, gb, space) = _open_study(args)
    kind = args.executor
    if study is not None:   # a study keeps its executor: measured and simulated numbers do not mix
        kind = {"measured": "ray", "simulated": "simulated"}[study.user_attrs[st.ATTR]["source"]]
    kind, how = executor_kind(kind, cluster, args.ray_address)
    if study is None:
        name = args.study or st.default_name(model, cluster)
        st.assert_new(name, args.storage)        # before starting Ray: a taken name fails fast
    executor = make_executor(kind, cluster, args.ray_address)
    if study is None:
        attrs = st.study_attrs(model, cluster, seq_len=seq, global_batch=gb, space_text=space.text,
                               space_path=space.path, source=executor.source)
        study = st.create_study(name, args.storage, attrs, sampler=None)
    print(f"{model.describe()}\non {cluster.describe()}{'; ' + cluster.note if cluster.note else ''}")
    print(f"executor: {how}")
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        with executor:
            correction = Correction()   # replayed from a resumed study's trials by Search
            search = Search(study, model, cluster, space, executor, seq_len=seq, global_batch=gb,
                            corrector=correction)
            _print_plan(search, study.study_name, space.path)
            try:
                summary = search.run(n_trials=args.n_trials, timeout_s=timeout_s, progress=not args.no_progress)
            finally:
                study.set_user_attr("memory_correction", correction.summary())
    except KeyboardInterrupt:
        print(f"\ninterrupted: every completed trial is kept; continue with "
              f"`autotune search --resume --study {study.study_name}`", file=sys.stderr)
        raise
    stop = {"exhausted": "every feasible candidate is decided", "n-trials": "--n-trials reached",
            "timeout": "--timeout reached"}.get(summary.stop, summary.stop)
    print(f"\nstopped: {stop}. {summary.ok} ok, {summary.failed} failed, {summary.pruned} pruned without a run"
          + (f", {summary.interrupted} interrupted (rerun on --resume)" if summary.interrupted else ""))
    corr = correction.summary()
    if corr["measured_trials"] or corr["oom_trials"]:
        print(f"memory model: x{corr['factor']:.3f} after {corr['measured_trials']} measured and "
              f"{corr['oom_trials']} out-of-memory trials; |error| median "
              f"{_pct(corr['median_abs_error_before'])} -> {_pct(corr['median_abs_error_after'])}, max "
              f"{_pct(corr['max_abs_error_before'])} -> {_pct(corr['max_abs_error_after'])}")
    print(report.render(study, "table", top=10))
    files = report.write_outputs(study)
    print(f"report: {files[0]}; export the winner: autotune export --study {study.study_name} --out ds_config.json")
    return 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def devices_present(cluster) -> tuple[bool, str]:
    """Whether the requested devices are here: CPU ranks always are; GPUs if CUDA shows enough of them."""
    if cluster.gpu.is_cpu:
        return True, "cpu ranks run here"
    import torch

    n = torch.cuda.device_count()
    if n < cluster.world_size or cluster.num_nodes > 1:
        return False, f"{cluster.describe()} requested, this machine has {n} CUDA device(s)"
    name = torch.cuda.get_device_name(0)
    family = cluster.gpu.name.split("-")[0].lower()
    if family not in name.lower():
        return False, f"{cluster.gpu.name} requested, this machine has {n} x {name}"
    return True, f"{n} x {name} here"


def executor_kind(kind: str, cluster, ray_address: str | None) -> tuple[str, str]:
    """Which executor ("ray" or "simulated"), and a sentence saying which and why; starts nothing."""
    here, why = devices_present(cluster)
    if ray_address and not here:
        why = f"{cluster.describe()} expected from the Ray cluster"
    if kind == "auto":
        kind = "ray" if here or ray_address else "simulated"
        if kind == "simulated":
            why += "; results below are SIMULATED by the cost model, not measured"
    if kind == "ray":
        if not here and not ray_address:
            raise SpecError(f"--executor ray: {why}; pass --ray-address of a Ray cluster that has them, "
                            f"or use --executor simulated")
        where = f"the Ray cluster at {ray_address}" if ray_address else "a local Ray instance"
        return kind, f"ray: real DeepSpeed trials on {where} ({why})"
    if cluster.gpu.is_cpu:
        raise SpecError("--executor simulated: the cost model prices GPUs from their datasheets; CPU ranks "
                        "are run for real (--executor ray or auto)")
    try:
        import autotune.executors.simulated  # noqa: F401
    except ImportError:
        raise SpecError(f"measured trials are impossible here ({why}), and the simulated executor is not "
                        f"available in this version; run on a machine with those GPUs, or pass "
                        f"--ray-address of a Ray cluster that has them") from None
    return kind, f"simulated: the throughput cost model ({why})"


def make_executor(kind: str, cluster, ray_address: str | None):
    if kind == "ray":
        from autotune.executors.ray_executor import RayExecutor

        return RayExecutor(cluster, ray_address=ray_address)
    from autotune.executors.simulated import SimulatedExecutor

    return SimulatedExecutor()


def _print_plan(search, name: str, space_path: str) -> None:
    s = search.summary
    excluded = sum(s.excluded.values())
    print(f"study {name}: {s.candidates} candidates from {space_path}"
          + (f" ({excluded} combinations left out as invalid)" if excluded else "")
          + f"; {s.pruned} pruned so far, {len(search.plan.available(set()))} groups to try"
          + (f"; resumed: {s.ran} trials already run" if s.ran else ""))
    sys.stdout.flush()
