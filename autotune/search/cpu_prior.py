"""The search's prior for CPU ranks, which have no datasheet: the model's own forward and backward,
timed here, plus what DeepSpeed adds to a step.

    step = grad_accum x (forward+backward [probe] + recompute [probe] + DeepSpeed per micro step)
           + collectives (gloo: per call + per byte [probe]) + AdamW over the rank's parameters [probe]
           + DeepSpeed per parameter

The probe builds the trial's own model (through autotune.impl: the Hugging Face code by default)
in this process, with the threads one rank gets, and times a forward+backward and one block's
forward per micro batch
(the recompute of a checkpointed block is a forward; Narayanan et al. 2021, SC'21, sec. 5.1), and
one AdamW step. A first version used FLOPs at a fixed 20 GFLOP/s measured on a 197K-parameter
model; on a model of 11M parameters the same cores reach ~120 GFLOP/s in its GEMMs, so that prior
ranked micro batches backwards. Timing the model itself needs no per-machine constant for
the arithmetic. It is a prior, used only to order candidates: nothing it returns is reported.

gloo's cost per call and per byte is probed too, by as many processes as the trial has ranks
(`probe_gloo`). Not probed: DeepSpeed's own time per micro step, per parameter and per gathered
module, constants measured on this machine type (below), and the slowdown of two ranks sharing the
memory bus.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Callable, Iterable

from autotune.deepspeed_config import bucket_sizes
from autotune.hardware import Cluster
from autotune.memory.lora import adapter_params
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig, dtype_bytes, torch_dtype
from autotune.trial.threads import cpu_threads_per_rank

GLOO_CALL_S = 0.31e-3
"""One gloo collective's fixed cost where `probe_gloo` cannot run: all_reduce of 4096 fp32 between
2 ranks (one thread each, torch.distributed gloo over loopback, x86_64 2-core machine, torch 2.13):
0.31 ms, best of 5."""
GLOO_BUS_BYTES_PER_S = 1.43e9
"""gloo ring bus bandwidth on the same machine, where `probe_gloo` cannot run: all_reduce of 11.4M
fp32 (45 MB; a ring moves 2(n-1)/n of it per rank) in 31.7 ms, best of 5. A 1M-element all_reduce
reaches 2.0 GB/s."""
DEEPSPEED_MICRO_S = 11e-3
DEEPSPEED_S_PER_PARAM = 2.6e-9
"""DeepSpeed's own time in a step on CPU beyond what is probed or priced (the model's forward and
backward, AdamW, the gloo collectives): per micro step, and per parameter per optimizer step
(its gradient flattening, averaging and copies, zeroing). `python benchmarks/cpu_prior.py` runs
ZeRO-0 trials of two Llamas that are neither landscape's model, 197K and 15.1M parameters, on 2
ranks: the remainder is 9.9 and 12.1 ms at micro batch 1 and 4 for the small one, 64 and 37 ms
for the large one (best of 3 each; the spread is this machine's noise). The two models give the
two constants. Not modelled: two ranks sharing the memory bus, which the single-process probe
does not see; measured throughput is a median 0.85-0.88 of the prior's on the two landscapes."""

DEEPSPEED_Z3_S_PER_MODULE = 2.8e-3
"""ZeRO-3's own time per micro step for each module whose parameters it gathers (those at or above
the persistence threshold): its fetch and release hooks around the module's forward and backward,
beyond the gloo calls priced below. Measured as (ZeRO-3 step - ZeRO-0 step) - (the prior's ZeRO-3 -
ZeRO-0 difference) on 2 CPU ranks, fp32, seq 64, by `python benchmarks/cpu_prior.py`: the
197K-parameter Llama (22 gathered modules) 3.05 and 3.19 ms per module at micro batch 1 and 4, the
15.1M one (32 modules) 2.55 and 0.69 ms (best of 2, a loaded machine); again on an idle one (best
of 3): 3.60, 2.89, 3.24 and 0.89 ms. 2.8 ms is the median of the first run, 3.07 of the second.
At micro batch 4 the larger model's gathers hide partly behind its compute, which a per-module
constant does not model. Without the term the prior put ZeRO-3 at small micro batches 1.5x too
fast on both landscapes."""


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
    """(seconds per gloo collective call, ring bus bytes per second, where they come from), measured
    now on this machine by `world` ranks (at most 8) over loopback, as trials' ranks talk: the median
    of 200 all_reduce calls of 4096 fp32 (10 rounds of 20, 0.1 s apart) and the best of 3 of 4M
    fp32, one thread per rank. One round of 100 calls read 1.67 ms in one of nine runs, at a busy
    moment, where the others read 0.42-0.73 ms.

    Measured, not a constant, because the call's cost is this shared machine's state: 0.31 ms best
    of 5 on the day the landscapes were recorded, single calls of 0.12-0.17 ms (fastest) to 3.3-3.6
    ms (the slowest quarter; a rank waiting to be scheduled) on 2026-12-02, median 0.42-0.47 ms.
    ZeRO 1-3 on the GPT-2 landscape make 168-236 calls per step, so the cost moves its ranking: that
    day, 26 of its configs trained again ranked against the prior with the call priced at 0.31,
    0.45, 0.60, 0.80 and 1.00 ms gave Spearman 0.863, 0.893, 0.899, 0.898 and 0.882
    (`python benchmarks/cpu_prior.py --only-same-run`). The median of single calls, not the mean
    of back-to-back ones (1.5-2.1 ms that day): DeepSpeed's calls come between other work. Two
    processes that import torch: about 3 s, once per search. Where they cannot run or meet (no
    loopback, a sandbox), the constants above, and the third field says so. The rendezvous is a
    file in a private temporary folder and gloo's own sockets are on the loopback interface, as
    in trials (autotune/trial/launch.py): nothing listens beyond this machine."""
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
"""A forward+backward timed at this or longer is not timed again: neither the second timing of
`probe_model` nor a later pass of `probe_passes`. Both repeats are there for short timings that a
burst of this shared machine's other load (0.2-4 s on, 0.2-3 s off; PROBE_PASSES) can cover whole; a
timing of several seconds already spans several bursts. What it saves: a StableLM config of 2.6M
parameters, bf16 on CPU ranks without native bf16 arithmetic (about 10x slower than fp32 there), micro
batch 4, 8 and 16 at sequence 128, timed 4.6-4.8, 8.1-9.4 and 17.6-18.4 s per call in each of two passes,
63 of the 68 s the prior took before that search's first trial (its three trials took 40 s;
2026-12-06). The recorded CPU landscapes' forward+backward are under 0.85 s even in a two-rank step
(the slowest ZeRO-0 micro step in their files), so their priors are probed as before."""

PROBE_TIMINGS = 2
"""Timings of each micro batch's forward+backward in `probe_model`, the fastest kept. More do not
rank better here: on the GPT-2 landscape, with gloo priced at a fixed 0.45 ms per call and 1 GB/s so
that only the model probes vary, six priors with 2 timings and six with 4, made in turns, ranked at
Spearman 0.910-0.952 (mean 0.933) and 0.909-0.945 (mean 0.926) (`python benchmarks/cpu_prior.py
--probe-noise 6 --landscape cpu_landscape_gpt2` as it was then, comparing timings per probe; this
shared 2-core machine, 2026-12-02). Timing each shape again a pass later does help (PROBE_PASSES). Made in
batches rather than in turns, one batch of each read 0.94 against 0.89 and another 0.93 against
0.95: what moves the prior is this machine's drift over minutes, which more timings of one probe
do not average out. The thread's CPU clock in place of the wall clock did no better either."""


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
    """(forward+backward of the whole model, forward of one decoder layer) in seconds, the fastest
    of PROBE_TIMINGS timings each, after a warm-up at micro batch 1 (first calls pay allocator and
    kernel selection). The model is the trial's own, built through autotune.impl (Hugging Face, builtin or
    factory code); a layer's forward is the mean over the layers, timed by forward hooks inside the
    same forward+backward (every code's layers take different arguments, so none is called alone).
    With one timing, two candidates 15% apart on the Llama landscape swapped in 3 of 5 searches;
    with two, in 3 of 10. `lora`: (method, rank, targets, dropout) of a LoRA config, timed on the
    real peft module (frozen base: no weight gradients; adapters' small GEMMs), None for full.

    Each micro batch is timed on its own, PROBE_TIMINGS times in a row (once at LONG_PROBE_S or longer), as a trial repeats one
    shape. Timing a search's micro batches in turns (1, 2, 4, 1, 2, 4) against the machine's drift was tried and
    measured worse: over four runs the Llama landscape's rank correlation fell from 0.95-0.985 to
    0.85-0.95 and the first pick missed the best by 27% in all four (the likely cause, unverified:
    each change of shape meets a cold allocator that a trial's repeated steps do not)."""
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
"""Passes over the configs' shapes in `cpu_prior(..., configs)`: each shape probed in micro batch
order, then all again in the same order, the faster of each shape's two kept, so that a shape met
by a slow moment of this shared machine (the whole 0.1-2 s of its probe) is timed again seconds
later. With two other processes loading both cores in bursts (0.2-4 s on, 0.2-3 s off), six priors
made in turns with one pass and with two ranked at Spearman 0.946-0.962 and 0.937-0.962 (one pass;
Llama and GPT-2 landscapes) against 0.953-0.958 and 0.963-0.974 (two passes), gloo priced at a fixed
figure (`python benchmarks/cpu_prior.py --probe-noise 6`; 2026-12-02). An earlier try in
alternating order (ascending, then descending) timed the last shape's two back to back, and the
faster of two close timings favoured the middle shapes: the Llama landscape's first pick fell from
within 2% of the best to 14% off. It doubles the model probes' time: 4.3 to 7.8 s and 5.0 to 10.1 s
for the two landscapes' models (gloo's probe, about 3 s once, apart)."""


def _lora_of(cfg: TrainConfig) -> tuple | None:
    return (cfg.method, cfg.lora_rank, cfg.lora_targets, cfg.lora_dropout) if cfg.method != "full" else None


def _probe_key(model: ModelSpec, cfg: TrainConfig, threads: int) -> tuple:
    """probe_model's arguments for `cfg`."""
    lora = _lora_of(cfg)
    return (model, cfg.seq_len, cfg.micro_batch, cfg.precision, cfg.attention, threads) + ((lora,) if lora else ())


def probe_passes(keys: list[tuple], passes: int) -> dict[tuple, tuple[float, float]]:
    """probe_model's figures for each of `keys`, timed in `passes` passes over them in micro batch
    order, the fastest of each kept (PROBE_PASSES). The same order each pass: every shape's timings
    are a whole pass apart (in alternating order, the last shape's two came back to back, and the
    minimum of two close timings favoured the shapes in the middle). A shape timed at LONG_PROBE_S or
    longer is not timed again."""
    order = sorted(set(keys), key=lambda k: (k[2], repr(k[1:])))
    best: dict[tuple, tuple[float, float]] = {}
    for n in range(passes):
        for key in order:
            if n and best[key][0] >= LONG_PROBE_S:
                continue
            t = probe_model.__wrapped__(*key)
            best[key] = t if key not in best else (min(best[key][0], t[0]), min(best[key][1], t[1]))
    return best


def cpu_prior(
    model: ModelSpec, cluster: Cluster, configs: Iterable[TrainConfig] = ()
) -> Callable[[TrainConfig], float]:
    """Expected samples/s of a config on CPU ranks (the sum in the module docstring). `configs`:
    those it will be asked about (a search's candidates that fit), whose shapes are probed up front
    in PROBE_PASSES passes; any other is probed once when asked."""
    w, threads = cluster.world_size, rank_threads(cluster)
    gloo_call_s, gloo_bus = probe_gloo(w)[:2] if w > 1 else (GLOO_CALL_S, GLOO_BUS_BYTES_PER_S)
    probed = probe_passes([_probe_key(model, c, threads) for c in configs], PROBE_PASSES)

    def prior(cfg: TrainConfig) -> float:
        lora = _lora_of(cfg)
        key = _probe_key(model, cfg, threads)
        fwd_bwd, block_fwd = probed[key] if key in probed else probe_model(*key)
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

    return prior
