"""`autotune plan` (issue 32): the arithmetic, price overrides, the Pareto front, refusals and the
picture's data, through the CLI as a user runs it (real memory model and cost model, no mocks)."""

from __future__ import annotations

import json

import pytest

from autotune import costmodel
from autotune.cli import main
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.models import resolve_model
from autotune.plan import Option, best_config, pareto_front, plan_space, price_option
from autotune.plan.picture import front, plan_points
from autotune.plan.prices import Price, default_prices, parse_price
from autotune.search.space import expand
from autotune.train_config import TrainConfig

GPUS = "8xA100,8xH100,4xH100"
pytestmark = pytest.mark.usefixtures("shipped_traces_module")  # plans of 13B, as a user's first run reads them


def plan_json(capsys, tmp_path, *extra) -> dict:
    argv = [
        "plan",
        "--model",
        "13b",
        "--tokens",
        "1e9",
        "--gpus",
        GPUS,
        "--json",
        "--picture",
        str(tmp_path / "plan.png"),
        *extra,
    ]
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The issue's plan, and the same with --price H100=0.5, each run once through the CLI."""
    import contextlib
    import io

    out = {}
    for name, extra in (("default", []), ("h100", ["--price", "H100=0.5"])):
        tmp = tmp_path_factory.mktemp(name)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert (
                main(
                    [
                        "plan",
                        "--model",
                        "13b",
                        "--tokens",
                        "1e9",
                        "--gpus",
                        GPUS,
                        "--json",
                        "--picture",
                        str(tmp / "plan.png"),
                        *extra,
                    ]
                )
                == 0
            )
        out[name] = (json.loads(buf.getvalue()), tmp / "plan.png")
    return out


def test_three_ranked_options_whose_arithmetic_holds(plans):
    doc, picture = plans["default"]
    opts = doc["options"]
    assert sorted(o["gpus"] for o in opts) == sorted(GPUS.split(","))
    for o in opts:
        world = parse_gpus(o["gpus"]).world_size
        assert o["hours"] == pytest.approx(1e9 / o["tokens_per_s"] / 3600, rel=1e-5)
        assert o["usd"] == pytest.approx(o["hours"] * world * o["usd_per_gpu_hour"], rel=1e-5)
        assert o["usd_per_m_tokens"] == pytest.approx(o["usd"] / 1e3, rel=1e-5)
        assert o["simulated"] is True and o["price_source"]
    assert [o["usd"] for o in opts] == sorted(o["usd"] for o in opts)  # --by usd is the default
    assert picture.stat().st_size > 1000 and doc["source"] == "simulated" and "not truths" in doc["prices_note"]


def test_each_option_is_the_fastest_candidate_that_fits(plans):
    """Brute force over the same space: no fitting candidate is simulated faster than the one chosen."""
    model = resolve_model("13b")
    for o in plans["default"][0]["options"]:
        cluster = parse_gpus(o["gpus"])
        cfg = TrainConfig(**o["config"])
        assert estimate(model, cluster, cfg).fits
        assert costmodel.simulate(model, cluster, cfg).samples_per_s * cfg.seq_len == pytest.approx(o["tokens_per_s"])
        fitting = [
            c
            for c in expand(plan_space(None, None), model, cluster, seq_len=2048).candidates
            if estimate(model, cluster, c).fits
        ]
        best = max(costmodel.simulate(model, cluster, c).samples_per_s * c.seq_len for c in fitting)
        assert o["tokens_per_s"] == pytest.approx(best)


def test_price_override_changes_only_the_h100_dollars(plans):
    base = {o["gpus"]: o for o in plans["default"][0]["options"]}
    cheap = {o["gpus"]: o for o in plans["h100"][0]["options"]}
    assert base.keys() == cheap.keys()
    for gpus, o in cheap.items():
        b = base[gpus]
        assert (o["tokens_per_s"], o["hours"], o["config"]) == (b["tokens_per_s"], b["hours"], b["config"])
        if "H100" in gpus:
            assert o["usd_per_gpu_hour"] == 0.5 and "--price" in o["price_source"]
            assert o["usd"] == pytest.approx(o["hours"] * parse_gpus(gpus).world_size * 0.5)
            assert o["usd"] != b["usd"]
        else:
            assert (o["usd"], o["usd_per_gpu_hour"], o["price_source"]) == (
                b["usd"],
                b["usd_per_gpu_hour"],
                b["price_source"],
            )


def test_pareto_front_marks_exactly_the_undominated(plans):
    opts = plans["default"][0]["options"]
    for o in opts:
        beaten = any(
            p["hours"] <= o["hours"]
            and p["usd"] <= o["usd"]
            and p is not o
            and (p["hours"] < o["hours"] or p["usd"] < o["usd"])
            for p in opts
        )
        assert o["pareto"] == (not beaten), o["gpus"]
    assert any(o["pareto"] for o in opts)


def _opt(gpus: str, tok_s: float, usd_h: float) -> Option:
    cluster = parse_gpus(gpus)
    return price_option(gpus, cluster, TrainConfig(), tok_s, 3.6e9, Price(usd_h, "test", "hand-made"))


def test_pareto_front_by_hand():
    # 1 GPU at 1e5 tok/s: 10 h; 8 GPUs at 4e5: 2.5 h but 20 GPU-h; 8 GPUs at 1e5: dominated by both.
    a, b, c = _opt("1xA100", 1e5, 1.0), _opt("8xA100", 4e5, 1.0), _opt("8xH100", 1e5, 1.0)
    assert (a.hours, a.usd, b.hours, b.usd) == pytest.approx((10, 10, 2.5, 20))
    assert pareto_front([a, b, c]) == {0, 1}
    assert pareto_front([a, a]) == {0}  # an equal pair keeps one


def test_picture_data_is_the_plan(plans):
    from autotune.plan import PlanResult

    doc = plans["default"][0]
    opts = [
        Option(
            gpus=o["gpus"],
            gpu_type="",
            num_gpus=0,
            config=TrainConfig(**o["config"]),
            tokens_per_s=o["tokens_per_s"],
            hours=o["hours"],
            usd=o["usd"],
            price=Price(1, "", ""),
            pareto=o["pareto"],
        )
        for o in doc["options"]
    ]
    pts = plan_points(PlanResult(opts))
    assert [(p.gpus, p.hours, p.usd, p.pareto) for p in pts] == [
        (o["gpus"], o["hours"], o["usd"], o["pareto"]) for o in doc["options"]
    ]
    line = front(pts)
    assert [p.gpus for p in line] == [
        o["gpus"] for o in sorted(doc["options"], key=lambda o: o["hours"]) if o["pareto"]
    ]
    assert all(p.source == "simulated" for p in pts)


def test_table_output_says_simulated_and_prices_are_inputs(tmp_path, capsys):
    assert (
        main(["plan", "--model", "13b", "--tokens", "1e9", "--gpus", "8xA100", "--picture", str(tmp_path / "p.png")])
        == 0
    )
    out = capsys.readouterr().out
    assert "simulated" in out and "prices are inputs, not truths" in out and "8xA100" in out


@pytest.mark.parametrize(
    "extra,why",
    [
        (["--gpus", "8xB999"], "unknown GPU type 'B999'"),
        (["--gpus", "8xA100", "--max-usd", "1"], "no option meets --max-usd 1"),
        (["--gpus", "8xA100,8xH100", "--max-hours", "0.01"], "no option meets --max-hours 0.01"),
        (["--gpus", "8xA100", "--price", "Z80=1"], "unknown GPU type 'Z80'"),
        (["--gpus", "8xA100", "--price", "A100=-1"], "positive number"),
        (["--gpus", "8xA100", "--tokens", "0"], "--tokens must be a positive number"),
        (["--gpus", "2xcpu"], "CPU ranks have no cost model"),
        (["--gpus", "1xRTX4090"], "no GPU option can train this"),
    ],
)
def test_refusals_exit_2_with_the_reason(extra, why, tmp_path, capsys):
    argv = ["plan", "--model", "13b", "--tokens", "1e9", "--picture", str(tmp_path / "p.png"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err


def test_a_type_without_a_price_is_left_out_with_why(tmp_path, capsys):
    doc = plan_json(capsys, tmp_path, "--gpus", "8xA100,4xT4")
    assert [o["gpus"] for o in doc["options"]] == ["8xA100"]
    assert doc["left_out"] == [{"gpus": "4xT4", "reason": "no price for T4: give --price T4=USD"}]


def test_prices_table_and_overrides():
    table = default_prices()
    assert table["H100-80GB"].usd_per_gpu_hour == 3.99 and table["A100-80GB"].usd_per_gpu_hour == 1.79
    assert all(p.source and p.read for p in table.values())
    assert parse_price("h100=0.5")[0] == "H100-80GB"


def test_simulated_study_cannot_calibrate(tmp_path, monkeypatch, capsys):
    from autotune.search.session import open_search

    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path))
    space = tmp_path / "one.yaml"
    space.write_text("zero_stage: [0]\nmicro_batch: [1]\nckpt_layers: [0]\n")
    with open_search(model="gpt2", gpus="1xA100", executor="simulated", study="sim", space=space) as s:
        s.run(n_trials=1, progress=False)
    assert (
        main(
            [
                "plan",
                "--model",
                "gpt2",
                "--tokens",
                "1e8",
                "--gpus",
                "1xA100",
                "--calibrate",
                "sim",
                "--picture",
                str(tmp_path / "p.png"),
            ]
        )
        == 2
    )
    assert "no measured run" in capsys.readouterr().err


def test_best_config_says_why_nothing_fits():
    why = best_config(resolve_model("13b"), parse_gpus("1xRTX4090"), plan_space(None, None), 2048)
    assert isinstance(why, str) and "nothing of" in why and "GiB per device" in why


@pytest.mark.slow
def test_notebook_draws_the_plan():
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient

    root = Path(__file__).parents[1]
    nb = nbformat.read(root / "notebooks" / "plan.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(root / "notebooks")}}
    ).execute()
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert "image/png" in text and "front: " in text and "8xH100" in text and "Error" not in text


def _measured_a100_study(name: str, ratio: float):
    """A study as a real search on 8 x A100 would store it (real Optuna SQLite DB): two measured runs
    at `ratio` x the cost model's tokens/s, one at 1.5 x that (the median ignores it)."""
    import optuna
    from optuna.trial import TrialState

    from autotune.search import study as st

    model, cluster = resolve_model("13b"), parse_gpus("8xA100")
    attrs = st.study_attrs(
        model, cluster, seq_len=2048, global_batch=None, space_text="", space_path="t", source="measured"
    )
    study = st.create_study(name, None, attrs, sampler=None)
    cands = [
        TrainConfig(zero_stage=3, micro_batch=mb, seq_len=2048, precision="bf16", attention="sdpa") for mb in (1, 2, 4)
    ]
    dists = st.distributions(cands)
    for cfg, r in zip(cands, (ratio, ratio, 1.5 * ratio)):
        sps = costmodel.simulate(model, cluster, cfg).samples_per_s * r
        res = {"status": "ok", "source": "measured", "samples_per_s": sps, "tokens_per_s": sps * 2048}
        ua = {"config": cfg.to_dict(), "status": "ok", "source": "measured", "estimate": {}, "result": res}
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.COMPLETE,
                value=sps,
                params=st.params_of(cfg, dists),
                distributions=dists,
                user_attrs=ua,
            )
        )


def test_calibrate_rescales_only_that_gpu_type(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path))
    _measured_a100_study("ours", 1.2)
    base = plan_json(capsys, tmp_path)
    cal = plan_json(capsys, tmp_path, "--calibrate", "ours")
    b, c = ({o["gpus"]: o for o in d["options"]} for d in (base, cal))
    assert c["8xA100"]["tokens_per_s"] == pytest.approx(1.2 * b["8xA100"]["tokens_per_s"])
    assert c["8xA100"]["hours"] == pytest.approx(b["8xA100"]["hours"] / 1.2)
    assert "calibrated by measured study ours" in c["8xA100"]["source"]
    for g in ("8xH100", "4xH100"):
        assert c[g]["tokens_per_s"] == b[g]["tokens_per_s"] and c[g]["source"] == "simulated"
