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
    p.add_argument(
        "--open",
        action="store_true",
        help="open the written report.html in a browser, where one exists (else print its path)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autotune import report
    from autotune.errors import SpecError
    from autotune.search import study as st

    if args.top is not None and args.top < 1:
        raise SpecError(f"--top must be at least 1, got {args.top}")
    study = st.load_study(args.study, args.storage)
    print(report.render(study, args.format, top=args.top), end="")
    paths = report.write_outputs(study)
    if args.open:
        _open(next(p for p in paths if p.name == "report.html"))
    return 0


def _open(page) -> None:
    import webbrowser

    try:
        # webbrowser.get raises where no browser is registered (a headless server, CI): say so
        # instead of failing, the page is written either way
        opened = webbrowser.get().open(page.resolve().as_uri())
    except webbrowser.Error:
        opened = False
    print(f"report page: {page}" + ("" if opened else " (no browser found to open it)"))
