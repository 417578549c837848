"""`autotune plan` at a fair global batch (issue 49): --global-batch prices every option at the same sequences per
optimizer step, the table shows each option's global batch and its network between nodes (an assumed one marked),
the picture's title says which batch, and plans of other inputs draw their own picture. Through the CLI as a user
runs it (real memory model, cost model and search space expansion, no mocks)."""

from __future__ import annotations

import json

import pytest

from autotune import costmodel
from autotune.cli import main
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.models import resolve_model
from autotune.parallel import data_parallel_size
from autotune.plan import plan_space
from autotune.search.space import expand
from autotune.train_config import TrainConfig

pytestmark = pytest.mark.usefixtures("shipped_traces_module")  # plans of 13B, as a user's first run reads them

GPUS = "8xA100,8xH100,4xH100,2x8xA100,16xRTX4090"


def run_plan(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", "--model", "13b", "--tokens", "1e9", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def at_512(tmp_path_factory):
    """The plan of GPUS at --global-batch 512, as JSON and as the table, each run once through the CLI."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("gb512")
    docs = {}
    for fmt in ("json", "table"):
        buf = io.StringIO()
        extra = ["--json"] if fmt == "json" else []
        argv = ["plan", "--model", "13b", "--tokens", "1e9", "--gpus", GPUS, "--global-batch", "512", *extra]
        with contextlib.redirect_stdout(buf):
            assert main([*argv, "--picture", str(tmp / f"{fmt}.png")]) == 0
        docs[fmt] = json.loads(buf.getvalue()) if fmt == "json" else buf.getvalue()
    return docs


def test_every_option_is_priced_at_the_global_batch(at_512):
    doc = at_512["json"]
    assert doc["global_batch"] == 512
    assert sorted(o["gpus"] for o in doc["options"]) == sorted(GPUS.split(","))
    for o in doc["options"]:
        cfg, world = TrainConfig(**o["config"]), parse_gpus(o["gpus"]).world_size
        assert o["global_batch"] == 512 == cfg.micro_batch * data_parallel_size(cfg, world) * cfg.grad_accum


def test_each_option_is_the_fastest_that_fits_at_that_batch(at_512):
    """Brute force over the space the search expands under --global-batch 512: nothing fitting is faster."""
    model = resolve_model("13b")
    for o in at_512["json"]["options"]:
        cluster = parse_gpus(o["gpus"])
        fitting = [
            c
            for c in expand(plan_space(None, None), model, cluster, seq_len=2048, global_batch=512).candidates
            if estimate(model, cluster, c).fits
        ]
        best = max(costmodel.simulate(model, cluster, c).samples_per_s * c.seq_len for c in fitting)
        assert o["tokens_per_s"] == pytest.approx(best)


def test_the_table_says_the_batch_and_shows_it_per_option(at_512):
    table = at_512["table"]
    assert "global batch 512 sequences (1,048,576 tokens) for every option" in table
    head = next(line for line in table.splitlines() if "tokens/s (sim)" in line)
    assert "global batch" in head and "network between nodes" in head
    rows = [line for line in table.splitlines() if line[2:].split(" ")[0] in GPUS.split(",")]
    assert len(rows) == 5 and all(" 512  " in r for r in rows)


def test_without_it_each_option_shows_its_own_batch(tmp_path, capsys):
    code, out, _ = run_plan(capsys, "--gpus", "8xA100,4xH100", "--json", "--picture", str(tmp_path / "p.png"))
    assert code == 0
    doc = json.loads(out)
    assert doc["global_batch"] is None
    for o in doc["options"]:
        cfg = TrainConfig(**o["config"])
        assert o["global_batch"] == cfg.micro_batch * parse_gpus(o["gpus"]).world_size * cfg.grad_accum
    code, out, _ = run_plan(capsys, "--gpus", "8xA100,4xH100", "--picture", str(tmp_path / "p.png"))
    assert "global batch not fixed: each option's fastest" in out and "--global-batch N fixes it" in out


def test_an_option_that_cannot_reach_it_is_left_out_with_why(tmp_path, capsys):
    code, out, _ = run_plan(
        capsys, "--gpus", "8xA100,4xH100", "--global-batch", "4", "--json", "--picture", str(tmp_path / "p.png")
    )
    assert code == 0
    doc = json.loads(out)
    assert [(o["gpus"], o["global_batch"]) for o in doc["options"]] == [("4xH100", 4)]
    (left,) = doc["left_out"]
    assert left["gpus"] == "8xA100"
    assert "cannot reach global batch 4 exactly" in left["reason"] and "the 8 GPUs" in left["reason"]


@pytest.mark.parametrize("bad", ["0", "-3"])
def test_a_global_batch_below_one_exits_2(bad, tmp_path, capsys):
    code, _, err = run_plan(capsys, "--gpus", "8xA100", "--global-batch", bad, "--picture", str(tmp_path / "p.png"))
    assert code == 2 and "--global-batch must be at least 1" in err and "Traceback" not in err


def test_the_picture_title_says_which_batch():
    from autotune.plan import batch_words
    from autotune.plan.picture import plan_title

    fixed = plan_title("llama-2-13b", 1e9, batch_words(512, [], 2048))
    assert "global batch 512 sequences" in fixed and "simulated" in fixed
    assert "each option's fastest" in plan_title("llama-2-13b", 1e9, batch_words(None, [], 2048))


def test_an_assumed_network_is_marked_in_the_table(at_512):
    """16 RTX 4090s are two nodes on one 100 Gb/s Ethernet NIC each, an assumption (no reference system): the row
    says ASSUMED and a line says what was assumed; the DGX network of 2 x 8 A100 is not marked, nor a given one."""
    table = at_512["table"]
    row = {line[2:].split(" ")[0]: line for line in table.splitlines()}
    assert "100 Gb/s per node ASSUMED" in row["16xRTX4090"]
    assert "1,600 Gb/s per node" in row["2x8xA100"] and "ASSUMED" not in row["2x8xA100"]
    assert "one node" in row["8xA100"]
    assert "ASSUMED network between RTX4090 nodes: one 100 Gb/s Ethernet NIC per node of 8" in table
    nets = {o["gpus"]: o["network"] for o in at_512["json"]["options"]}
    assert nets["16xRTX4090"]["assumed"] and not nets["2x8xA100"]["assumed"] and not nets["8xA100"]["assumed"]


def test_a_given_network_is_not_assumed(tmp_path, capsys):
    code, out, _ = run_plan(
        capsys,
        "--gpus",
        "16xRTX4090@net=400Gbps",
        "--global-batch",
        "512",
        "--json",
        "--picture",
        str(tmp_path / "p.png"),
    )
    assert code == 0
    (o,) = json.loads(out)["options"]
    assert o["network"] == {"label": "400 Gb/s per node (given)", "assumed": None}


def test_plans_of_other_inputs_keep_their_own_picture(tmp_path, monkeypatch, capsys):
    """No --picture: trials/plan_MODEL_HASH.png, HASH of the inputs; the output says where."""
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path))
    paths = []
    for extra in ([], ["--global-batch", "64"], ["--global-batch", "64"], ["--price", "A100=1.0"]):
        code, out, _ = run_plan(capsys, "--gpus", "8xA100", "--json", *extra)
        assert code == 0
        paths.append(json.loads(out)["picture"])
    assert len({paths[0], paths[1], paths[3]}) == 3 and paths[1] == paths[2]
    for p in paths:
        assert p.startswith(str(tmp_path / "plan_llama-2-13b_")) and p.endswith(".png")
    assert sorted(str(p) for p in tmp_path.glob("plan_*.png")) == sorted(set(paths))
    code, out, _ = run_plan(capsys, "--gpus", "8xA100", "--global-batch", "64")
    assert f"picture (simulated): {paths[1]}" in out


@pytest.mark.slow
def test_every_default_option_is_ranked_at_global_batch_512(tmp_path, capsys):
    """The issue's command: `autotune plan --model 13b --tokens 1e9 --global-batch 512` (every priced GPU type at
    1-64 GPUs): each option priced is at 512, each left out says why."""
    code, out, _ = run_plan(capsys, "--global-batch", "512", "--json", "--picture", str(tmp_path / "p.png"))
    assert code == 0
    doc = json.loads(out)
    assert len(doc["options"]) > 20 and {o["global_batch"] for o in doc["options"]} == {512}
    assert all(u["reason"] for u in doc["left_out"])
    assert len(doc["options"]) + len(doc["left_out"]) == 49
