"""One prepared GPU check: what one GPU can tell about the CUDA path, through the same Ray executor `autotune search`
uses, in one call of at most 8 minutes, installs included.

    python3 benchmarks/gpu_check.py --out DIR                 on a GPU: install, pre-build ops, run
    python benchmarks/gpu_check.py --dry-run --out DIR        anywhere: plan, validate, write the plan
    python benchmarks/gpu_check.py --dry-run --ray --out DIR  anywhere: also place every trial on a local Ray with
                                                              the GPU declared and print each rank's plan
    python benchmarks/gpu_check.py --prepare-wheels           here, with the package index (once)

It verifies issue 52's findings (docs/gpu_check.md says how, and what only a real GPU shows):
  1 the ranks pick DeepSpeed's CUDA accelerator although the driver holds DS_ACCELERATOR=cpu (as ./run exported it);
  2 FusedAdam where the node can build it, torch's fused AdamW where not (one trial runs the fallback on purpose);
    the optimizer each trial ran is in its row;
  4 an offload trial on a 16 GiB cap needs more host RAM than cap + 2 GiB: the guard takes the node's RAM;
  5 fp16: steps skipped for an overflow are counted apart from the warm-up's and left out of the step time;
  6 the capacity is the device's total as torch reports it, read by the executor, not the preset's;
  7 NCCL_* of the driver's shell reach the ranks through Ray's runtime_env; threads from the GPU node;
  8 the OOM probe ends as `oom` with CUDA's error; no per-phase device sync (the step times show it).

Real trials of a Llama-style 1.1B model on one GPU (TinyLlama's shape), one process group each, placed by
autotune.executors.ray_executor.RayExecutor as a search places them: the baseline first, then the OOM probe (a micro
batch the memory model says cannot fit twice over: it must fail as `oom`, leaving no process behind), then the rest,
most telling first. Per trial, measured beside predicted: the allocator's peaks against the memory estimate,
samples/s against the cost model, the fp16 loss scale and skipped steps, the optimizer that ran. Results go row by
row to DIR/gpu_check.csv and DIR/summary.md, so a run cut short keeps what it has. Columns: docs/gpu_check.md.
Exit code: 0 the checks held (however large an error), 1 a check failed (the first trial did not run ok, a trial
crashed or timed out, the probe was not CUDA's `oom`, a rank was left), 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
# A bare GPU machine has no installed autotune: the ranks find it through PYTHONPATH as this does.
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

# TrialRequest and TrialResult are moving to autotune.trial: this is the one line to change then.
import gpu_check_install as setup  # noqa: E402
from gpu_check_run import Gauge, leftover, rows_for, write_summary  # noqa: E402

from autotune.costmodel import simulate  # noqa: E402
from autotune.deepspeed_config import deepspeed_config  # noqa: E402
from autotune.hardware import Cluster, parse_gpus  # noqa: E402
from autotune.memory import estimate  # noqa: E402
from autotune.models import ModelSpec, SpecError, from_shape  # noqa: E402
from autotune.train_config import TrainConfig, check_config  # noqa: E402
from autotune.trial.record import TrialRequest, TrialResult  # noqa: E402
from autotune.units import GiB  # noqa: E402

FINDINGS = (
    "verifies issue 52's findings 1 (ranks pick CUDA though the shell holds DS_ACCELERATOR=cpu), 2 (FusedAdam or "
    "torch's fused AdamW, both run), 4 (host-RAM guard from the node: an offload trial past its 16 GiB cap), 5 (fp16 "
    "skipped steps counted apart, not timed), 6 (capacity from the device), 7 (NCCL_* through Ray's runtime_env), 8 "
    "(CUDA oom classified, no per-phase sync); not 3 (bitsandbytes is not installed here); docs/gpu_check.md"
)
"""The check's first printed line (and summary.md's), as the docstring says it."""
MODEL_SHAPE = dict(
    num_layers=22,
    hidden_size=2048,
    num_heads=32,
    num_kv_heads=4,
    ffn_hidden_size=5632,
    vocab_size=32000,
    max_seq_len=2048,
)
MODEL_SOURCE = (
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json (Hugging Face Hub): "
    "LlamaForCausalLM, 22 layers, hidden 2048, 32 heads, 4 kv heads, intermediate 5632, "
    "vocab 32000, 2048 positions, untied head; 1,100,048,384 parameters"
)
IMPLEMENTATION: str | None = None
"""None: whatever ModelSpec builds by default. Once ModelSpec carries an implementation choice,
name one here (e.g. "hf") to pin it; model_spec() applies it, the plan reports it."""
SEQ_LEN = 2048
"""TinyLlama's max_position_embeddings, the context it was pre-trained with."""
TRIALS = (
    # (zero, precision, checkpointed layers (-1: every one), micro batch, what else, why)
    (0, "bf16", 0, 1, "", "baseline: the CUDA accelerator, NCCL, the optimizer node 0 can run (findings 1, 2, 7)"),
    (0, "fp16", 0, 1, "", "fp16: skipped steps counted apart and left out of the step time (finding 5)"),
    (2, "bf16", -1, 1, "offload", "optimizer offloaded to host RAM past the 16 GiB cap + 2 GiB (finding 4)"),
    (3, "bf16", 0, 1, "", "ZeRO-3 partitions as it builds"),
    (0, "bf16", 0, 1, "fallback", "the other optimizer of finding 2 on the same config as the baseline"),
    (3, "fp16", -1, 4, "", "ZeRO-3 fp16, every layer checkpointed, micro batch 4"),
    (0, "bf16", -1, 4, "", "every layer checkpointed, micro batch 4"),
)
"""The trials after the baseline and the OOM probe, in order: each one a config of its own (world size 1)."""
OFFLOAD_CAP = "16GiB"
"""The offload trial's per-device cap (--gpus 1xGPU@16GiB): its host memory, ~17.6 GB of fp32 master, Adam moments and
fp32 gradients for 1.1B parameters (autotune/memory/host.py) plus the CUDA runtime, is past this cap + 2 GiB, where
the old RSS guard (the GPU's capacity) killed it as `oom`; the node's RAM is the guard's cap now."""
OOM_MARGIN = 2.0
"""The OOM probe's micro batch needs at least this multiple of the GPU's memory by the estimate:
the estimate's GPU error is what this check measures, so the probe must fail even if it is off by
half; past it the first activations already fail to allocate."""
STEPS, WARMUP_STEPS = 8, 2
"""TrialRequest's defaults are 6 and 2; 8 measured steps cost under 2 s here (the cost model gives
0.05-0.21 s per step) and give the fp16 loss scale more steps to move."""
TRIAL_TIMEOUT_S = 150.0
"""Per trial: a rank's spawn and imports, build + initialize of 1.1B parameters (ZeRO-3 partitions it as it is built;
the offload trial first builds DeepSpeed's cpu_adam op) and 10 steps; generous, so that only a hang reaches it."""
BUDGET_S = 450.0
"""Issue #15: within 8 minutes (480 s) from a cold start, installs included. No trial starts after
BUDGET_S - MIN_TRIAL_S = 420 s, and a trial takes about half a minute, so the run ends near 8 minutes at worst."""
MIN_TRIAL_S = 30.0
"""No trial starts with less left: its rank's spawn (python, torch, DeepSpeed) is expected to take 10 s on a GPU
host, building and stepping the model as much again (expectations: no GPU has run this yet)."""
DRY_RUN_GPUS = "1xH200"
"""The GPU lent to this project (autotune/data/gpus.yaml has its preset)."""


@dataclass(frozen=True, kw_only=True)
class Planned:
    """One trial of the plan, in the order it runs."""

    order: int
    name: str
    role: str
    """'trial', or 'oom_probe': must end as status `oom`."""
    group: int
    """The trial's own process group (one trial per Ray placement, as a search runs them): its order."""
    config: TrainConfig
    cap: str = ""
    """A per-device cap for this trial (`@16GiB` of --gpus), empty: the detected one."""
    optimizer_impl: str | None = None
    """The optimizer this trial must run (the fallback trial), None: what the executor picks for the node."""
    why: str = ""


def model_spec() -> ModelSpec:
    """The model every trial trains: TinyLlama-1.1B's shape (MODEL_SOURCE)."""
    spec = from_shape("tinyllama-1.1b", "llama", source=MODEL_SOURCE, **MODEL_SHAPE)
    return dataclasses.replace(spec, implementation=IMPLEMENTATION) if IMPLEMENTATION else spec


def implementation(model: ModelSpec) -> str:
    return getattr(model, "implementation", None) or (
        "autotune.impl.builtin.Transformer (autotune's own Llama-style code; ModelSpec has no implementation field yet)"
    )


def oom_micro_batch(model: ModelSpec, cluster: Cluster, base: TrainConfig, limit: int = 4096) -> int:
    """The smallest micro batch whose estimated peak is OOM_MARGIN x the GPU's memory. The grid
    (bilinear in the micro batch, memory/grid.py) proposes it from a few traces; the estimate
    itself then confirms it, one micro batch at a time, so the probe is what `estimate` says."""
    import numpy as np

    from autotune.memory.grid import grid_total_bytes

    need = OOM_MARGIN * cluster.capacity_bytes
    mbs = np.arange(1, limit + 1)
    totals = grid_total_bytes(model, cluster, base, mbs, np.array([base.ckpt_layers]))[:, 0]
    over = np.nonzero(totals >= need)[0]
    if not len(over):
        raise SpecError(f"no micro batch up to {limit} exceeds {OOM_MARGIN} x {cluster.describe()}")
    mb = int(mbs[over[0]])
    while mb > 1 and estimate(model, cluster, dataclasses.replace(base, micro_batch=mb - 1)).total_bytes >= need:
        mb -= 1
    while estimate(model, cluster, dataclasses.replace(base, micro_batch=mb)).total_bytes < need:
        mb += 1
    return mb


def plan(model: ModelSpec, cluster: Cluster, fused_adam: bool = True) -> list[Planned]:
    """The baseline, the OOM probe, then TRIALS; `fused_adam`: whether the node runs FusedAdam (then the fallback
    trial runs torch's fused AdamW; else the fallback is what every trial runs, and that trial is left out)."""
    L = model.num_layers
    cfgs = []
    for zero, precision, k, mb, extra, why in TRIALS:
        cfg = TrainConfig(
            zero_stage=zero,
            precision=precision,
            ckpt_layers=L if k < 0 else k,
            micro_batch=mb,
            seq_len=SEQ_LEN,
            offload_optimizer=extra == "offload",
        )
        if extra == "fallback" and not fused_adam:
            continue
        cfgs.append((cfg, extra, why))
    base = cfgs[0][0]
    probe = dataclasses.replace(base, micro_batch=oom_micro_batch(model, cluster, base))
    out = [
        Planned(order=0, name=name(base), role="trial", group=0, config=base, why=cfgs[0][2]),
        Planned(
            order=1,
            name="oom-probe-" + name(probe),
            role="oom_probe",
            group=1,
            config=probe,
            why="must end as CUDA's oom, no process left (finding 8)",
        ),
    ]
    for cfg, extra, why in cfgs[1:]:
        i = len(out)
        label = name(cfg) + {"offload": "-offload", "fallback": "-torch-adamw"}.get(extra, "")
        out.append(
            Planned(
                order=i,
                name=label,
                role="trial",
                group=i,
                config=cfg,
                cap=OFFLOAD_CAP if extra == "offload" else "",
                optimizer_impl="torch_adamw_fused" if extra == "fallback" else None,
                why=why,
            )
        )
    return out


def name(cfg: TrainConfig) -> str:
    return f"z{cfg.zero_stage}-{cfg.precision}-k{cfg.ckpt_layers}-mb{cfg.micro_batch}"


def cluster_of(p: Planned, cluster: Cluster) -> Cluster:
    """The trial's cluster: the detected one, or it with the trial's own cap (the offload trial's)."""
    if not p.cap:
        return cluster
    return dataclasses.replace(
        parse_gpus(f"{cluster.gpus_per_node}x{cluster.gpu.name}@{p.cap}"), text=f"{cluster.text}@{p.cap}"
    )


def make_requests(
    trials: list[Planned], model: ModelSpec, cluster: Cluster, root: Path, timeout_s: float = TRIAL_TIMEOUT_S
) -> list[TrialRequest]:
    """The one place trials become TrialRequests."""
    return [
        TrialRequest(
            model=model,
            cluster=cluster_of(p, cluster),
            config=p.config,
            out_dir=root / "trials" / p.name,
            steps=STEPS,
            warmup_steps=WARMUP_STEPS,
            timeout_s=timeout_s,
            trial_id=p.order,
            optimizer_impl=p.optimizer_impl,
        )
        for p in trials
    ]


class DataParallel:
    """DeepSpeedConfig takes the data-parallel world size from an mpu (as tests/test_report_export.py)."""

    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world

    def get_data_parallel_rank(self) -> int:
        return 0


def validate(ds: dict, world: int) -> dict:
    """`ds` through DeepSpeed's own parser; what it read back. Raises on a config it rejects."""
    from deepspeed.runtime.config import DeepSpeedConfig

    c = DeepSpeedConfig(json.loads(json.dumps(ds)), mpu=DataParallel(world))
    return {
        "train_batch_size": c.train_batch_size,
        "micro_batch": c.train_micro_batch_size_per_gpu,
        "zero_stage": c.zero_optimization_stage,
        "fp16": c.float16_config.enabled,
        "bf16": c.bfloat16_config.enabled,
    }


def expected(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> dict:
    """What the models predict for `cfg`: the memory estimate and the cost model's speed."""
    est, sim = estimate(model, cluster, cfg), simulate(model, cluster, cfg)
    return {
        "est_tensor_peak_gib": est.tensor_peak_bytes / GiB,
        "est_overhead_gib": est.overhead_bytes / GiB,
        "est_total_gib": est.total_bytes / GiB,
        "est_fits": est.fits,
        "est_phase": est.phase,
        "est_fragmentation_gib": est.overhead.get("allocator_fragmentation", 0) / GiB,
        "est_context_gib": sum(v for k, v in est.overhead.items() if k != "allocator_fragmentation") / GiB,
        "sim_samples_per_s": sim.samples_per_s,
        "sim_step_time_s": sim.step_time_s,
    }


def planned_entries(trials: list[Planned], model: ModelSpec, cluster: Cluster) -> list[dict]:
    """Every trial checked (check_config, DeepSpeed's parser) and priced; raises on the first bad one."""
    out = []
    for p in trials:
        c = cluster_of(p, cluster)
        check_config(p.config, model, c)
        ds = deepspeed_config(p.config, model, c, p.optimizer_impl)
        out.append(
            {
                "order": p.order,
                "name": p.name,
                "role": p.role,
                "group": p.group,
                "why": p.why,
                "gpus": c.text,
                "config": p.config.to_dict(),
                "deepspeed_config": ds,
                "parsed": validate(ds, c.world_size),
                **expected(model, c, p.config),
            }
        )
    return out


def write_plan(out: Path, entries: list[dict], model: ModelSpec, cluster: Cluster) -> None:
    head = {
        "model": model.describe(),
        "model_source": model.source,
        "implementation": implementation(model),
        "gpus": cluster.describe(),
        "seq_len": SEQ_LEN,
        "steps": STEPS,
        "warmup_steps": WARMUP_STEPS,
    }
    (out / "plan.json").write_text(json.dumps({**head, "trials": entries}, indent=2))
    lines = [
        "# GPU check plan\n",
        *(f"- {k}: {v}" for k, v in head.items()),
        "",
        "| # | group | trial | role | est. peak GiB (tensor + overhead) | fits | sim. samples/s | DeepSpeed parser |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"| {e['order']} | {e['group']} | {e['name']} | {e['role']} | {e['est_tensor_peak_gib']:.2f} + "
            f"{e['est_overhead_gib']:.2f} | {'yes' if e['est_fits'] else 'no'} | {e['sim_samples_per_s']:.2f} "
            f"| ok: train_batch {e['parsed']['train_batch_size']}, stage {e['parsed']['zero_stage']} |"
        )
    (out / "plan.md").write_text("\n".join(lines) + "\n")


def print_plan(entries: list[dict], model: ModelSpec, cluster: Cluster) -> None:
    print(f"{model.describe()}\n  implementation: {implementation(model)}\n  on {cluster.describe()}, seq {SEQ_LEN}")
    print(f"{'#':>2} {'grp':>3}  {'trial':<28} {'est GiB':>8} {'fits':>4} {'sim sps':>8}  parsed")
    for e in entries:
        print(
            f"{e['order']:>2} {e['group']:>3}  {e['name']:<28} {e['est_total_gib']:>8.2f} "
            f"{'yes' if e['est_fits'] else 'no':>4} {e['sim_samples_per_s']:>8.2f}  ok"
        )


def preset_for(device: str) -> str:
    """The gpus.yaml preset whose name or alias the device's name contains, the longest such
    (so "NVIDIA A100-SXM4-40GB" is A100-40GB, not the A100 alias of the 80 GB part)."""
    from autotune.hardware import gpu_table

    key = device.upper()
    found = [
        (len(a), n)
        for n, e in gpu_table().items()
        if n != "cpu"
        for a in (n, *map(str, e.get("aliases", [])))
        if a.upper() in key
    ]
    if not found:
        raise SpecError(f"GPU {device!r} matches no preset in autotune/data/gpus.yaml; pass --gpus")
    return max(found)[1]


def detect_cluster(gpus: str | None) -> Cluster:
    """--gpus if given, else the preset of the GPU torch sees (by its name); its capacity is the executor's to read
    from the device (finding 6), as it is in a search."""
    if gpus:
        return parse_gpus(gpus)
    import subprocess

    # In a child: this process stays without a CUDA context, so the device gauge sees only the ranks.
    probe = "import torch; print(torch.cuda.get_device_properties(0).name)"
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if seen.returncode:
        raise SpecError(f"torch sees no CUDA device (pass --gpus, or --dry-run):\n{seen.stderr[-1000:]}")
    return parse_gpus(f"1x{preset_for(seen.stdout.strip().splitlines()[-1])}")


def preflight(args) -> dict:
    """Install from the wheels, then pre-build DeepSpeed's FusedAdam where it can be built; each timed and printed.
    Nothing of the environment is fixed up: the trials run in what the executor gives them."""
    return setup.install(args.wheels) | setup.prebuild_ops()


def start_executor(cluster: Cluster, dry_run: bool = False):
    """The executor `autotune search` starts for this cluster (autotune.executors.make): a local Ray cluster, the
    nodes asked what they can run, the devices read (finding 6), the capacity taken from them."""
    from autotune.executors import make

    return make("ray", cluster, dry_run=dry_run)


def ray_runner(ex) -> Callable[[list[TrialRequest]], list[TrialResult]]:
    """Trials through the executor, one at a time (one GPU), each placed, run and collected as the search does."""

    def run(requests: list[TrialRequest]) -> list[TrialResult]:
        out = []
        for req in requests:
            ticket = ex.submit(req)
            done: dict = {}
            while ticket not in done:
                done.update(ex.wait_any())
            out.append(done[ticket])
        return out

    return run


def run(
    args,
    runner: Callable[[list[TrialRequest]], list[TrialResult]] | None = None,
    prepare: Callable[[argparse.Namespace], dict] = preflight,
    executor: Callable[[Cluster], object] | None = start_executor,
) -> int:
    """Preflight, the executor, then the plan trial by trial; rows written as each trial ends. `runner`,
    `prepare` and `executor` are replaced only by the tests (executor None: none is started)."""
    t0 = time.monotonic()
    print(f"[gpu-check] {FINDINGS}", flush=True)
    # finding 1: the driver's shell as ./run left it before the fix; the ranks must pick CUDA whatever it holds
    os.environ["DS_ACCELERATOR"] = "cpu"
    # finding 7: a setting of the driver's shell that must reach the ranks (through Ray's runtime_env)
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    env = prepare(args)
    cluster, model = detect_cluster(args.gpus), model_spec()
    ex = executor(cluster) if executor is not None else None
    try:
        fused = True
        if ex is not None:
            cluster = ex.cluster  # the capacity the device reports (finding 6)
            fused = not cluster.gpu.is_cpu and all(f.get("fused_adam") for f in ex.node_facts.values())
            env |= {"executor_notes": "; ".join(ex.notes)}
            print("[gpu-check] " + "\n[gpu-check] ".join(ex.notes), flush=True)
            runner = runner or ray_runner(ex)
        trials = plan(model, cluster, fused_adam=fused)
        listed = planned_entries(trials, model, cluster)
        write_plan(args.out, listed, model, cluster)
        entries = {e["name"]: e for e in listed}
        head = {
            "checks": FINDINGS,
            "model": model.describe(),
            "implementation": implementation(model),
            "gpus": f"{cluster.describe()} (--gpus {cluster.text})",
            **env,
        }
        rows, gauge = [], Gauge()
        for p in trials:
            left = args.budget_s - (time.monotonic() - t0)
            if left < MIN_TRIAL_S:
                rows += rows_for([p], [None], entries, {}, f"not run: {left:.0f} s of the budget left")
                continue
            print(f"[gpu-check] trial {p.order}: {p.name} ({p.why})", flush=True)
            with gauge:
                results = runner(make_requests([p], model, cluster, args.out, timeout_s=min(TRIAL_TIMEOUT_S, left)))
            stray = leftover(args.out)
            rows += rows_for([p], results, entries, {**gauge.reading(), "processes_left": len(stray)}, "")
            if p.order == 0:  # findings 1 and 7: what the rank says it started with (autotune/trial/worker.py)
                log = args.out / "trials" / p.name / "log.txt"
                said = [ln for ln in log.read_text().splitlines() if "ready in" in ln] if log.exists() else []
                head["rank 0 started with"] = said[0].split("; ", 1)[-1] if said else "(no ready line in its log)"
            write_summary(args.out, head, rows, time.monotonic() - t0)
            if p.order == 0 and results[0].status != "ok":
                rest = [q for q in trials if q.order]
                note = "not run: the first trial failed, and every other trial builds on it"
                rows += rows_for(rest, [None] * len(rest), entries, {}, note)
                break
    finally:
        if ex is not None:
            ex.close()
    write_summary(args.out, head, rows, time.monotonic() - t0)
    print(f"[gpu-check] {len(rows)} rows in {args.out / 'gpu_check.csv'}, {time.monotonic() - t0:.0f} s", flush=True)
    return int(any(r["check"] == "FAIL" for r in rows) or rows[0]["status"] != "ok")


def dry_run_on_ray(args, model: ModelSpec, cluster: Cluster) -> int:
    """Every planned trial through the executor's dry run: a local Ray with the GPU declared, each trial placed and
    its rank started with its environment, stopped before the first CUDA call; the rank plans printed."""
    ex = start_executor(cluster, dry_run=True)
    try:
        trials = plan(model, cluster, fused_adam=all(f.get("fused_adam") for f in ex.node_facts.values()))
        results = ray_runner(ex)(make_requests(trials, model, cluster, args.out))
        print(ex.dry_run_text())
    finally:
        ex.close()
    return int(any(r.status != "dry-run" for r in results))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for the plan or the results ($OUT on the GPU machine)")
    ap.add_argument("--dry-run", action="store_true", help="plan and validate every config; no GPU, no trial")
    ap.add_argument(
        "--ray", action="store_true", help="with --dry-run: place every trial on a local Ray (GPU declared)"
    )
    ap.add_argument("--gpus", help=f"cluster, as autotune's --gpus (dry run: {DRY_RUN_GPUS}; GPU run: detected)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="no trial starts past this (seconds)")
    ap.add_argument("--wheels", type=Path, default=setup.WHEEL_DIR, help="wheel folder (default %(default)s)")
    ap.add_argument("--prepare-wheels", action="store_true", help="fill --wheels from the index (run here)")
    ap.add_argument("--install", action="store_true", help="only install from --wheels (run on the GPU machine)")
    args = ap.parse_args(argv)
    if not (args.prepare_wheels or args.install or args.out):
        ap.error("--out DIR is needed to plan or run")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare_wheels:
        setup.prepare_wheels(args.wheels)
        return 0
    if args.install:
        setup.install(args.wheels)
        return 0
    args.out = args.out.resolve()  # the ranks' command lines name it: leftover() looks for it there
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if not args.dry_run:
            # A SIGTERM (a time limit) unwinds like Ctrl-C: the executor kills its ranks, rows stay written.
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            return run(args)
        t0 = time.monotonic()
        model, cluster = model_spec(), parse_gpus(args.gpus or DRY_RUN_GPUS)
        entries = planned_entries(plan(model, cluster), model, cluster)
        write_plan(args.out, entries, model, cluster)
        print_plan(entries, model, cluster)
        print(
            f"{len(entries)} trials planned, every DeepSpeed config parsed, in {time.monotonic() - t0:.1f} s; "
            f"plan in {args.out / 'plan.md'}"
        )
        return dry_run_on_ray(args, model, cluster) if args.ray else 0
    except SpecError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gpu_check: cut short; the rows finished are in {args.out}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
