"""`autotune estimate`: parse, call autotune.estimate (the memory model's breakdown of one configuration and
the cost model's step time per term, `simulated`, with `breakdown_s` in --json), print."""

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


def run(args) -> int:
    from autotune.estimate import LARGEST, breakdown

    model, cluster, cfg = specs_from_args(args)
    largest = tuple(n for n in LARGEST if getattr(args, f"max_{n}"))
    b = breakdown(model, cluster, cfg, largest=largest, trace=args.trace)
    print(json.dumps(b.to_json(), indent=2) if args.json else b.render())
    return 0
