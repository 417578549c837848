"""`autotune estimate`: the memory model's breakdown for one configuration, and the throughput cost
model's step time per term (`simulated`, with `breakdown_s` in --json)."""

from __future__ import annotations

import json

from autotune.cli.common import add_model_gpus, add_train_config, specs_from_args

ORDER = 10


def register(sub) -> None:
    p = sub.add_parser(
        "estimate",
        help="per-GPU memory breakdown of one configuration (no GPU needed)",
        description="Price one training configuration per GPU, term by term, at the peak "
        "phase of a step. Every figure is estimated by the memory model: "
        "analytic terms for the builtin model, terms traced from the module's "
        "code for Hugging Face and factory models (docs/memory.md).",
    )
    add_model_gpus(p)
    add_train_config(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--trace",
        action="store_true",
        help="also trace the step on fake tensors (seconds, no GPU) and print traced vs estimated",
    )
    p.add_argument(
        "--max-seq-len",
        action="store_true",
        help="also answer the largest sequence length that fits, the rest of the configuration as given",
    )
    p.add_argument(
        "--max-micro-batch",
        action="store_true",
        help="also answer the largest micro batch that fits, the rest of the configuration as given",
    )
    p.set_defaults(func=run)


def _limits(args, model, cluster, cfg) -> dict[str, int]:
    from autotune.memory.limits import largest_fitting

    return {
        f"max_{n}": largest_fitting(model, cluster, cfg, n)
        for n, asked in (("seq_len", args.max_seq_len), ("micro_batch", args.max_micro_batch))
        if asked
    }


def _simulated(model, cluster, cfg) -> dict | None:
    """The throughput cost model's figures; None for CPU ranks, which have no datasheet to price
    them by (their trials are measured, not simulated)."""
    if cluster.gpu.is_cpu:
        return None
    from autotune.costmodel import simulate

    return simulate(model, cluster, cfg).to_json()


def _print_simulated(model, cluster, cfg) -> None:
    """The cost model's step time, per term (simulated: plan and rank with it, then measure)."""
    if cluster.gpu.is_cpu:
        return
    from autotune.costmodel import simulate

    s = simulate(model, cluster, cfg)
    print(
        f"\nsimulated step {s.step_time_s:.4f} s: {s.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
        f"{s.samples_per_s:,.1f} samples/s, MFU {100 * s.mfu:.1f}%"
    )
    print(f"{'term (simulated)':<26} {'seconds':>10} {'share':>6}")
    for name, t in s.terms().items():
        print(f"{name:<26} {t:>10.4f} {100 * t / s.step_time_s:>5.1f}%")


def run(args) -> int:
    from autotune.memory.limits import traced_once

    model, cluster, cfg = specs_from_args(args)
    # asked for the largest sequence length, the configuration's own estimate comes from the same build
    with traced_once(model, cfg, "seq_len" if args.max_seq_len else "micro_batch" if args.max_micro_batch else None):
        _trace_ahead(model, cluster, cfg)
        return _run(args, model, cluster, cfg)


def _trace_ahead(model, cluster, cfg) -> None:
    """A first estimate of transformers' code traces two small programs (two and three layers, for
    most depths) and, on GPUs, the cost model's op profile. Here they are traced on two cores: the
    last program in a forked process, which stores it in the trace cache (autotune/trace_cache.py),
    the rest in this one; _run then reads them all back. Only programs the disk cache keeps can
    come back from another process, and a later run finds them cached and forks nothing. Measured
    by `python benchmarks/estimate_speed.py` (docs/search.md)."""
    from autotune.memory.code_trace import kept_on_disk
    from autotune.memory.traced import trace_jobs
    from autotune.trace_cache import in_parallel

    jobs = trace_jobs(model, cluster, cfg) if kept_on_disk(model) else []
    here, there = jobs[:-1], jobs[-1:]
    if not cluster.gpu.is_cpu:
        from autotune.costmodel import simulate

        here.append(lambda: simulate(model, cluster, cfg))
    if here and there:
        in_parallel(here, there)


def _run(args, model, cluster, cfg) -> int:
    from autotune.memory import estimate
    from autotune.memory.traced import mixed_blocks_note
    from autotune.train_config import risks
    from autotune.units import GiB, fmt_bytes

    est = estimate(model, cluster, cfg)
    if args.json:
        out = {
            "implementation": model.code_name,
            **est.to_json(),
            "model": model.name,
            "gpus": cluster.text,
            "config": cfg.to_dict(),
        }
        out["simulated"] = _simulated(model, cluster, cfg)
        out.update(_limits(args, model, cluster, cfg))
        out["risks"] = risks(cfg)
        note = mixed_blocks_note(model)
        if note:
            out["memory_note"] = note
        if cluster.note:
            out["note"] = cluster.note
        if args.trace:
            from autotune.memory.traced import trace

            out["traced"] = trace(model, cluster, cfg).to_json()
        print(json.dumps(out, indent=2))
        return 0
    print(model.describe())
    print(f"on {cluster.describe()}" + (f"  [{cluster.note}]" if cluster.note else ""))
    print(f"config: {cfg.short()} seq {cfg.seq_len} attention {cfg.attention}\n")
    print(f"{'term (estimated)':<26} {'bytes':>16} {'GiB':>9} {'share':>6}  phase")
    for name, b in sorted(est.terms.items(), key=lambda kv: -kv[1]):
        print(f"{name:<26} {b:>16,} {b / GiB:>9.3f} {100 * b / est.tensor_peak_bytes:>5.1f}%  {est.phase}")
    print(f"{'tensor peak':<26} {est.tensor_peak_bytes:>16,} {est.tensor_peak_bytes / GiB:>9.3f}")
    for name, b in est.overhead.items():
        print(f"{'+ ' + name:<26} {b:>16,} {b / GiB:>9.3f}         framework overhead (allowance)")
    print(f"{'total per GPU':<26} {est.total_bytes:>16,} {est.total_bytes / GiB:>9.3f}")
    print("\npeak by phase: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in est.phases.items()))
    if est.host_bytes:
        cap = f" of {fmt_bytes(est.host_capacity_bytes)}" if est.host_capacity_bytes else " (node RAM unknown)"
        print(f"host RAM per node (estimated): {fmt_bytes(est.host_bytes)}{cap}")
    print(f"verdict: {est.verdict()}")
    _print_simulated(model, cluster, cfg)
    for text in [*risks(cfg), mixed_blocks_note(model)]:
        if text:
            print(f"WARNING: {text}")
    for k, v in _limits(args, model, cluster, cfg).items():
        other = f"micro batch {cfg.micro_batch}" if k == "max_seq_len" else f"seq len {cfg.seq_len}"
        what = k.removeprefix("max_").replace("_", " ")
        bound = (
            " = the model's max_seq_len: its code runs no longer sequences (position table or ALiBi)"
            if k == "max_seq_len" and v == model.max_seq_len and model.position != "rotary"
            else ""
        )
        if k == "max_seq_len" and v > model.max_seq_len and model.position == "rotary":
            # not capped: rotary code runs any length, and long context (sequence parallelism) is the point of going
            # past it; what the model was trained for is the config's max_position_embeddings
            bound = (
                f" (memory's answer: past the model's max_position_embeddings {model.max_seq_len}, which it was "
                "trained for, it needs RoPE scaling, e.g. rope_scaling in its config, to model such lengths well)"
            )
        print(f"largest {what} that fits (with {other}): {v}{bound}" if v else f"no {what} fits (with {other})")
    if args.trace:
        from autotune.memory.traced import compare, trace

        traced = trace(model, cluster, cfg)
        print(f"\ntraced (the trial model's step on fake tensors, {traced.trace_s:.1f} s) vs estimated:")
        print(compare(est, traced))
    return 0
