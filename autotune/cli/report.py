"""`autotune report`: the ranked trials of a study; also writes trials/<study>/report.md, trials.csv, plots."""

from __future__ import annotations

import argparse

ORDER = 40


def register(sub) -> None:
    p = sub.add_parser("report", help="rank a study's trials (table, csv, json, markdown) and write its report files")
    p.add_argument("--study", default=None, help="study name (default: the most recent one under trials/)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: the study's own)")
    p.add_argument("--top", type=int, default=None, help="show the N fastest runs only")
    p.add_argument("--format", choices=["table", "csv", "json", "markdown"], default="table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autotune import report
    from autotune import study as st
    from autotune.errors import SpecError

    if args.top is not None and args.top < 1:
        raise SpecError(f"--top must be at least 1, got {args.top}")
    study = st.load_study(args.study, args.storage)
    print(report.render(study, args.format, top=args.top), end="")
    report.write_outputs(study)
    return 0
