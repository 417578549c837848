"""The search's prior on CPU ranks, which have no datasheet: the model's own step timed here.

    step = grad_accum x (forward+backward [probe] + recompute [probe] + DeepSpeed per micro step)
           + collectives (gloo: per call + per byte [probe]) + AdamW over the rank's parameters [probe]
           + DeepSpeed per parameter

The probes build the trial's own model (autotune.impl) in this process with one rank's threads and time a
forward+backward, one block's forward (a checkpointed block's recompute; Narayanan et al. 2021, SC'21,
sec. 5.1) and an AdamW step; gloo is probed by as many processes as the trial has ranks. Timed, not counted
in FLOPs: GEMM speed varies 6x with the model's size (docs/measurements/search.md, "The CPU prior"). Not
probed: DeepSpeed's own time (constants below) and two ranks sharing the memory bus. It only orders
candidates: nothing it returns is reported.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Iterable

from autotune.deepspeed_config import bucket_sizes
from autotune.hardware import Cluster
from autotune.memory.lora import adapter_params
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig, dtype_bytes, torch_dtype
from autotune.trial.threads import cpu_threads_per_rank

GLOO_CALL_S = 0.31e-3  # all_reduce of 4096 fp32, 2 ranks over loopback, best of 5; where probe_gloo cannot run
GLOO_BUS_BYTES_PER_S = 1.43e9  # gloo ring all_reduce of 45 MB on the same machine, best of 5; the same fallback
# DeepSpeed's own time per micro step and per parameter per step beyond what is probed: the remainder of ZeRO-0
# trials of two Llamas (197K, 15.1M parameters) on 2 ranks, `python benchmarks/cpu_prior.py`
DEEPSPEED_MICRO_S = 11e-3
DEEPSPEED_S_PER_PARAM = 2.6e-9
# ZeRO-3's fetch and release hooks per gathered module per micro step: median of 3.05, 3.19, 2.55, 0.69 ms
# (`python benchmarks/cpu_prior.py`); without it the prior put ZeRO-3 at small micro batches 1.5x too fast
DEEPSPEED_Z3_S_PER_MODULE = 2.8e-3


def _collectives_per_step(model: ModelSpec, cfg: TrainConfig) -> int:
    """Collective calls per optimizer step, from the bucket sizes the DeepSpeed config sets.

    ZeRO-0 all-reduces once at the boundary (DeepSpeed's allreduce bucket default 5e8 elements); 1-2
    reduce per reduce bucket (ZeRO-2 on every micro step) and all-gather the updated partition per
    all-gather bucket; ZeRO-3 gathers each weight matrix in forward and again in backward on every
    micro step (norm weights stay below the persistence threshold) and reduce-scatters per bucket."""
    b = bucket_sizes(model, cfg)
    n = model.num_params
    reduce, gather = -(-n // b["reduce_bucket_size"]), -(-n // b["allgather_bucket_size"])
    mats = model.num_layers * (2 + (3 if model.mlp == "swiglu" else 2)) + (1 if model.tied_embeddings else 2)
    return {0: 1, 1: reduce + gather, 2: cfg.grad_accum * reduce + gather, 3: cfg.grad_accum * (reduce + 2 * mats)}[
        cfg.zero_stage
    ]


def _ring_volumes_per_step(cfg: TrainConfig) -> float:
    """Gradient-sized volumes each rank sends per step, times (n-1)/n: an all-reduce is 2 (ZeRO-0;
    ZeRO-1/2's reduce-scatter + all-gather of the update too), ZeRO-2 reduce-scatters every micro
    step, ZeRO-3 also gathers the parameters twice per micro step (Rajbhandari et al. 2020, "ZeRO",
    sec. 7.2)."""
    ga = cfg.grad_accum
    return {0: 2.0, 1: 2.0, 2: ga + 1.0, 3: 3.0 * ga}[cfg.zero_stage]


GLOO_PROBE = r"""
import json, statistics, sys, time
import torch, torch.distributed as dist
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
small, big = torch.zeros(4096), torch.zeros(1 << 22)
for _ in range(20):
    dist.all_reduce(small)
calls = []
for _ in range(10):   # 10 rounds 0.1 s apart: a second of this machine's state, not one busy moment
    time.sleep(0.1)
    for _ in range(20):
        t = time.perf_counter()
        dist.all_reduce(small)
        calls.append(time.perf_counter() - t)
dist.all_reduce(big)
bulk = []
for _ in range(3):
    t = time.perf_counter()
    dist.all_reduce(big)
    bulk.append(time.perf_counter() - t)
if rank == 0:
    moved = 2 * (world - 1) / world * big.numel() * 4
    print(json.dumps({"call_s": statistics.median(calls), "bus_bytes_per_s": moved / min(bulk)}))
dist.destroy_process_group()
"""


@cache
def probe_gloo(world: int) -> tuple[float, float, str]:
    """(seconds per gloo call, ring bus bytes/s, where they come from), by `world` ranks (at most 8) over
    loopback as trials' ranks talk: the median of 200 calls of 4096 fp32 (10 rounds 0.1 s apart: DeepSpeed's
    calls come between other work) and the best of 3 of 4M fp32. Probed, not a constant: the call's cost is
    this shared machine's state (0.31-1.67 ms), and it moves the ranking of ZeRO 1-3, which make 168-236 calls
    a step (docs/measurements/search.md, "The CPU prior"). About 3 s, once per search. Where the probe cannot
    run, the constants above, and the third field says so. The rendezvous is a file in a private temporary
    folder and gloo binds loopback only, as trials do (autotune/trial/launch.py)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from autotune.trial.launch import loopback_interface

    world = max(2, min(world, 8))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": loopback_interface(), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="autotune-gloo-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", GLOO_PROBE, str(r), str(world), store],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        out = err = ""
        try:
            out, err = procs[0].communicate(timeout=120)
            for p in procs[1:]:
                p.communicate(timeout=30)
            got = json.loads(out.strip().splitlines()[-1])
            return float(got["call_s"]), float(got["bus_bytes_per_s"]), f"probed now, {world} ranks over loopback"
        except (subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as e:
            reason = err.strip().splitlines()[-1] if err.strip() else type(e).__name__
            return GLOO_CALL_S, GLOO_BUS_BYTES_PER_S, f"constants (the probe failed: {reason})"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def rank_threads(cluster: Cluster) -> int:
    """Threads each rank of a trial gets (autotune.trial.threads, as the launcher and Ray decide)."""
    return cpu_threads_per_rank(cluster.gpus_per_node)


LONG_PROBE_S = 3.0
"""A forward+backward timed this long or longer is timed once: it already spans several of the machine's load
bursts that the repeats are for. Saved 63 of 68 s of a bf16 StableLM search's planning (docs/measurements/search.md)."""

PROBE_TIMINGS = 2
"""Timings of each shape in a row, the fastest kept; 4 ranked no better than 2 (Spearman mean 0.926 vs 0.933,
`python benchmarks/cpu_prior.py --probe-noise 6`): what moves the prior is the machine's drift over minutes."""


@cache
def probe_model(
    model: ModelSpec,
    seq_len: int,
    micro_batch: int,
    precision: str,
    attention: str,
    threads: int,
    lora: tuple | None = None,
) -> tuple[float, float]:
    """(forward+backward of the whole model, forward of one decoder layer) in seconds, the fastest of
    PROBE_TIMINGS in a row (once at LONG_PROBE_S or longer), after a warm-up at micro batch 1 (first calls pay
    allocator and kernel selection). The model is the trial's own (autotune.impl); a layer's forward is the mean
    over the layers, timed by hooks inside the same forward+backward (each code's layers take other arguments).
    `lora`: (method, rank, targets, dropout), timed on the real peft module; None for full training. Shapes
    timed in turns rather than in a row ranked worse (docs/measurements/search.md, "The CPU prior")."""
    import torch

    from autotune.impl import impl_for

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)  # fixed inputs, the process's own RNG left alone
        impl = impl_for(model, _lora_config(lora))
        net = _probe_net(model, attention, torch_dtype(precision), lora)
        layers = impl.layers(net)
        spent = [0.0]

        def pre(mod, args):
            mod._autotune_t0 = time.perf_counter()

        def post(mod, args, out):
            spent[0] += time.perf_counter() - mod._autotune_t0

        hooks = [
            h for layer in layers for h in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post))
        ]

        def run(mb: int) -> tuple[float, float]:
            tokens = torch.randint(0, model.vocab_size, (mb, seq_len + 1), generator=gen)
            spent[0] = 0.0
            t0 = time.perf_counter()
            impl.loss(net, tokens).backward()
            t1 = time.perf_counter()
            net.zero_grad(set_to_none=True)
            return t1 - t0, spent[0] / len(layers)

        try:
            run(1)
            timed = [run(micro_batch)]
            while len(timed) < PROBE_TIMINGS and timed[0][0] < LONG_PROBE_S:
                timed.append(run(micro_batch))
        finally:
            for h in hooks:
                h.remove()
        return min(t[0] for t in timed), min(t[1] for t in timed)
    finally:
        torch.set_num_threads(before)


@cache
def gathered_modules(model: ModelSpec, threshold: int, lora: tuple | None = None) -> int:
    """Modules with a trained or frozen parameter of at least `threshold` elements: those ZeRO-3
    gathers around their forward and backward (DeepSpeed partitioned_param_coordinator.py fetches
    per module; stage3.py keeps smaller parameters whole), counted on the trial's module built on
    the meta device."""
    import torch

    from autotune.impl import impl_for
    from autotune.models.hf_config import default_attention

    with torch.device("meta"):
        net = impl_for(model, _lora_config(lora)).build(model, dtype=torch.float32, attention=default_attention(model))
    return sum(1 for m in net.modules() if any(p.numel() >= threshold for p in m.parameters(recurse=False)))


def _lora_config(lora: tuple | None) -> TrainConfig | None:
    if lora is None:
        return None
    method, rank, targets, dropout = lora
    return TrainConfig(method=method, lora_rank=rank, lora_targets=targets, lora_dropout=dropout)


@cache
def _probe_net(model: ModelSpec, attention: str, dtype, lora: tuple | None = None):
    """The trial's model in host memory, initialised as the trial initialises it."""
    import torch

    from autotune.impl import impl_for

    # The hf and factory constructors draw from the global stream, seeded as in the trial; forked,
    # so the search process's own stream is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = impl_for(model, _lora_config(lora)).build(model, dtype=dtype, attention=attention)
    if model.implementation == "builtin":
        from autotune.impl.builtin import init_weights

        # The trial's own initialisation: with nn.Linear's default one, the tied GPT-2 head's backward
        # meets denormal floats and its GEMMs run ~7x slower on x86 (0.43 vs 0.06 s, landscape-gpt2).
        init_weights(net)
    return net


@cache
def probe_adamw_s_per_param(threads: int, n: int = 1 << 22) -> float:
    """One torch.optim.AdamW step (what the DeepSpeed config asks for on CPU: torch_adam) over
    `n` fp32 parameters, per parameter, the fastest of three after a first step that allocates
    the moments (single timings spread 3.6-7 ns per parameter on this machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.ones(n)
        opt = torch.optim.AdamW([p], lr=1e-3)
        opt.step()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - t0)
        return best / n
    finally:
        torch.set_num_threads(before)


PROBE_PASSES = 2
"""Passes over the configs' shapes in `CpuPrior.probe`, the faster of each shape's kept, so that a shape met by a
load burst is timed again seconds later: Spearman 0.953-0.974 against 0.937-0.962 with one pass under load
(`python benchmarks/cpu_prior.py --probe-noise 6`); it doubles the probes' time (docs/measurements/search.md)."""


def _lora_of(cfg: TrainConfig) -> tuple | None:
    return (cfg.method, cfg.lora_rank, cfg.lora_targets, cfg.lora_dropout) if cfg.method != "full" else None


def _probe_key(model: ModelSpec, cfg: TrainConfig, threads: int) -> tuple:
    """probe_model's arguments for `cfg`."""
    lora = _lora_of(cfg)
    return (model, cfg.seq_len, cfg.micro_batch, cfg.precision, cfg.attention, threads) + ((lora,) if lora else ())


def probe_passes(keys: list[tuple], passes: int) -> dict[tuple, tuple[float, float]]:
    """probe_model's figures for each of `keys`, in `passes` passes over them in micro batch order, the fastest
    kept (PROBE_PASSES). The same order each pass: in alternating order the last shape's two timings came back to
    back and the minimum favoured the middle shapes. A shape timed at LONG_PROBE_S or longer is not timed again."""
    order = sorted(set(keys), key=lambda k: (k[2], repr(k[1:])))
    best: dict[tuple, tuple[float, float]] = {}
    for n in range(passes):
        for key in order:
            if n and best[key][0] >= LONG_PROBE_S:
                continue
            t = probe_model.__wrapped__(*key)
            best[key] = t if key not in best else (min(best[key][0], t[0]), min(best[key][1], t[1]))
    return best


class CpuPrior:
    """Expected samples/s of a config on CPU ranks: the sum in the module docstring. `probe(configs)` times the
    shapes of those it will be asked about up front, in PROBE_PASSES passes; any other is probed once when asked."""

    def __init__(self, model: ModelSpec, cluster: Cluster):
        self.model, self.world, self.threads = model, cluster.world_size, rank_threads(cluster)
        self.probed: dict[tuple, tuple[float, float]] = {}
        self._gloo: tuple[float, float] | None = None

    def gloo(self) -> tuple[float, float]:
        """(seconds per gloo call, bus bytes/s), probed once, before the model probes."""
        if self._gloo is None:
            w = self.world
            self._gloo = probe_gloo(w)[:2] if w > 1 else (GLOO_CALL_S, GLOO_BUS_BYTES_PER_S)
        return self._gloo

    def probe(self, configs: Iterable[TrainConfig]) -> None:
        self.gloo()
        keys = [_probe_key(self.model, c, self.threads) for c in configs]
        self.probed.update(probe_passes(keys, PROBE_PASSES))

    def __call__(self, cfg: TrainConfig) -> float:
        model, w, threads = self.model, self.world, self.threads
        gloo_call_s, gloo_bus = self.gloo()
        lora = _lora_of(cfg)
        key = _probe_key(model, cfg, threads)
        fwd_bwd, block_fwd = self.probed[key] if key in self.probed else probe_model(*key)
        t_micro = fwd_bwd + cfg.ckpt_layers * block_fwd + DEEPSPEED_MICRO_S
        if cfg.zero_stage == 3:
            threshold = bucket_sizes(model, cfg)["stage3_param_persistence_threshold"]
            t_micro += DEEPSPEED_Z3_S_PER_MODULE * gathered_modules(model, threshold, lora)
        trained = adapter_params(model, cfg)  # what is reduced and stepped: the adapters under LoRA
        comm = 0.0
        if w > 1:
            grad_bytes = trained * dtype_bytes(cfg.precision)
            comm = (
                _collectives_per_step(model, cfg) * gloo_call_s
                + _ring_volumes_per_step(cfg) * (w - 1) / w * grad_bytes / gloo_bus
            )
        params = trained / (w if cfg.zero_stage >= 1 else 1)
        t_step = (
            cfg.grad_accum * t_micro
            + comm
            + params * probe_adamw_s_per_param(threads)
            + trained * DEEPSPEED_S_PER_PARAM
        )
        return cfg.micro_batch * cfg.grad_accum * w / t_step


def cpu_prior(model: ModelSpec, cluster: Cluster, configs: Iterable[TrainConfig] = ()) -> CpuPrior:
    """A CpuPrior with `configs` probed up front (benchmarks/cpu_prior.py; the search goes through prior.py)."""
    prior = CpuPrior(model, cluster)
    prior.probe(configs)
    return prior
