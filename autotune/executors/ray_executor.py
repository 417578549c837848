"""Trials placed by Ray: local Ray started quietly, or a cluster joined by address.

A trial of N ranks on `num_nodes` nodes asks for one placement-group bundle per node (that node's
GPUs, or one CPU per CPU rank) with STRICT_SPREAD across nodes (PACK for one node). One Ray task per
bundle runs that node's ranks with autotune.trial.launch.run_node; for several nodes a first task
on bundle 0 picks rank 0's address and a free port there, and every node task receives them as an
argument. Results come back as task return values (ray.wait), never as files to poll.

A Ray worker that dies mid-trial surfaces as a RayError on its task: the trial is `crashed`, the
other node tasks of that trial are cancelled (force), and their ranks die with them
(autotune.trial.worker.die_with_parent). Tasks are never retried: a retried trial would measure twice.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from autotune.errors import SpecError
from autotune.executors import ray_auth
from autotune.executors.base import Executor
from autotune.hardware import Cluster
from autotune.trial import launch
from autotune.trial.record import NodeOutcome, TrialRequest, TrialResult
from autotune.trial.threads import cpu_threads_per_rank

OBJECT_STORE_BYTES = 256 << 20
"""Results are a few KB: the smallest store Ray accepts comfortably. With it and the dashboard off,
local Ray starts in seconds (measured: 7 s from RayExecutor() to a first task's result, 2 busy cores)."""
GRACE_S = 30.0
"""Past request.timeout_s (counted from placement), the driver cancels a trial whose node tasks
have not answered: each node also enforces the timeout itself, so this only catches a lost node."""
POLL_S = 1.0


def _resources(cluster: Cluster, cpus_per_rank: int) -> dict[str, float]:
    """One node's share of a trial: its ranks' GPUs (and CPUs to drive them), or CPUs for CPU ranks."""
    n = cluster.gpus_per_node
    return {"CPU": n * cpus_per_rank} if cluster.gpu.is_cpu else {"GPU": n, "CPU": n * cpus_per_rank}


def _rendezvous() -> tuple[str, int]:
    """Runs on rank 0's node: that node's address and a port free there."""
    addr = ray.util.get_node_ip_address()
    return addr, launch.free_port(addr)


def _node(
    req: TrialRequest, node_rank: int, num_nodes: int, master: tuple[str, int] | None, threads: int
) -> NodeOutcome:
    """One node's ranks of one trial (run in a Ray worker); the per-node outcome, as a value."""
    t0 = time.time()
    addr, port = master or ("127.0.0.1", None)
    outcome = launch.run_node(
        [req],
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=port,
        threads=threads,
        fresh=False,
    )[0]
    outcome.task_start, outcome.task_end = t0, time.time()
    outcome.node_id = ray.get_runtime_context().get_node_id()
    return outcome


_rendezvous_task = ray.remote(_rendezvous)
_node_task = ray.remote(_node)


@dataclass
class _Trial:
    request: TrialRequest
    pg: PlacementGroup
    ready: ray.ObjectRef
    refs: list[ray.ObjectRef]
    submitted: float = field(default_factory=time.time)
    placed: float | None = None
    late: bool = False


class RayExecutor(Executor):
    """Runs real trials on Ray; as many at once as `slots()` says the cluster holds."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        ray_address: str | None = None,
        num_cpus: int | None = None,
        concurrent_trials: int = 1,
    ):
        self.cluster, self.concurrent_trials = cluster, concurrent_trials
        self._trials: dict[str, _Trial] = {}
        self._connected = False
        if not ray.is_initialized():
            # ray.init replaces the driver's SIGTERM handler with its own `sys.exit(15)` (ray/_private/
            # worker.py, `init`): the search's own handler (cli/search.py: SIGTERM ends a search as Ctrl-C
            # does, its running trials recorded as interrupted) is put back once Ray is up.
            on_sigterm = signal.getsignal(signal.SIGTERM)
            # Quiet and fast: no usage stats, no dashboard. Authentication stays on (docs/security.md).
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            if ray_address:
                ray_auth.warn_if_joining_without_token(ray_address)
                ray.init(address=ray_address, logging_level="warning", log_to_driver=False)
            else:
                # address="local": always a new local cluster, never a stray one this machine still runs
                # (ray.init() alone would join it and then refuse num_cpus). It listens on every interface:
                # the token is what keeps others out, so it is on and owner-only before Ray starts.
                ray_auth.secure_local_cluster()
                ray.init(
                    address="local",
                    num_cpus=num_cpus or os.cpu_count(),
                    include_dashboard=False,
                    object_store_memory=OBJECT_STORE_BYTES,
                    logging_level="warning",
                    log_to_driver=False,
                )
            self._connected = True
            if threading.current_thread() is threading.main_thread() and on_sigterm is not None:
                signal.signal(signal.SIGTERM, on_sigterm)
        # the smallest node's cores, split among the ranks of the trials that may share them
        cores = min(int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n["Alive"])
        self.cpus_per_rank = cpu_threads_per_rank(cluster.gpus_per_node, concurrent_trials, cores)

    def slots(self) -> int:
        """Trials of `self.cluster`'s shape that fit the cluster at once (counting every node), at most
        `concurrent_trials`."""
        need = _resources(self.cluster, self.cpus_per_rank)
        per_node = [min(int(n["Resources"].get(k, 0) // v) for k, v in need.items()) for n in ray.nodes() if n["Alive"]]
        return min(self.concurrent_trials, sum(per_node) // self.cluster.num_nodes)

    def submit(self, request: TrialRequest) -> str:
        c = request.cluster
        need = _resources(c, self.cpus_per_rank)
        fits = [n for n in ray.nodes() if n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in need.items())]
        if len(fits) < c.num_nodes:
            raise SpecError(
                f"Ray cluster cannot place {c.describe()}: it needs {c.num_nodes} node(s) with "
                f"{need} each, and {len(fits)} node(s) have that much"
            )
        launch.prepare(request)
        pg = placement_group([need] * c.num_nodes, strategy="STRICT_SPREAD" if c.num_nodes > 1 else "PACK")
        on = lambda i: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)  # noqa: E731
        gpus = 0 if c.gpu.is_cpu else c.gpus_per_node
        threads = self.cpus_per_rank
        if c.num_nodes == 1:
            master = None
        else:
            master = _rendezvous_task.options(num_cpus=0, max_retries=0, scheduling_strategy=on(0)).remote()
        refs = [
            _node_task.options(num_cpus=need["CPU"], num_gpus=gpus, max_retries=0, scheduling_strategy=on(i)).remote(
                request, i, c.num_nodes, master, threads
            )
            for i in range(c.num_nodes)
        ]
        ticket = f"trial-{request.trial_id if request.trial_id is not None else ''}-{uuid.uuid4().hex[:8]}"
        self._trials[ticket] = _Trial(request=request, pg=pg, ready=pg.ready(), refs=refs)
        return ticket

    def wait_any(self, timeout_s: float | None = None) -> list[tuple[str, TrialResult]]:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self._trials:
            done = [(t, self._finish(t)) for t in list(self._trials) if self._settled(t)]
            if done:
                return done
            left = POLL_S if end is None else min(POLL_S, end - time.monotonic())
            if left <= 0:
                return []
            # only what has not happened yet: a ref that is ready already (the placement group once placed,
            # a node that has finished) makes ray.wait return at once, and the loop then spins at half a core
            # (measured on 2 cores: the driver at 46-48% CPU through every trial, its ranks at 60-80% each)
            pending = [tr.ready for tr in self._trials.values() if tr.placed is None]
            pending += [
                r for tr in self._trials.values() for r in ray.wait(tr.refs, num_returns=len(tr.refs), timeout=0)[1]
            ]
            if pending:
                ray.wait(pending, num_returns=1, timeout=left)
            else:
                time.sleep(left)
        return []

    def _settled(self, ticket: str) -> bool:
        """Finished, failed on one node (the others are then cancelled), or past its deadline."""
        tr = self._trials[ticket]
        if tr.placed is None and ray.wait([tr.ready], timeout=0)[0]:
            tr.placed = time.time()
        ready, pending = ray.wait(tr.refs, num_returns=len(tr.refs), timeout=0)
        if not pending:
            return True
        if tr.placed is not None and time.time() > tr.placed + tr.request.timeout_s + GRACE_S:
            tr.late = True
        if tr.late or any(self._failed(r) for r in ready):
            for r in pending:
                ray.cancel(r, force=True)
            return True
        return False

    @staticmethod
    def _failed(ref: ray.ObjectRef) -> bool:
        try:
            return ray.get(ref, timeout=0).status not in ("", "ok")
        except ray.exceptions.RayError:
            return True

    def _finish(self, ticket: str) -> TrialResult:
        tr = self._trials.pop(ticket)
        req, outcomes, died, cancelled = tr.request, [], [], []
        for i, ref in enumerate(tr.refs):
            try:
                outcomes.append(ray.get(ref, timeout=10.0))
            except ray.exceptions.TaskCancelledError:
                cancelled.append(i)
            except (ray.exceptions.RayError, TimeoutError) as e:
                died.append(f"node {i}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
        remove_placement_group(tr.pg)
        merged = _merge(outcomes) if outcomes else NodeOutcome(log_tail=launch.log_tail(req))
        if tr.late:
            merged.status = "timeout"
            merged.reason = (
                f"no answer from the trial's Ray tasks {req.timeout_s + GRACE_S:g} s after placement; cancelled"
            )
        elif died:
            merged.status, merged.reason = "crashed", "Ray worker lost: " + "; ".join(died)
        if cancelled:
            merged.reason += f" (tasks of node(s) {cancelled} cancelled)"
        merged.log_tail = merged.log_tail or launch.log_tail(req)
        res = launch.aggregate(req, merged)
        if outcomes:
            res.nodes = [o.node_id for o in outcomes]
            res.timings_s["placement_s"] = min(o.task_start for o in outcomes) - tr.submitted
            in_task = max(o.task_end - o.task_start for o in outcomes)
            res.wall_s = time.time() - tr.submitted
            res.timings_s["ray_s"] = res.wall_s - res.timings_s["placement_s"] - in_task
            if res.step_time_s is not None:
                res.overhead_s = res.wall_s - res.timings_s.get("measured_s", 0.0)
        launch.write_result(req, res, merged)
        return res

    def close(self) -> None:
        """Cancel running trials (their ranks die with their Ray workers); stop Ray if we started it."""
        for tr in self._trials.values():
            for r in tr.refs:
                ray.cancel(r, force=True)
            remove_placement_group(tr.pg)
        self._trials.clear()
        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False


def _merge(outcomes: list[NodeOutcome]) -> NodeOutcome:
    """One trial outcome from its nodes' (global rank numbers are already distinct)."""
    bad = next((o for o in outcomes if o.status), outcomes[0])
    return NodeOutcome(
        ranks={r: d for o in outcomes for r, d in o.ranks.items()},
        status=bad.status,
        reason=bad.reason,
        log_tail=bad.log_tail or outcomes[0].log_tail,
        wall_s=max(o.wall_s for o in outcomes),
        timings_s=dict(outcomes[0].timings_s),
    )
