"""The command line is a contract: every sub-command, flag, choice and default is frozen in
tests/data/cli_surface.json (as torchtitan freezes its config). A change to the surface is deliberate:
regenerate the file with `python tests/test_cli_surface.py` and let the diff show what users see.
Exit codes: 0 success, 1 a trial that ran but did not succeed, 2 bad input (argparse's or SpecError),
3 a search that ended with no successful run in its study (tests/test_newcomer.py), 130 interrupted."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from autotune.cli import build_parser, main

FROZEN = Path(__file__).parent / "data" / "cli_surface.json"


def surface() -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, p in sorted(sub.choices.items()):
        opts = {}
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
                continue
            opts[max(a.option_strings, key=len)] = {
                "dest": a.dest,
                "required": a.required,
                "default": a.default
                if a.default is None or isinstance(a.default, (int, float, str, bool))
                else str(a.default),
                "choices": list(a.choices) if a.choices else None,
                "takes_value": a.nargs != 0,
            }
        out[name] = opts
    return out


def test_cli_surface_is_frozen():
    assert surface() == json.loads(FROZEN.read_text()), (
        "the CLI surface changed; if deliberate, run `python tests/test_cli_surface.py` and commit the diff"
    )


@pytest.mark.parametrize(
    "argv,code",
    [
        (["estimate", "--model", "tiny-llama", "--gpus", "2xcpu"], 0),
        (["estimate", "--model", "tiny-llama", "--gpus", "2xcpu", "--json"], 0),
        (["estimate", "--model", "tiny-llama", "--gpus", "2xcpu", "--seq-len", "0"], 2),
        (["estimate", "--model", "nope", "--gpus", "2xcpu"], 2),
        (["estimate", "--model", "tiny-llama", "--gpus", "3xnope"], 2),
        (["estimate", "--model", "tiny-llama", "--gpus", "2xcpu", "--zero", "5"], 2),
        (["estimate", "--model", "tiny-llama", "--gpus", "2xcpu", "--ckpt-layers", "99"], 2),
        (["models"], 0),
        (["gpus"], 0),
        (["report", "--study", "no-such-study"], 2),
        (["export", "--study", "no-such-study", "--out", "x.json"], 2),
        (["search", "--model", "tiny-llama", "--gpus", "2xcpu", "--n-trials", "0"], 2),
        (["search", "--model", "tiny-llama", "--gpus", "2xcpu", "--seq-len", "0"], 2),
        (["search", "--gpus", "2xcpu"], 2),
        (["search", "--model", "tiny-llama", "--gpus", "2xcpu", "--storage", "sqlite:////proc/nope/x.db"], 2),
        (["nope"], 2),
    ],
)
def test_exit_codes(argv, code, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    monkeypatch.chdir(tmp_path)
    try:
        got = main(argv)
    except SystemExit as e:  # argparse's own errors
        got = e.code
    err = capsys.readouterr().err
    assert got == code, err
    if code == 2:
        assert "error" in err and "Traceback" not in err


def test_estimate_json_says_what_every_figure_is(capsys):
    assert main(["estimate", "--model", "tiny-llama", "--gpus", "2xcpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == "estimated" and doc["simulated"] is None  # CPU ranks are measured, not simulated
    assert sum(doc["terms"].values()) == doc["tensor_peak_bytes"]
    assert main(["estimate", "--model", "13b", "--gpus", "4xA100", "--zero", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["simulated"]["step_time_s"] > 0


if __name__ == "__main__":
    FROZEN.write_text(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FROZEN}", file=sys.stderr)
