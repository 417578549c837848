"""`autotune export`: write the winning (or a chosen) trial's DeepSpeed JSON and say how to use it."""

from __future__ import annotations

import argparse
from pathlib import Path

ORDER = 50


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write the best (or a given) trial's DeepSpeed config JSON (for the Hugging Face Trainer; --concrete "
        "for a plain deepspeed.initialize loop; --into your own config)",
    )
    p.add_argument("--study", default=None, help="study name (default: the most recent one under trials/)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: the study's own)")
    p.add_argument("--trial", type=int, default=None, help="trial number (default: the fastest successful run)")
    p.add_argument(
        "--out", default=None, type=Path, help="where to write the JSON (required unless --into, which it then leaves)"
    )
    p.add_argument(
        "--into",
        default=None,
        type=Path,
        metavar="YOUR_DS_CONFIG",
        help="your own DeepSpeed config JSON: keep it, change only the keys autotune tuned (listed, old -> new); "
        "updated in place unless --out",
    )
    p.add_argument(
        "--concrete",
        action="store_true",
        help='numbers instead of the Hugging Face Trainer\'s "auto": for a plain deepspeed.initialize loop',
    )
    p.add_argument(
        "--accelerate-config",
        default=None,
        type=Path,
        metavar="FILE",
        help="also write an `accelerate launch --config_file` YAML that starts DeepSpeed with the JSON",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="then run the exported trial once through the Hugging Face Trainer with the written JSON, on the study's "
        "cluster (Ray, as its trials), and show its measured samples/s and peak beside the study's (exit 1 if it fails)",
    )
    p.add_argument("--ray-address", default=None, help="with --verify: an existing Ray cluster (default: a local one)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autotune.report.export import export
    from autotune.search import study as st

    study = st.load_study(args.study, args.storage)
    trial, _, text = export(
        study,
        args.out,
        args.trial,
        args.accelerate_config,
        into=args.into,
        style="concrete" if args.concrete else "trainer",
    )
    print(text)
    if args.verify:
        from autotune.report.verify import verify

        written = args.out if args.out is not None else args.into  # an --into config is updated in place
        res, said = verify(study, trial, written, ray_address=args.ray_address)
        print(said)
        return 0 if res.status == "ok" else 1
    return 0
