"""`autotune plan`: which GPUs to rent for a token budget: parse, call autotune.plan.plan_gpus, print."""

from __future__ import annotations

import argparse
import json

from autotune.cli.common import add_impl

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
        "--global-batch",
        type=int,
        default=None,
        metavar="N",
        help="sequences per optimizer step for every option (micro batch x data-parallel ranks x grad accum = N, "
        "as in search); an option that cannot reach N exactly is left out with why (default: each option's fastest)",
    )
    p.add_argument(
        "--picture",
        default=None,
        metavar="PNG",
        help="where to draw hours vs dollars (default: trials/plan_MODEL_HASH.png, HASH of the plan's inputs)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autotune.plan import plan_gpus

    plan = plan_gpus(
        args.model,
        args.tokens,
        impl=args.impl,
        model_factory=args.model_factory,
        gpus=args.gpus,
        method=args.method,
        seq_len=args.seq_len,
        space=args.space,
        price=args.price,
        prices_file=args.prices,
        max_hours=args.max_hours,
        max_usd=args.max_usd,
        by=args.by,
        calibrate=args.calibrate,
        global_batch=args.global_batch,
        picture=args.picture,
        progress=not args.json,
    )
    print(json.dumps(plan.to_json(), indent=1) if args.json else plan.render())
    return 0
