"""Spawning a trial's process group, watching it, killing it, and classifying what happened.

`run_trial(request)` runs one trial here; `run_trials(requests)` runs several configs one after the
other inside ONE process group (one spawn, one import of torch and DeepSpeed), each measured on its
own. A config that kills its group (crash, timeout, an exception on one rank) is recorded and a new
group is started for the configs after it. `run_node` is the per-node half that the Ray executor
also uses for multi-node trials.

The ranks of a group share one new process group (rank 0 leads it, the others join it), so one
killpg reaches every rank and whatever they started; the ranks also die with their launcher
(worker.die_with_parent). Nothing here polls files: the ranks' stdout carries
their log and the `@@autotune start/done I` markers, read by one thread per rank.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from torch.distributed import TCPStore

from autotune.deepspeed_config import deepspeed_config
from autotune.parallel import data_parallel_size
from autotune.trial.record import NodeOutcome, RankReport, TrialRequest, TrialResult
from autotune.trial.threads import cpu_threads_per_rank
from autotune.trial.worker import EXIT_ABANDON, MARK
from autotune.units import TFLOPS, GiB

LOG_TAIL_LINES = 40
RSS_ALLOWANCE_BYTES = 2 * GiB
"""Hard guard: a rank whose resident memory exceeds the cap plus this is killed as `oom`. The
runtime itself (Python, torch, DeepSpeed, gloo) is ~0.25 GiB resident after import (measured:
psutil rss after `import torch, deepspeed`); the rest is headroom for the allocator's cache."""
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW")
"""Variables of the driver's shell that reach every rank on every node, as DeepSpeed's launcher exports them
(deepspeed/launcher/runner.py EXPORT_ENVS + the CUDA accelerator's export_envs(): NCCL), plus the lines of
`.deepspeed_env` (DEEPSPEED_ENVIRONMENT_PATHS: the home folder, then the current one; DS_ENV_FILE renames it)."""
POLL_S = 0.5
LEAK_TOLERANCE_BYTES = 64 * 1024
"""Growth of the per-step peak (or end-of-step live bytes) that flags a leak. Measured: on CPU the
same config's steps differ by up to ~100 bytes (scalars freed in gloo's threads a moment earlier
or later), so any growth past one small tensor's size is real."""
EXIT_GRACE_S = 60.0
"""How long ranks may take to leave after their last config (destroy_process_group, exit)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host` (the OS picks it); the rendezvous binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOOPBACK = "127.0.0.1"


def loopback_store(world_size: int) -> tuple[TCPStore, int]:
    """A single-node group's rendezvous store on 127.0.0.1 only, and its port (the OS picks it as it binds).
    Left to torch, rank 0 hosts it on every interface whatever MASTER_ADDR says (measured: docs/security.md);
    the launcher hosts it on a bound socket (`master_listen_fd`) and the ranks only connect
    (TORCHELASTIC_USE_AGENT_STORE=True: torch/distributed/rendezvous.py `_create_c10d_store`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # detach: the store owns the descriptor and closes it when deleted (measured: os.fstat on it after
    # `del store` fails with EBADF), so the socket object must not close it a second time.
    return TCPStore(
        LOOPBACK, port, world_size=world_size, is_master=True, master_listen_fd=sock.detach(), wait_for_workers=False
    ), port


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (`lo` on Linux, `lo0` on macOS)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    return "lo"


def exported_env(environ: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, str]:
    """What the driver sends to every rank of every node (EXPORT_PREFIXES, `.deepspeed_env`); the Ray executor gives it
    to Ray as the job's runtime_env, so that a remote node's workers, started by another shell, have it too."""
    environ = os.environ if environ is None else environ
    out = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    for folder in (Path.home(), cwd or Path.cwd()):  # runner.py: later files win, as its add_export calls do
        path = folder / name
        if path.is_file():
            for line in path.read_text().splitlines():
                if "=" in line and not line.lstrip().startswith("#"):
                    key, value = line.split("=", 1)
                    out[key.strip()] = value.strip()
    return out


def rss_cap(cluster, local_ranks: int, node_ram_bytes: int | None = None) -> int:
    """The resident-memory cap of one rank (the hard guard adds RSS_ALLOWANCE_BYTES). CPU ranks: the per-rank cap the
    trial is measured against (their device is the host). GPU ranks: this node's RAM shared by its ranks, whatever
    the GPU holds: offloaded states live in host RAM (about 16 B per parameter per rank with offload_optimizer,
    autotune/memory/host.py), and device memory is no part of a process's RSS."""
    if cluster.gpu.is_cpu:
        return cluster.capacity_bytes
    ram = node_ram_bytes or psutil.virtual_memory().total
    return max(1, ram // max(1, local_ranks) - RSS_ALLOWANCE_BYTES)


def prepare(req: TrialRequest) -> None:
    """The trial's folder with the configs it will run; stale per-rank files removed."""
    out = Path(req.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("rank*.json"), out / "log.txt", out / "result.json"]:
        old.unlink(missing_ok=True)
    write_deepspeed_json(req)
    config = {
        "config": req.config.to_dict(),
        "model": vars(req.model),
        "cluster": {
            "text": req.cluster.text,
            "num_nodes": req.cluster.num_nodes,
            "gpus_per_node": req.cluster.gpus_per_node,
            "gpu": vars(req.cluster.gpu),
            "capacity_bytes": req.cluster.capacity_bytes,
        },
        "steps": req.steps,
        "warmup_steps": req.warmup_steps,
        "timeout_s": req.timeout_s,
        "fault": req.fault,
        "trial_id": req.trial_id,
        "optimizer_impl": req.optimizer_impl,
        "dry_run": req.dry_run,
        "script": req.script.to_attrs() if req.script else None,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))


def write_deepspeed_json(req: TrialRequest) -> Path:
    """The trial's `deepspeed_config.json`: the JSON its ranks run (deepspeed_config), or the one a script trial's
    script gets (autotune.trial.script.script_config)."""
    if req.script is not None:
        from autotune.trial.script import script_config

        ds = script_config(req)
    else:
        ds = deepspeed_config(req.config, req.model, req.cluster, req.optimizer_impl)
    path = Path(req.out_dir, "deepspeed_config.json")
    path.write_text(json.dumps(ds, indent=2))
    return path


class Group:
    """The local ranks of one process group, started at config `start` of `requests`."""

    def __init__(
        self,
        requests: list[TrialRequest],
        start: int,
        *,
        node_rank: int,
        num_nodes: int,
        master_addr: str,
        master_port: int,
        threads: int | None,
        local_only: bool = False,
        gpu_ids: list[str] | None = None,
    ):
        self.requests, self.events = requests, queue.Queue()
        cluster = requests[0].cluster
        # One node runs gpus_per_node ranks of a multi-node trial; alone, it runs them all.
        self.local = cluster.gpus_per_node if num_nodes > 1 else cluster.world_size
        self.rss_cap = rss_cap(cluster, self.local)
        world = cluster.world_size
        payload = Path(requests[start].out_dir, "payload.pkl")
        payload.write_bytes(pickle.dumps(requests))
        # A script trial's ranks run the user's script (one request per group: the script ends with its run); a dry
        # run's rank plan is the worker's either way
        script = requests[start].script if not requests[start].dry_run else None
        if script is not None and not Path(requests[start].out_dir, "deepspeed_config.json").exists():
            write_deepspeed_json(requests[start])  # a node of several, whose folder the driver did not write
        module = "autotune.trial.script_rank" if script is not None else "autotune.trial.worker"
        threads = threads or cpu_threads_per_rank(self.local)
        self.procs: list[subprocess.Popen] = []
        self.ranks: list[int] = []
        self.exited: dict[int, int] = {}
        self.current = [start] * self.local
        self.lock = threading.Lock()
        self.t_spawn = time.monotonic()
        for lr in range(self.local):
            rank = node_rank * self.local + lr
            self.ranks.append(rank)
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(lr),
                "LOCAL_WORLD_SIZE": str(self.local),
                "MASTER_ADDR": master_addr,
                # DeepSpeed's CPU accelerator counts devices from LOCAL_SIZE, as its own launcher
                # sets it; unset, it runs `numactl --hardware` on every call (measured: 93 calls in a 3-step ZeRO-3 trial).
                # The shared-memory comm op it would enable is switched off in the worker.
                "LOCAL_SIZE": str(self.local),
                "MASTER_PORT": str(master_port),
                "AUTOTUNE_START": str(start),
                "AUTOTUNE_THREADS": str(threads),
                "OMP_NUM_THREADS": str(threads),
                "AUTOTUNE_PARENT_PID": str(os.getpid()),
                "AUTOTUNE_RSS_CAP": str(self.rss_cap),
                "PYTHONUNBUFFERED": "1",
                # DeepSpeed's accelerator by the cluster, never inherited: a DS_ACCELERATOR=cpu left in the shell
                # (./run exported it) would make the engine's device `cpu` beside a CUDA batch and NCCL
                # (deepspeed/accelerator/real_accelerator.py get_accelerator reads the variable before it detects)
                "DS_ACCELERATOR": "cpu" if cluster.gpu.is_cpu else "cuda",
            }
            if gpu_ids is not None:
                # The GPUs Ray gave this node's task (ray.get_gpu_ids()), one per local rank, which selects its own with
                # LOCAL_RANK; as Ray Train gives a node's workers the union of their GPU ids
                # (ray/train/_internal/backend_executor.py _share_cuda_visible_devices)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
            if local_only:
                # The store is the launcher's (loopback_store). gloo's and NCCL's own sockets go on the loopback
                # interface too: left alone, gloo binds the address the host name resolves to (torch's
                # ProcessGroupGloo.cpp; 127.0.0.1 here only because /etc/hosts maps this host name there,
                # measured: `getent hosts $(hostname)`) and NCCL any interface but lo and docker* (NCCL's
                # documentation of NCCL_SOCKET_IFNAME), i.e. the network's.
                ifname = loopback_interface()
                env.update(TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname)
            group = _join_group(self.procs[0].pid if self.procs else 0)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, str(payload.resolve())],
                    env=env,
                    cwd=script.cwd if script is not None else None,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    **group,
                )
            )
            threading.Thread(target=self._read, args=(lr, rank), daemon=True).start()
        self.pids = [p.pid for p in self.procs]

    def _read(self, lr: int, rank: int) -> None:
        """Route rank `lr`'s output to the log of the config it is running; report its markers."""
        for raw in self.procs[lr].stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if MARK in line:
                event, index = line[line.index(MARK) :].split()[1:3]
                self.current[lr] = int(index)
                self.events.put((event, lr, int(index), time.monotonic()))
                continue
            if line:
                with self.lock, open(Path(self.requests[self.current[lr]].out_dir, "log.txt"), "a") as f:
                    f.write(f"[rank {rank}] {line}\n")
        self.events.put(("exit", lr, self.procs[lr].wait(), time.monotonic()))

    def rss_over(self, cap: int) -> str | None:
        for lr, pid in enumerate(self.pids):
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                continue
            if rss > cap + RSS_ALLOWANCE_BYTES:
                return (
                    f"hard guard: local rank {lr} resident memory {rss:,} bytes exceeds the cap "
                    f"{cap:,} + {RSS_ALLOWANCE_BYTES:,} allowed for the runtime; group killed"
                )
        return None

    def kill(self) -> list[int]:
        """SIGKILL the whole process group and any descendant that left it; the pids still alive.
        `exited` keeps the exit codes of the ranks that had ended before (not killed here)."""
        self.exited = {lr: p.poll() for lr, p in enumerate(self.procs) if p.poll() is not None}
        family = []
        for pid in self.pids:
            try:
                family += [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.pids[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait()
        return [
            pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        ]


def _join_group(pgid: int) -> dict:
    """Popen arguments putting the child in process group `pgid` (0: a new group it leads).

    A new group, not a new session: setpgid(2) cannot join a group of another session, and the
    group stays out of the terminal's foreground, so only the launcher decides when it dies.
    """
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": lambda: os.setpgid(0, pgid)}  # Python 3.10


def read_ranks(req: TrialRequest) -> dict[int, RankReport]:
    return {
        int(path.stem[4:]): RankReport.from_dict(json.loads(path.read_text()))
        for path in Path(req.out_dir).glob("rank*.json")
    }


def log_tail(req: TrialRequest, lines: int = LOG_TAIL_LINES, rank: int | None = None) -> str:
    """The last lines of log.txt; with `rank`, mostly that rank's (the one that failed first), whose
    traceback the other ranks' errors (a peer gone from a collective) would push out of the tail."""
    path = Path(req.out_dir, "log.txt")
    if not path.exists():
        return ""
    all_lines = path.read_text(errors="replace").splitlines()
    if rank is None:
        return "\n".join(all_lines[-lines:])
    own = [ln for ln in all_lines if ln.startswith(f"[rank {rank}] ")][-(lines * 3 // 4) :]
    return "\n".join(own + ["--- last lines of all ranks ---"] + all_lines[-(lines // 4) :])


def _parallel_runs(requests: list[TrialRequest]) -> list[list[TrialRequest]]:
    """`requests` cut where the tensor- or sequence-parallel degree changes, in order."""
    runs: list[list[TrialRequest]] = []
    degree = lambda r: (r.config.autotp_size, r.config.sequence_parallel_size)  # noqa: E731
    for req in requests:
        if runs and degree(runs[-1][-1]) == degree(req):
            runs[-1].append(req)
        else:
            runs.append([req])
    return runs


def run_node(
    requests: list[TrialRequest],
    *,
    node_rank: int = 0,
    num_nodes: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    threads: int | None = None,
    fresh: bool = True,
    gpu_ids: list[str] | None = None,
) -> list[NodeOutcome]:
    """Run `requests` on this node's ranks; one NodeOutcome per config.

    Single node: a config that kills the group is recorded and a new group (new port) starts at
    the next config. Several nodes: no restart (the other nodes cannot follow); what is left is
    recorded as not run. `fresh`: write each trial's folder anew (prepare); False when the caller
    (the Ray driver) has done so already. `master_addr`/`master_port` are rank 0's, for several nodes;
    one node always meets on 127.0.0.1 (loopback_store). `gpu_ids`: the node's GPUs Ray assigned (None: as
    CUDA_VISIBLE_DEVICES is here). A request without its optimizer_impl gets this node's (autotune.trial.ops).
    """
    if fresh:
        requests = [with_optimizer(r) for r in requests]
    if len(requests) > 1 and any(r.script is not None for r in requests):
        # a script's run ends its ranks (DeepSpeed's autotuning exit): one process group per script trial
        return [o for r in requests for o in run_node([r], threads=threads, fresh=fresh, gpu_ids=gpu_ids)]
    if num_nodes == 1 and len(runs := _parallel_runs(requests)) > 1:
        # DeepSpeed keeps its tensor-parallel groups for the life of the process (utils/groups.py
        # _init_tp_mesh_device returns early once _TENSOR_MODEL_PARALLEL_GROUP is set, and ZeRO then uses
        # its data-parallel group), and its Ulysses groups too (sequence_parallel/parallel_state_sp.py keeps them
        # in module globals, and transformers' ALL_ATTENTION_FUNCTIONS keeps the wrapped attention): each
        # (tp, sp) degree runs in a process group of its own.
        return [o for run in runs for o in run_node(run, threads=threads, fresh=fresh, gpu_ids=gpu_ids)]
    for req in requests:
        if fresh:
            prepare(req)
        else:
            Path(req.out_dir).mkdir(parents=True, exist_ok=True)
    outcomes: list[NodeOutcome | None] = [None] * len(requests)
    i = 0
    while i < len(requests):
        store = None
        if num_nodes > 1:
            addr, port = master_addr, master_port
        else:
            store, port = loopback_store(requests[0].cluster.world_size)
            addr = LOOPBACK
        group = Group(
            requests,
            i,
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=addr,
            master_port=port,
            threads=threads,
            local_only=store is not None,
            gpu_ids=gpu_ids,
        )
        try:
            i = _watch(group, requests, i, outcomes)
        except BaseException:  # KeyboardInterrupt in a caller that lives on: leave no rank behind
            group.kill()
            raise
        finally:
            store = None  # closes the store: its group is gone
        master_port = None
        if num_nodes > 1 and i < len(requests):
            for j in range(i, len(requests)):
                outcomes[j] = NodeOutcome(status="crashed", reason="not run: the group was killed by an earlier config")
            break
    return outcomes


def _watch(group: Group, requests: list[TrialRequest], i: int, outcomes: list) -> int:
    """Follow `group` from config i until it exits or is killed; returns the next config to run."""
    n = len(requests)
    t_ready, started, done, exited = group.t_spawn, {}, {}, set()
    while True:
        deadline = t_ready + (requests[i].timeout_s if i < n else EXIT_GRACE_S)
        try:
            event, lr, value, t = group.events.get(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
        except queue.Empty:
            event, t = None, time.monotonic()
        if event == "start":
            started[value] = t
        elif event == "done":
            done.setdefault(value, set()).add(lr)
            if value == i and len(done[i]) == group.local:
                outcomes[i] = _finish(requests[i], "", "", t - t_ready, started.get(i, t_ready) - t_ready)
                i, t_ready = i + 1, t
        elif event == "exit":
            exited.add(lr)
            if value == 0 and len(exited) < group.local:
                continue
            if value == 0 and i == n:
                outcomes[n - 1].timings_s["exit_s"] = t - t_ready
                return n
            left = group.kill()
            if i == n or (value == EXIT_ABANDON and outcomes[group.current[lr]] is not None):
                return i  # the failed config is recorded already (every rank reported it)
            status, reason, rank = _failure(requests[i], group, lr, value)
            reason += f"; process group killed{f', still alive: {left}' if left else ''}"
            return _record(requests, i, outcomes, status, reason, t - t_ready, rank)
        if time.monotonic() > deadline:
            left = group.kill()
            if i == n:
                return n
            reason = (
                f"timed out after {requests[i].timeout_s:g} s; process group {group.pids[0]} killed"
                f"{f', still alive: {left}' if left else ', no process left'}"
            )
            return _record(requests, i, outcomes, "timeout", reason, t - t_ready)
        if i < n and event is None and (guard := group.rss_over(group.rss_cap)):
            group.kill()
            return _record(requests, i, outcomes, "oom", guard, t - t_ready)


def with_optimizer(req: TrialRequest) -> TrialRequest:
    """`req` with the optimizer code this node runs it with, when it names none (autotune.trial.ops: found out once
    per process); SpecError (exit 2) for 8-bit AdamW without bitsandbytes."""
    if req.optimizer_impl is not None:
        return req
    import dataclasses

    from autotune.trial import ops

    facts = [ops.node_facts(not req.cluster.gpu.is_cpu)]
    return dataclasses.replace(req, optimizer_impl=ops.optimizer_impl(req.config, req.cluster, facts))


def _failure(req: TrialRequest, group: Group, lr: int, code: int) -> tuple[str, str, int]:
    """(status, reason, rank) of the first failure, when one rank's death makes its peers fail too:
    a rank that died on its own without a report (exit code, signal) first, else the earliest report."""
    died = {r: c for r, c in group.exited.items() if c not in (0, EXIT_ABANDON)}
    if died:
        lr, code = min(died.items())
    else:
        reports = [
            (d.time if d.time is not None else math.inf, r, d) for r, d in read_ranks(req).items() if d.status != "ok"
        ]
        if reports:
            _, rank, d = min(reports, key=lambda x: (x[0], x[1]))
            return d.status, f"rank {rank}: {d.reason}", rank
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return "crashed", f"rank {group.ranks[lr]} exited with {how}", group.ranks[lr]


def _record(requests, i: int, outcomes: list, status: str, reason: str, wall_s: float, rank: int | None = None) -> int:
    outcomes[i] = _finish(requests[i], status, reason, wall_s, 0.0, rank)
    return i + 1


def _finish(
    req: TrialRequest, status: str, reason: str, wall_s: float, spawn_s: float, rank: int | None = None
) -> NodeOutcome:
    return NodeOutcome(
        ranks=read_ranks(req),
        status=status,
        reason=reason,
        log_tail=log_tail(req, rank=rank),
        wall_s=wall_s,
        timings_s={"spawn_s": spawn_s},
    )


# ---- results --------------------------------------------------------------------------------
def _grows(xs: list[int], min_steps: int) -> bool:
    """At least min_steps values, never falling, ending more than LEAK_TOLERANCE_BYTES above the start."""
    return (
        len(xs) >= min_steps
        and xs[-1] - xs[0] > LEAK_TOLERANCE_BYTES
        and all(b >= a - LEAK_TOLERANCE_BYTES for a, b in zip(xs, xs[1:]))
    )


def leaks(step_peaks: list[int], step_ends: list[int]) -> bool:
    """Memory that grows step after step: the live bytes left at the end of each step grow, or the
    per-step peak grows over at least 3 steps. A single rise of the peak is not enough: with gloo,
    a communication buffer freed in gloo's thread a moment later can add its size to one step's peak
    (measured: +2 MiB in one of two steps, ZeRO-0 fp32 tiny-llama with 4 checkpointed layers)."""
    return _grows(step_ends, 2) or _grows(step_peaks, 3)


def aggregate(req: TrialRequest, outcome: NodeOutcome) -> TrialResult:
    """One TrialResult from the ranks' reports (rank 0 for per-step detail, max over ranks for peaks)."""
    ranks = [outcome.ranks[r] for r in sorted(outcome.ranks)]
    r0 = outcome.ranks.get(0, RankReport(status="crashed"))
    status, reason = outcome.status, outcome.reason
    if not status:
        bad = [d for _, d in sorted(outcome.ranks.items()) if d.status != "ok"]
        status, reason = (bad[0].status, bad[0].reason) if bad else ("ok", "")
    res = TrialResult(
        status=status,
        reason=reason,
        log_tail=outcome.log_tail,
        out_dir=str(req.out_dir),
        implementation=req.model.code_name,
        wall_s=outcome.wall_s + outcome.timings_s.get("exit_s", 0.0),
        optimizer_impl=req.optimizer_impl or "",
    )
    if req.dry_run:
        res.rank_plans = {str(r): d.plan for r, d in sorted(outcome.ranks.items())}
        if status == "ok":
            res.status, res.source = "dry-run", "dry-run"
            res.reason = "dry run: placed and started, stopped before the first CUDA call; nothing measured"
        return res
    # fp16: a step DeepSpeed skipped for an overflow made no update, so it is faster than a real one: left out of the
    # step time, counted apart from the warm-up's (runtime/engine.py _take_model_step: skipped_steps += 1 on overflow)
    skipped = r0.step_skipped[req.warmup_steps :] if r0.step_skipped else []
    if r0.step_skipped:
        res.skipped_steps = [i for i, s in enumerate(skipped) if s]
        res.overflow_count = len(res.skipped_steps)
        res.warmup_overflow_count = sum(r0.step_skipped[: req.warmup_steps])
        res.step_loss_scales = r0.step_loss_scales
    timed = [d.step_times_s for d in ranks if d.step_times_s]
    if timed and len(timed) == len(ranks):
        cfg, world = req.config, req.cluster.world_size
        every = [max(ts) for ts in zip(*timed)]  # a step ends when its slowest rank does
        times = [t for i, t in enumerate(every) if not (i < len(skipped) and skipped[i])]
        if not times:
            if res.status == "ok":
                res.status = "diverged"
                res.reason = (
                    f"fp16: DeepSpeed skipped every measured step for an overflow (loss scale {r0.loss_scale} at the "
                    f"end): no update was timed"
                )
            times = every
        res.step_time_s = statistics.median(times)
        res.step_time_spread_s = max(times) - min(times)
        # the tp (or sp) ranks of a group train one micro batch: samples come from the world / (tp x sp)
        # data-parallel ranks (autotune/parallel.py data_parallel_size)
        res.samples_per_s = cfg.micro_batch * cfg.grad_accum * data_parallel_size(cfg, world) / res.step_time_s
        res.tokens_per_s = res.samples_per_s * cfg.seq_len
        peak = req.cluster.gpu.peak_flops(cfg.precision)
        # on GPUs the model FLOPs of MFU, as the simulated step counts them (an MoE's routed experts,
        # from its traced step); CPU ranks have no MFU and skip that trace on the search's hot path
        per_token = req.model.flops_per_token(cfg.seq_len)
        if peak and cfg.method == "full":
            from autotune.costmodel import model_flops_per_token

            per_token = model_flops_per_token(req.model, cfg, req.model.implementation)
        res.tflops = per_token * res.tokens_per_s / world / TFLOPS
        res.mfu = res.tflops * TFLOPS / peak if peak else None
        res.overhead_s = res.wall_s - sum(every)
    if ranks and all(d.peak_bytes is not None for d in ranks):
        res.peak_bytes_per_rank = [d.peak_bytes for d in ranks]
        res.peak_bytes = max(res.peak_bytes_per_rank)
        res.init_peak_bytes = max(d.init_peak_bytes for d in ranks)
        res.param_bytes_per_rank = [d.param_bytes for d in ranks]
    res.step_peak_bytes, res.step_end_bytes = r0.step_peak_bytes, r0.step_end_bytes
    res.leak = leaks(res.step_peak_bytes, res.step_end_bytes)
    res.phase_peak_bytes, res.baseline_bytes = r0.phase_peak_bytes, r0.baseline_bytes
    res.reserved_bytes = max((d.reserved_bytes or 0 for d in ranks), default=0) or None
    res.losses, res.loss_scale = r0.losses, r0.loss_scale
    if not r0.step_skipped:
        res.overflow_count = r0.overflow_count
    res.timings_s = _timings(outcome, r0)
    if req.script is not None:  # samples and tokens from the script's engine, the per-rank cap held here
        from autotune.trial.script import finish

        res = finish(req, res, ranks)
    return res


def _timings(outcome: NodeOutcome, r0: RankReport) -> dict[str, float]:
    t = dict(outcome.timings_s)
    w = r0.timings
    if w and "init_s" in w:  # a script that failed before deepspeed.initialize has its setup only
        measured = sum(r0.step_times_s)
        t.update(
            setup_s=w["setup_s"],
            build_s=w["build_s"],
            initialize_s=w["init_s"] - w["build_s"],
            warmup_s=w["train_s"] - measured,
            measured_s=measured,
            profiler_stop_s=w["profiler_stop_s"],
            analysis_s=w["analysis_s"],
            teardown_s=w["teardown_s"],
        )
    return t


def write_result(req: TrialRequest, res: TrialResult, outcome: NodeOutcome) -> None:
    """result.json and memory_per_step.json (every rank) in the trial's folder."""
    out = Path(req.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_rank = {
        str(r): {
            k: getattr(d, k)
            for k in (
                "step_peak_bytes",
                "step_end_bytes",
                "phase_peak_bytes",
                "init_peak_bytes",
                "peak_bytes",
                "baseline_bytes",
            )
        }
        for r, d in sorted(outcome.ranks.items())
    }
    (out / "memory_per_step.json").write_text(json.dumps({"leak": res.leak, "ranks": per_rank}, indent=2))
    (out / "result.json").write_text(json.dumps(res.to_dict(), indent=2, default=str))


def run_trials(requests: list[TrialRequest], *, threads: int | None = None) -> list[TrialResult]:
    """Run configs one after the other in one local process group; one TrialResult per request.

    All requests need the same world size. Peaks are relative to the live bytes before each
    config's model is built, so nothing left over from an earlier config counts.
    """
    if len({r.cluster.world_size for r in requests}) > 1:
        raise ValueError("run_trials: every request must have the same world size (one process group)")
    results = []
    for req, outcome in zip(requests, run_node(requests, threads=threads)):
        res = aggregate(req, outcome)
        write_result(req, res, outcome)
        results.append(res)
    return results


def run_trial(request: TrialRequest, *, threads: int | None = None) -> TrialResult:
    """One trial on this machine: spawn, measure, tear down; never hangs past request.timeout_s."""
    return run_trials([request], threads=threads)[0]
