"""`autotune plan`: which GPUs to rent for a token budget (autotune/plan/)."""

from __future__ import annotations

import argparse
import json
import sys

from autotune.cli.common import add_impl
from autotune.errors import SpecError

ORDER = 25


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="rank GPU types and counts by hours and dollars for a token budget (simulated)",
        description="For each GPU option, the fastest configuration that fits (the search's memory "
        "model, grouping and cost-model prior), its tokens/s, hours and dollars for "
        "--tokens; ranked, with the hours-vs-dollars Pareto front marked. Simulated.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="preset, alias (`autotune models`), a Hugging Face config.json, "
        "a directory holding one, or a cached hub id (docs/models.md)",
    )
    add_impl(p)
    p.add_argument("--tokens", required=True, type=float, help="tokens to train on, e.g. 1e9")
    p.add_argument(
        "--gpus",
        default=None,
        help="comma-separated options, e.g. 8xA100,8xH100,2x8xH100 (default: every priced GPU type at "
        "1-64 GPUs in powers of two, nodes of 8)",
    )
    p.add_argument(
        "--method",
        choices=["full", "lora", "qlora"],
        default=None,
        help="full fine-tuning or pre-training (default), LoRA or QLoRA",
    )
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(2048, model max))")
    p.add_argument(
        "--space",
        default=None,
        help="search space YAML (default: the search's default space with checkpointing 0, L/2, L)",
    )
    p.add_argument(
        "--price",
        action="append",
        default=None,
        metavar="TYPE=USD",
        help="USD per GPU-hour for a type, e.g. --price H100=2.49 (repeatable; overrides the table)",
    )
    p.add_argument("--prices", default=None, metavar="FILE", help="YAML mapping TYPE: USD per GPU-hour")
    p.add_argument("--max-hours", type=float, default=None, help="leave out options that take longer")
    p.add_argument("--max-usd", type=float, default=None, help="leave out options that cost more")
    p.add_argument("--by", choices=["usd", "hours"], default="usd", help="rank by dollars (default) or hours")
    p.add_argument(
        "--calibrate",
        action="append",
        default=None,
        metavar="STUDY",
        help="rescale a GPU type's simulated throughput by a measured study on that type (repeatable)",
    )
    p.add_argument(
        "--picture", default=None, metavar="PNG", help="where to draw hours vs dollars (default: trials/plan_MODEL.png)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from autotune.cli.common import model_from_args
    from autotune.models import default_seq_len
    from autotune.plan import default_options, make_plan
    from autotune.plan.calibrate import calibration_from_studies
    from autotune.plan.picture import draw_plan, plan_points
    from autotune.plan.prices import prices_for
    from autotune.search.space import load_space
    from autotune.search.study import trials_root

    model = model_from_args(args)
    seq_len = args.seq_len if args.seq_len is not None else default_seq_len(model)
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else default_options()
    if not gpus:
        raise SpecError("--gpus: no option given; e.g. --gpus 8xA100,8xH100")
    prices = prices_for(args.price, args.prices)
    calibration = calibration_from_studies(args.calibrate or [])
    space = load_space(args.space) if args.space else None
    say = (lambda g: print(f"[plan] pricing {g} ...", file=sys.stderr)) if not args.json else None
    result = make_plan(
        model,
        args.tokens,
        gpus,
        seq_len=seq_len,
        method=args.method,
        space=space,
        prices=prices,
        max_hours=args.max_hours,
        max_usd=args.max_usd,
        by=args.by,
        calibration=calibration,
        progress=say,
    )
    picture = Path(args.picture) if args.picture else trials_root() / f"plan_{Path(model.name).stem}.png"
    picture.parent.mkdir(parents=True, exist_ok=True)
    draw_plan(plan_points(result), picture, model.name, args.tokens)
    if args.json:
        print(json.dumps(to_json(result, model.name, seq_len, str(picture)), indent=1))
    else:
        print(render(result, model.name, seq_len, str(picture)))
    return 0


def to_json(result, model: str, seq_len: int, picture: str) -> dict:
    from autotune.plan.prices import NOTE

    return {
        "model": model,
        "tokens": result.tokens,
        "seq_len": seq_len,
        "by": result.by,
        "space": result.space,
        "source": "simulated",
        "options": [o.to_json() for o in result.options],
        "left_out": [{"gpus": u.gpus, "reason": u.reason} for u in result.unfit],
        "picture": picture,
        "prices_note": NOTE,
    }


def render(result, model: str, seq_len: int, picture: str) -> str:
    from autotune.plan.prices import NOTE

    lines = [
        f"plan: {model}, {result.tokens:.4g} tokens at seq len {seq_len}, ranked by {result.by} "
        f"(every throughput simulated by the cost model; * = on the hours-vs-dollars Pareto front)",
        f"space: {result.space}",
        "",
        f"{'':2}{'gpus':<12} {'tokens/s (sim)':>15} {'hours':>9} {'USD':>10} {'$/M tok':>8} {'$/GPU-h':>8}  "
        f"config (ZeRO, micro batch, grad accum, ckpt layers, precision)",
    ]
    for o in result.options:
        c = o.config
        lines.append(
            f"{'*' if o.pareto else ' ':2}{o.gpus:<12} {o.tokens_per_s:>15,.0f} {o.hours:>9.3g} {o.usd:>10,.2f} "
            f"{o.usd_per_m_tokens:>8.3f} {o.price.usd_per_gpu_hour:>8.2f}  z{c.zero_stage} mb{c.micro_batch} "
            f"ga{c.grad_accum} ck{c.ckpt_layers} {c.precision}"
            + (f" {c.method}" if c.method != "full" else "")
            + (f"  [{o.source}]" if o.source != "simulated" else "")
        )
    if result.unfit:
        lines += ["", "left out:"] + [f"  {u.gpus}: {u.reason}" for u in result.unfit]
    lines += [
        "",
        "prices: "
        + "; ".join(
            sorted({f"{o.gpu_type} {o.price.usd_per_gpu_hour:.2f} ({o.price.describe()})" for o in result.options})
        ),
        NOTE,
        f"picture (simulated): {picture}",
    ]
    return "\n".join(lines)
