"""Command line: thin. Each sub-command lives in its own module in this package with
`ORDER` (position in --help), `register(subparsers)` and a `run(args) -> int` set as the parser's
`func` default. Bad input raises SpecError, printed here as `error: ...` with exit code 2.

Exit codes: 0 success; 1 a trial that ran but did not succeed (`trial`), or an unexpected error; 2 bad input;
3 a search that ended with no successful run in its study (cli/search.py NO_RESULT); 130 interrupted."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from autotune.errors import SpecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotune", description="Find the fastest DeepSpeed configuration to train an LLM on given GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    mods = []
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "register"):
            mods.append(mod)
    for mod in sorted(mods, key=lambda m: getattr(m, "ORDER", 100)):
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (IsADirectoryError, NotADirectoryError) as e:
        # a file argument naming a folder, or a path through a file, that no check caught first: bad input all the same
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
