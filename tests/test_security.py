"""Who may use what autotune starts (docs/security.md): the local Ray cluster runs tasks for the holder of
its token only, the token file is its owner's alone, and an environment that switches authentication
off is never obeyed silently; a single-node trial listens on loopback only. The slow tests are real: a real
local cluster and client process, a real trial; no mocks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import ray

from autotune import executors
from autotune.executors import ray_auth
from autotune.hardware import parse_gpus
from autotune.models import resolve_model
from autotune.train_config import TrainConfig
from autotune.trial import launch
from autotune.trial.record import TrialRequest

CLIENT = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="warning", log_to_driver=False)
print("result:", ray.get(ray.remote(lambda: 6 * 7).remote()), flush=True)
"""


def client(gcs: str, home, **env) -> subprocess.CompletedProcess:
    """A Python process sharing nothing with the search but the GCS address: its own empty home and
    none of this process's Ray settings; it joins the cluster and submits one task."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Ray retries a refused connection 20 times, ~1 s apart (ray/_private/ray_constants.py
    # NUM_REDIS_GET_RETRIES); 5 tell the same story sooner.
    base.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", RAY_NUM_REDIS_GET_RETRIES="5")
    return subprocess.run(
        [sys.executable, "-c", CLIENT, gcs], env={**base, **env}, capture_output=True, text=True, timeout=180
    )


@pytest.mark.slow
def test_local_cluster_runs_tasks_for_the_token_holder_only(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with executors.make("ray", parse_gpus("1xcpu")):  # the local cluster, as `autotune search` starts it
        gcs = ray.get_runtime_context().gcs_address
        token = ray_auth.token_file()
        assert token is not None and token.stat().st_mode & 0o777 == 0o600

        refused = client(gcs, home)  # no token anywhere: not in env, not in home
        out = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "result:" not in refused.stdout
        assert "InvalidAuthToken" in out, out[-3000:]  # the GCS said no, not the client
        why = next(line for line in out.splitlines() if "InvalidAuthToken" in line)
        print(f"\nclient without token -> {gcs}: exit {refused.returncode}\n{why}\n{out.strip().splitlines()[-1]}")
        assert not (home / ".ray").exists()  # and it did not make itself a token

        accepted = client(gcs, home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        print(f"client with the token -> {gcs}: exit {accepted.returncode}\n{accepted.stdout.strip()}")
        assert accepted.returncode == 0 and "result: 42" in accepted.stdout, accepted.stderr[-3000:]


def test_token_file_is_created_owner_only_and_an_open_one_is_tightened(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    path = tmp_path / "ray" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ray_auth.secure_local_cluster() == path
    assert os.environ["RAY_AUTH_MODE"] == "token"  # overridden, and said so
    assert "ignored: the local Ray cluster autotune starts listens on every" in capsys.readouterr().err
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text()) == 64
    first = path.read_text()

    path.chmod(0o644)  # as Ray itself writes it
    ray_auth.secure_local_cluster()
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == first
    assert "was readable by other users (mode 644)" in capsys.readouterr().err


def test_joining_with_auth_disabled_warns_once(monkeypatch, capsys):
    monkeypatch.setattr(ray_auth, "_warned_join", False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray_auth.warn_if_joining_without_token("10.0.0.5:6379")
    ray_auth.warn_if_joining_without_token("10.0.0.5:6379")
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "anyone who can reach its address can run any code" in err
    monkeypatch.setattr(ray_auth, "_warned_join", False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    ray_auth.warn_if_joining_without_token("10.0.0.5:6379")
    assert capsys.readouterr().err == ""


def listening_while(work, poll_s: float = 0.2) -> tuple[list, set]:
    """Run `work` in a thread and collect every TCP socket this process and its descendants listen
    on meanwhile: ([its result], {(ip, port)})."""
    done: list = []
    runner = threading.Thread(target=lambda: done.append(work()))
    runner.start()
    listening = set()
    while runner.is_alive():
        family = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            listening |= {
                (c.laddr.ip, c.laddr.port)
                for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.pid in family
            }
        except psutil.Error:  # a process that exits mid-listing
            pass
        time.sleep(poll_s)
    runner.join()
    return done, listening


@pytest.mark.slow
def test_single_node_trial_listens_on_loopback_only(tmp_path):
    """Every socket the launcher and its ranks listen on during a 2-rank trial is on 127.0.0.1 (left to
    torch, the rendezvous store listened on every interface)."""
    req = TrialRequest(
        model=resolve_model("tiny-llama"),
        cluster=parse_gpus("2xcpu"),
        config=TrainConfig(zero_stage=2, precision="bf16", seq_len=32),
        out_dir=tmp_path / "t",
        steps=3,
        warmup_steps=1,
        timeout_s=150.0,
    )
    done, listening = listening_while(lambda: launch.run_trial(req, threads=1))
    assert done and done[0].status == "ok", done and done[0].reason
    assert listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening


@pytest.mark.slow  # a real gloo probe (~6 s)
def test_the_cpu_priors_gloo_probe_listens_on_loopback_only():
    """cpu_prior.probe_gloo's two processes meet through a file and talk gloo on the loopback
    interface: every socket they listen on is on 127.0.0.1, and the probe says it measured."""
    from autotune.search import cpu_prior

    done, listening = listening_while(lambda: cpu_prior.probe_gloo.__wrapped__(2), poll_s=0.05)
    call_s, bus, source = done[0]
    assert source.startswith("probed now"), source
    assert 0 < call_s < 0.05 and bus > 1e7
    assert listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
