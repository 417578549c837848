"""Trials placed by Ray: local Ray started quietly, or a cluster joined by address.

A trial of N ranks on `num_nodes` nodes asks for one placement-group bundle per node (that node's
GPUs, or one CPU per CPU rank) with STRICT_SPREAD across nodes (PACK for one node). One Ray task per
bundle runs that node's ranks with autotune.trial.launch.run_node; for several nodes a first task
on bundle 0 picks rank 0's address and a free port there, and every node task receives them as an
argument. Results come back as task return values (ray.wait), never as files to poll.

A Ray worker that dies mid-trial surfaces as a RayError on its task: the trial is `crashed`, the
other node tasks of that trial are cancelled (force), and their ranks die with them
(autotune.trial.worker.die_with_parent). Tasks are never retried: a retried trial would measure twice.

What each rank gets is what Ray Train's TorchTrainer gives its workers (ray/train/torch/config.py
_TorchBackend.on_start, _set_torch_distributed_env_vars; ray/train/_internal/backend_executor.py
_share_cuda_visible_devices) and DeepSpeed's launcher its ranks (deepspeed/launcher/runner.py, launch.py):
- RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; MASTER_ADDR/MASTER_PORT from rank 0's node (Ray Train:
  worker 0's get_address_and_port); NCCL when the ranks have GPUs, gloo otherwise (Ray Train's backend choice);
- CUDA_VISIBLE_DEVICES: the GPUs Ray assigned the node's task, so trials running side by side get disjoint ones;
- DS_ACCELERATOR by the cluster (cuda or cpu), never what the driver's shell had (autotune/trial/launch.py);
- NCCL_*, UCX_*, MV2_*, PYTHON*, MLFLOW* of the driver's shell and `.deepspeed_env` (DeepSpeed's EXPORT_ENVS), as the
  job's runtime_env, so a node started by another shell gets them too;
- OMP_NUM_THREADS and torch threads: the CPUs the trial holds on its node per rank (Ray sets OMP_NUM_THREADS to a
  task's CPUs: ray/_private/utils.py set_omp_num_threads_if_unset), counted on the nodes that have the GPUs.
Before any trial, every node that can hold one answers once what it can run (autotune.trial.ops): FusedAdam or torch's
fused AdamW, bitsandbytes, its RAM; on a real run (not a dry run) also the GPUs torch sees there, which must be the
ones --gpus names, and their memory, which becomes the capacity when it is below the preset's.

A dry run (`dry_run=True`, `autotune search --dry-run`) starts Ray with the cluster's GPUs declared (Ray accepts
GPU resources a machine does not have), places each trial and starts its ranks with their environment; the ranks
stop before the first CUDA call and report what they would run with (TrialResult.rank_plans).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from autotune.errors import SpecError
from autotune.executors import ray_auth
from autotune.executors.base import Executor
from autotune.hardware import Cluster
from autotune.trial import launch, ops
from autotune.trial.record import NodeOutcome, TrialRequest, TrialResult
from autotune.trial.threads import cpu_threads_per_rank
from autotune.units import GiB

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
    gpu_ids = None if req.cluster.gpu.is_cpu else [str(g) for g in ray.get_gpu_ids()]
    outcome = launch.run_node(
        [req],
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=port,
        threads=threads,
        fresh=False,
        gpu_ids=gpu_ids,
    )[0]
    outcome.task_start, outcome.task_end = t0, time.time()
    outcome.node_id = ray.get_runtime_context().get_node_id()
    return outcome


_rendezvous_task = ray.remote(_rendezvous)
_node_task = ray.remote(_node)
_facts_task = ray.remote(ops.node_facts)
_device_task = ray.remote(ops.device_memory)


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


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
        dry_run: bool = False,
    ):
        self.cluster, self.concurrent_trials, self.dry_run = cluster, concurrent_trials, dry_run
        self.source = "dry-run" if dry_run else "measured"
        self.notes: list[str] = []
        """What the executor found out about the cluster, one line each (said by `autotune search`)."""
        self.dry_runs: list[tuple[TrialRequest, TrialResult]] = []
        """A dry run's trials as they finished (dry_run_text shows them)."""
        self._trials: dict[str, _Trial] = {}
        self._connected = False
        self._local_cluster = None
        if not ray.is_initialized():
            self._start(ray_address, num_cpus)
        try:
            self._survey()
        except BaseException:
            self.close()
            raise

    def _start(self, ray_address: str | None, num_cpus: int | None) -> None:
        # ray.init replaces the driver's SIGTERM handler with its own `sys.exit(15)` (ray/_private/
        # worker.py, `init`): the search's own handler (cli/search.py: SIGTERM ends a search as Ctrl-C
        # does, its running trials recorded as interrupted) is put back once Ray is up.
        on_sigterm = signal.getsignal(signal.SIGTERM)
        # Quiet and fast: no usage stats, no dashboard. Authentication stays on (docs/security.md).
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # The job's environment on every node, remote ones included (DeepSpeed's EXPORT_ENVS, .deepspeed_env)
        exported = launch.exported_env()
        job = {"runtime_env": {"env_vars": exported}} if exported else {}
        quiet = dict(logging_level="warning", log_to_driver=False)
        c = self.cluster
        if ray_address:
            ray_auth.warn_if_joining_without_token(ray_address)
            try:
                ray.init(address=ray_address, **quiet, **job)
            except ConnectionError as e:
                raise SpecError(f"--ray-address {ray_address}: {str(e).strip().splitlines()[0]}") from None
        else:
            # address="local": always a new local cluster, never a stray one this machine still runs
            # (ray.init() alone would join it and then refuse num_cpus). It listens on every interface:
            # the token is what keeps others out, so it is on and owner-only before Ray starts.
            ray_auth.secure_local_cluster()
            cpus, gpus = num_cpus or os.cpu_count(), None
            if self.dry_run and not c.gpu.is_cpu:
                # the cluster's GPUs declared on this machine (Ray takes GPU resources as given, present or not), as
                # many as the concurrent trials fill, and a CPU per rank at least, so that each trial can be placed
                gpus = c.gpus_per_node * self.concurrent_trials
                cpus = max(cpus, gpus)
                self.notes.append(
                    f"dry run: a local Ray cluster of {c.num_nodes} node(s) with {gpus} GPU(s) and {cpus} CPU(s) "
                    f"declared each (this machine has {os.cpu_count()} CPUs)"
                )
            if self.dry_run and c.num_nodes > 1:
                # one local Ray node per cluster node, so that STRICT_SPREAD places the trial as on the real cluster
                from ray.cluster_utils import Cluster as LocalNodes

                node = dict(num_cpus=cpus, num_gpus=gpus or 0, object_store_memory=OBJECT_STORE_BYTES)
                self._local_cluster = LocalNodes(
                    initialize_head=True, head_node_args={**node, "include_dashboard": False}
                )
                for _ in range(c.num_nodes - 1):
                    self._local_cluster.add_node(**node)
                ray.init(address=self._local_cluster.address, **quiet, **job)
            else:
                ray.init(
                    address="local",
                    num_cpus=cpus,
                    num_gpus=gpus,
                    include_dashboard=False,
                    object_store_memory=OBJECT_STORE_BYTES,
                    **quiet,
                    **job,
                )
        self._connected = True
        if threading.current_thread() is threading.main_thread() and on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)

    def _capable(self) -> list[dict]:
        """The alive nodes that can hold one node's share of a trial: the GPU nodes (with at least gpus_per_node
        GPUs) for GPUs, every node for CPU ranks."""
        alive = [n for n in ray.nodes() if n["Alive"]]
        if self.cluster.gpu.is_cpu:
            return alive
        return [n for n in alive if n["Resources"].get("GPU", 0) >= self.cluster.gpus_per_node]

    def _survey(self) -> None:
        """Before any trial: the nodes that can hold the trials, their CPUs per rank, what each can run
        (autotune.trial.ops.node_facts), and on a real GPU run the devices each has."""
        c = self.cluster
        nodes = self._capable()
        if len(nodes) < c.num_nodes:
            have = sorted(int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"])
            raise SpecError(
                f"--gpus {c.text or c.describe()} needs {c.num_nodes} Ray node(s) with {c.gpus_per_node} "
                f"{'CPU' if c.gpu.is_cpu else 'GPU'}(s) each; the Ray cluster has {len(nodes)} (GPUs per node: {have})"
            )
        # threads from the nodes that run ranks: a CPU-only head node must not give GPU ranks one thread
        cores = min(int(n["Resources"].get("CPU", 1)) for n in nodes)
        self.cpus_per_rank = cpu_threads_per_rank(c.gpus_per_node, self.concurrent_trials, cores)
        self.node_facts: dict[str, dict] = {}
        if c.gpu.is_cpu:
            return  # CPU ranks run torch's AdamW and nothing else to ask (autotune.deepspeed_config)
        refs = [_facts_task.options(num_cpus=0, scheduling_strategy=_on(n["NodeID"])).remote() for n in nodes]
        self.node_facts = dict(zip((n["NodeID"] for n in nodes), ray.get(refs)))
        facts = list(self.node_facts.values())
        self.notes.append(ops.optimizer_reason(facts))
        if self.dry_run:
            self.notes.append(
                f"capacity: {c.capacity_bytes / GiB:.2f} GiB per device from --gpus (a real run reads each node's "
                f"devices with torch; a dry run makes no CUDA call)"
            )
            return
        self._check_devices(nodes)

    def _check_devices(self, nodes: list[dict]) -> None:
        """The GPUs torch sees on each node, read by one short task per node holding one GPU, in a worker that exits
        after (it makes a CUDA context); devices_seen decides."""
        refs = [
            _device_task.options(num_gpus=1, num_cpus=0, max_calls=1, scheduling_strategy=_on(n["NodeID"])).remote()
            for n in nodes
        ]
        self.cluster, note = devices_seen(self.cluster, nodes, ray.get(refs))
        if note:
            self.notes.append(note)

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
        # one optimizer for every rank of every node, the one all of them can run (autotune.trial.ops)
        impl = request.optimizer_impl or ops.optimizer_impl(request.config, c, list(self.node_facts.values()))
        request = dataclasses.replace(request, optimizer_impl=impl, dry_run=request.dry_run or self.dry_run)
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
        if req.dry_run:
            res.rank_plans = {
                **res.rank_plans,
                **{
                    f"node{i}": {"ray_node": o.node_id, "placement_s": o.task_start - tr.submitted}
                    for i, o in enumerate(outcomes)
                },
            }
            self.dry_runs.append((req, res))
        launch.write_result(req, res, merged)
        return res

    def dry_run_text(self) -> str:
        """A dry run's trials, each with its rank plan: what `autotune search --dry-run` prints."""
        lines = [
            "DRY RUN: nothing was measured, and no study was written. Each trial below was placed by Ray and its ranks "
            "were started with their environment; they stopped before the first CUDA call.",
            *(f"  {n}" for n in self.notes),
        ]
        cols = [
            ("RANK", "rank"),
            ("LOCAL_RANK", "local"),
            ("WORLD_SIZE", "world"),
            ("MASTER", "master"),
            ("CUDA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
            ("accelerator", "DeepSpeed accel."),
            ("backend", "backend"),
            ("optimizer_impl", "optimizer"),
            ("threads", "threads"),
            ("host_ram_cap", "host-RAM cap"),
        ]
        for req, res in self.dry_runs:
            lines += ["", f"trial {req.trial_id}: {req.config.short()}, seq {req.config.seq_len} -> {res.status}"]
            if res.status != "dry-run":
                lines += [f"  {res.reason}", *(f"  | {ln}" for ln in res.log_tail.splitlines()[-10:])]
                continue
            ranks = [p for k, p in sorted(res.rank_plans.items(), key=lambda kv: kv[0]) if not k.startswith("node")]
            ranks.sort(key=lambda p: int(p.get("RANK") or 0))
            nodes = [p for k, p in sorted(res.rank_plans.items()) if k.startswith("node")]
            if ranks:
                lines.append(f"  DeepSpeed JSON: {ranks[0]['deepspeed_config']}")
                exported = ranks[0].get("exported") or {}
                lines.append(f"  exported to every rank: {', '.join(sorted(exported)) or 'none'}")
            lines.append(f"  Ray node(s): {', '.join(n['ray_node'][:12] for n in nodes)}")
            rows = [
                {
                    **p,
                    "MASTER": f"{p['MASTER_ADDR']}:{p['MASTER_PORT']}",
                    "host_ram_cap": f"{p['host_ram_cap_bytes'] / GiB:.1f} GiB",
                }
                for p in ranks
            ]
            width = [max(len(title), *(len(str(r.get(k, ""))) for r in rows)) for k, title in cols]
            lines.append("  " + "  ".join(t.ljust(w) for (_, t), w in zip(cols, width)))
            for r in rows:
                lines.append("  " + "  ".join(str(r.get(k, "")).ljust(w) for (k, _), w in zip(cols, width)))
        return "\n".join(lines)

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
        if self._local_cluster is not None:
            self._local_cluster.shutdown()
            self._local_cluster = None


def devices_seen(cluster: Cluster, nodes: list[dict], seen: list[dict]) -> tuple[Cluster, str]:
    """What the devices torch sees on each Ray node (autotune.trial.ops.device_memory) make of `cluster`: every node's
    must be --gpus' type (SpecError, exit 2, otherwise: a declared GPU that is not there, another model, the other
    memory size of its name), and the smallest total memory becomes the capacity when it is below the preset's (the
    preset is the driver's total, e.g. 81,920 MiB for an A100-80GB, where torch reports about 79.1-79.3 GiB, and the
    memory model's allowance for the CUDA context comes on top of what torch counts). Returns the cluster and a note."""
    from autotune.executors import PRESENT_MEMORY_FRACTION

    family = cluster.gpu.name.split("-")[0].lower()
    for n, d in zip(nodes, seen):
        where = f"Ray node {n['NodeManagerAddress']}"
        if not d["count"]:
            raise SpecError(
                f"{where} declares {int(n['Resources'].get('GPU', 0))} GPU(s) but torch sees no CUDA device there; "
                f"--gpus {cluster.text} needs real ones (or --dry-run)"
            )
        if family not in d["name"].lower() or d["total_bytes"] < PRESENT_MEMORY_FRACTION * cluster.gpu.memory_bytes:
            raise SpecError(
                f"{where} has {d['name']} ({d['total_bytes'] / GiB:.1f} GiB), not the {cluster.gpu.name} of "
                f"--gpus {cluster.text}; pass the GPUs the cluster has"
            )
    total = min(d["total_bytes"] for d in seen)
    if total >= cluster.capacity_bytes:
        return cluster, ""
    note = (
        f"capacity: {total / GiB:.2f} GiB per device as torch reports it on the cluster "
        f"(the preset's {cluster.capacity_bytes / GiB:.2f} GiB is the driver's total)"
    )
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, memory_bytes=total)), note


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
