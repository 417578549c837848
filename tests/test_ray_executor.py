"""The Ray executor with real Ray and real trials: a local quiet start, two nodes on one machine
(ray.cluster_utils.Cluster, one CPU each) for STRICT_SPREAD placement, and a Ray worker killed
mid-trial."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster as RayCluster
from steady import per_rank_steps

from autotune.executors import ray_auth
from autotune.executors.ray_executor import RayExecutor
from autotune.hardware import parse_gpus
from autotune.models import SpecError, resolve_model
from autotune.train_config import TrainConfig
from autotune.trial.record import TrialRequest

pytestmark = pytest.mark.slow  # real DeepSpeed / Ray runs

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
MODEL = resolve_model("tiny-llama")
CFG = TrainConfig(zero_stage=2, precision="bf16", seq_len=32)


def request(cluster, out: Path, **kw) -> TrialRequest:
    return TrialRequest(
        model=MODEL, cluster=cluster, config=CFG, out_dir=out, steps=2, warmup_steps=1, **{"timeout_s": 120.0, **kw}
    )


def ranks_of(out: Path) -> list[psutil.Process]:
    """Live rank processes of the trial in `out` (their command line names its payload)."""
    return [
        p
        for p in psutil.process_iter(["cmdline", "status"])
        if str(out) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def ray_worker_of(proc: psutil.Process) -> psutil.Process:
    """The Ray worker process (named `ray::...`) above a rank. Never its parent blindly: a rank
    reparented to the raylet (Ray's subreaper) would make that the raylet, and killing it takes
    the test's own Ray driver down with exit code 1 (seen once in a full CI run)."""
    for anc in proc.parents():
        label = anc.name() + " " + " ".join(anc.cmdline()[:1])
        if "ray::" in label:
            return anc
    raise AssertionError(f"no ray:: worker above rank {proc.pid}: {[a.name() for a in proc.parents()]}")


def wait_all(ex: RayExecutor, n: int, watch: list[Path] = (), limit_s: float = 150.0):
    """Results of n trials; also whether every trial in `watch` had live ranks at one moment."""
    results, together, end = {}, False, time.monotonic() + limit_s
    while len(results) < n and time.monotonic() < end:
        together |= bool(watch) and all(ranks_of(out) for out in watch)
        results.update(ex.wait_any(timeout_s=0.3))
    return results, together


def test_local_ray_starts_quietly_and_runs_trials_at_once(tmp_path):
    one = parse_gpus("1xcpu")
    ex = RayExecutor(one, num_cpus=2, concurrent_trials=2)
    try:
        assert ray.is_initialized() and ex.slots() == 2  # two 1-rank trials fit 2 CPUs
        outs = [tmp_path / f"t{i}" for i in range(2)]
        tickets = {ex.submit(request(one, out)) for out in outs}
        results, together = wait_all(ex, 2, watch=outs)
        assert set(results) == tickets and together  # both trials' ranks were alive at one moment
        for res in results.values():
            assert res.status == "ok", res.reason + res.log_tail
            assert res.losses[-1] < res.losses[0] and res.peak_bytes > 0 and len(res.nodes) == 1
            assert {"placement_s", "ray_s", "spawn_s", "measured_s"} <= set(res.timings_s)
        assert (outs[0] / "result.json").exists() and (outs[0] / "log.txt").exists()
        with pytest.raises(SpecError, match="cannot place"):
            ex.submit(request(parse_gpus("4xcpu"), tmp_path / "big"))  # 4 CPUs on a 2-CPU node
    finally:
        ex.close()
    assert not ray.is_initialized()


def test_waiting_on_a_running_trial_leaves_the_cores_to_its_ranks(tmp_path):
    """wait_any sleeps while a placed trial runs: the driver shares the ranks' cores, and a loop that
    spun on the already-ready placement ref took half a core through every trial (measured on 2 cores:
    the ranks at 60-80% CPU each, 1.6x slower than the same config run alone)."""
    one, out = parse_gpus("1xcpu"), tmp_path / "hang"
    ex = RayExecutor(one, num_cpus=2)
    try:
        # No wall clock decides when the rank is ready: the test waits on the rank's own signal (its "injected hang"
        # line), for as long as the trial itself lives. A fresh clone's loaded machine took 19.2 s to get there, past
        # the 25 s this wait once allowed less the placement (issue 49); the trial's timeout leaves the rank all the
        # time it needs, and ends the trial only after the hang has been seen.
        ticket = ex.submit(request(one, out, fault="hang", timeout_s=300.0))
        log = out / "log.txt"
        while not (log.exists() and "injected hang" in log.read_text()):
            ended = ex.wait_any(timeout_s=0.2)  # returns at once if the trial ended before its rank hung
            assert not ended, f"the trial ended before its rank reached the hang: {ended[0][1].reason}"
        cpu, wall = time.process_time(), time.monotonic()
        assert ex.wait_any(timeout_s=2.0) == []
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        assert wall >= 1.9 and cpu < 0.2 * wall, (cpu, wall)
        assert len(ranks_of(out)) == 1  # still hanging: closing the executor ends it
    finally:
        ex.close()
    end = time.monotonic() + 10  # the rank dies with its Ray worker (worker.die_with_parent)
    while ranks_of(out) and time.monotonic() < end:
        time.sleep(0.2)
    assert not ranks_of(out) and ticket


@pytest.fixture(scope="class")
def cluster():
    """Two Ray nodes of one CPU each on this machine, and an executor joined to them by address; with
    token authentication, as autotune's own local cluster (the executor joins with RAY_AUTH_MODE=token)."""
    ray_auth.secure_local_cluster()
    rc = RayCluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 256 << 20},
    )
    rc.add_node(num_cpus=1, object_store_memory=256 << 20)
    ex = RayExecutor(parse_gpus("2x1xcpu"), ray_address=rc.address)
    yield ex
    ex.close()
    rc.shutdown()


class TestTwoNodes:
    def test_two_rank_trial_spreads_over_both_nodes(self, cluster, tmp_path):
        two = parse_gpus("2x1xcpu")
        assert cluster.slots() == 1
        ticket = cluster.submit(request(two, tmp_path / "two"))
        results, _ = wait_all(cluster, 1)
        res = results[ticket]
        assert res.status == "ok", res.reason + res.log_tail
        assert len(set(res.nodes)) == 2  # STRICT_SPREAD: one rank on each Ray node
        # the same model on both ranks: the same steady peak (tests/steady.py) but for the few bytes of
        # scalars that gloo's threads free a moment earlier or later (trial/launch.py
        # LEAK_TOLERANCE_BYTES; a CI run: 17,678,248 and 17,678,252 B)
        a, b = (min(steps) for steps in per_rank_steps(res).values())
        assert abs(a - b) <= 256, per_rank_steps(res)
        assert res.losses[-1] < res.losses[0]
        assert not ranks_of(tmp_path)

    def test_killed_ray_worker_gives_crashed_and_no_orphans(self, cluster, tmp_path):
        two, out = parse_gpus("2x1xcpu"), tmp_path / "kill"
        ticket = cluster.submit(request(two, out, fault="hang"))  # rank 0 hangs, rank 1 waits on it
        log, end = out / "log.txt", time.monotonic() + 90
        while not (log.exists() and "injected hang" in log.read_text()) and time.monotonic() < end:
            time.sleep(0.2)  # mid-trial: both ranks built the model and trained the warm-up step
        assert len(ranks_of(out)) == 2
        rank0 = next(p for p in ranks_of(out) if p.environ().get("RANK") == "0")
        ray_worker_of(rank0).kill()  # the Ray worker running node 0's launcher
        results, _ = wait_all(cluster, 1, limit_s=60)
        res = results[ticket]
        assert res.status == "crashed" and "Ray worker lost: node 0" in res.reason
        deadline = time.monotonic() + 10  # node 1's task is cancelled; its rank dies with its worker
        while ranks_of(out) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ranks_of(out)
