"""One rank of a trial process group: `python -m autotune.trial.worker PAYLOAD` (a pickled list of
TrialRequests), started by autotune/trial/launch.py with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set. It imports torch and DeepSpeed and joins the group once, then runs the configs from
AUTOTUNE_START on, each measured on its own (run_config): per config `<out_dir>/rank<R>.json`, and
`@@autotune start I` / `@@autotune done I` on stdout, which the launcher reads to route the log and time it.

Exit codes: 0 all configs ran (whatever their status); EXIT_ABANDON a config raised on this rank, which may
leave the others inside a collective: the launcher kills the group and starts a new one for the rest.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
import types
import warnings
from pathlib import Path

MARK = "@@autotune"
EXIT_ABANDON = 3
FAULT_EXIT_CODE = 13
"""Exit code of the 'exit' test fault: a rank that dies without a Python exception."""
OUT_OF_MEMORY = re.compile(
    r"CUDA error: out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"
    r"|Cuda failure \d* ?'out of memory'|NCCL[^\n]*out of memory"
)
"""Out-of-memory errors raised outside the caching allocator (which raises torch.OutOfMemoryError): a CUDA runtime
call (c10/cuda/CUDAException.h C10_CUDA_CHECK: "CUDA error: " + cudaGetErrorString, "out of memory" for
cudaErrorMemoryAllocation), cuBLAS's handle or workspace (aten/src/ATen/cuda/CUDABlas.cpp, CUBLAS_STATUS_ALLOC_FAILED),
cuDNN's, and NCCL's buffers (nccl src/include/checks.h CUDACHECK: "Cuda failure 'out of memory'", inside torch's
"NCCL error ... ncclUnhandledCudaError")."""


def is_out_of_memory(e: BaseException) -> bool:
    """An out-of-memory error, the caching allocator's or one raised outside it (OUT_OF_MEMORY), along the cause
    chain (torch.distributed re-raises NCCL's as DistBackendError)."""
    import torch

    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, torch.OutOfMemoryError) or OUT_OF_MEMORY.search(str(e)):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def emit(event: str, index: int) -> None:
    sys.stdout.flush()
    # A leading newline keeps the marker on its own line even after C-level output without one.
    os.write(1, f"\n{MARK} {event} {index}\n".encode())


def die_with_parent() -> None:
    """Die with the launcher: PR_SET_PDEATHSIG (Linux prctl(2), option 1) plus a watch on the parent pid,
    so that a launcher killed with SIGKILL (e.g. its Ray worker) leaves no rank behind."""
    parent = int(os.environ.get("AUTOTUNE_PARENT_PID", os.getppid()))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="autotune-parent-watch").start()


def import_muon_eagerly() -> None:
    """Import DeepSpeed's Muon module, which ZeRO imports to check an optimizer's type (zero/utils.py) and which
    torch.compiles at import (zero/muon/original_muon.py), under TORCHDYNAMO_DISABLE=1 (torch.compile then returns
    the function: _dynamo/eval_frame.py), put back at once. No trial runs Muon; saves 1.3-2.1 s per rank
    (docs/measurements/trials.md, "Muon import")."""
    import importlib.util

    if importlib.util.find_spec("deepspeed.runtime.zero.muon") is None:  # a DeepSpeed without it
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def main(argv: list[str]) -> int:
    die_with_parent()
    t_start = time.perf_counter()
    # torch.distributed warns on every call of the collectives DeepSpeed uses (reduce_scatter_tensor,
    # all_gather_into_tensor are "deprecated"): hundreds of lines that would bury the log tail.
    warnings.filterwarnings("ignore", message=r".* is deprecated\. Please use .*", category=FutureWarning)
    import torch

    from autotune.trial import memprof

    # Before any tensor that a config's window should see is allocated (memprof docstring).
    memprof.enable_cpu_memory_reporting()
    import deepspeed
    import deepspeed.ops

    # Skip DeepSpeed's shared-memory comm op: compiled at first use (42 s) and leaks /dev/shm files
    # (measured: docs/platform.md "DeepSpeed on CPU").
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import_muon_eagerly()
    requests = pickle.loads(Path(argv[1]).read_bytes())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    threads = int(os.environ.get("AUTOTUNE_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    on_gpu = not requests[0].cluster.gpu.is_cpu
    if requests[0].dry_run:
        return dry_run(requests, rank=rank, world=world, local_rank=local_rank, on_gpu=on_gpu)
    if on_gpu:
        torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", verbose=False)
    # torch.optim's add_param_group (and the meta-device init) import torch._dynamo at first use
    # (~1 s of CPU): import it now, before gc.freeze, so its objects are frozen with the rest.
    import torch._dynamo

    # What is alive now lives as long as the process: keep it out of every later gc.collect()
    # (measured: 0.2 s per collect on 2 cores without this; each config collects once at teardown).
    gc.freeze()
    from deepspeed.accelerator import get_accelerator

    exported = sorted(k for k in os.environ if k.startswith(("NCCL", "UCX", "MV2")))
    print(
        f"rank {rank}/{world}: torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
        f"{torch.get_num_threads()} threads, ready in {time.perf_counter() - t_start:.2f} s; DeepSpeed accelerator "
        f"{get_accelerator()._name} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', '')}), "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}, exported {', '.join(exported) or '-'}",
        flush=True,
    )
    for index in range(int(os.environ.get("AUTOTUNE_START", "0")), len(requests)):
        req = requests[index]
        emit("start", index)
        abandon = False
        try:
            result = run_config(req, rank=rank, world=world, local_rank=local_rank)
        except Exception as e:
            traceback.print_exc()
            result, abandon = failure("oom" if is_out_of_memory(e) else "crashed", e), True
        result.index = index
        Path(req.out_dir, f"rank{rank}.json").write_text(json.dumps(result.to_dict(), allow_nan=True))
        emit("done", index)
        if abandon:
            # os._exit: a normal interpreter exit with gloo's threads and the profiler still live was
            # seen to segfault (signal 11), which would read as a second, unrelated crash.
            sys.stdout.flush()
            os._exit(EXIT_ABANDON)
    if on_gpu:
        torch.distributed.destroy_process_group()  # NCCL warns at exit without it
    # Every result is on disk: skip the interpreter's teardown of torch and DeepSpeed (measured
    # 0.5-1 s per trial on 2 CPU cores), which no one waits for.
    sys.stdout.flush()
    os._exit(0)


def dry_run(requests, *, rank: int, world: int, local_rank: int, on_gpu: bool) -> int:
    """What this rank would train each config with, written as its RankReport.plan; no CUDA call, no process group.
    The accelerator is the one DeepSpeed picks in this environment (deepspeed.accelerator.get_accelerator, which a
    real trial's deepspeed.initialize asks), the backend the one main() would pass to init_distributed."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from autotune.deepspeed_config import OPTIMIZER_IMPLS
    from autotune.trial.launch import EXPORT_PREFIXES, RSS_ALLOWANCE_BYTES
    from autotune.trial.record import RankReport

    accelerator = get_accelerator()
    env = os.environ
    for index in range(int(env.get("AUTOTUNE_START", "0")), len(requests)):
        req = requests[index]
        emit("start", index)
        plan = {
            "host": socket.gethostname(),
            **{k: env.get(k, "") for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")},
            "MASTER_PORT": env.get("MASTER_PORT", ""),
            "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "(unset: every device)"),
            "DS_ACCELERATOR": env.get("DS_ACCELERATOR", "(unset)"),
            "accelerator": accelerator._name,
            "backend": "nccl" if on_gpu else "gloo",
            "accelerator_backend": accelerator.communication_backend_name(),
            "device": f"cuda:{local_rank}" if on_gpu else "cpu",
            "optimizer_impl": req.optimizer_impl or "",
            "optimizer": OPTIMIZER_IMPLS.get(req.optimizer_impl or "", ""),
            "threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", ""),
            "host_ram_cap_bytes": int(env.get("AUTOTUNE_RSS_CAP", "0")) + RSS_ALLOWANCE_BYTES,
            "deepspeed_config": str(Path(req.out_dir, "deepspeed_config.json").resolve()),
            "exported": {k: v for k, v in sorted(env.items()) if k.startswith(EXPORT_PREFIXES)},
        }
        Path(req.out_dir, f"rank{rank}.json").write_text(
            json.dumps(RankReport(status="ok", index=index, plan=plan).to_dict())
        )
        emit("done", index)
    sys.stdout.flush()
    os._exit(0)


def failure(status: str, e: BaseException):
    from autotune.trial.record import RankReport

    return RankReport(
        status=status,
        reason=f"{type(e).__name__}: {e}".strip()[:2000],
        traceback=traceback.format_exc()[-4000:],
        time=time.time(),
    )


# ---- one config ---------------------------------------------------------------------------------
def build_model(req, device, ds_cfg: dict):
    """The trial's model, initialised, checkpointing set (autotune/trial/build.py)."""
    from autotune.trial.build import build_model as build

    return build(req, device, ds_cfg)


def local_param_bytes(model) -> int:
    """Parameter bytes this rank holds now: the tensor itself, plus for ZeRO-3 its partition
    (ds_tensor). A ZeRO-3 parameter's own tensor is empty while released (as after initialize);
    persistent ones (stage3_param_persistence_threshold) are gathered at the first forward."""
    total = 0
    for p in model.parameters():
        t = getattr(p, "ds_tensor", None)
        total += (p.numel() + (t.numel() if t is not None else 0)) * p.element_size()
    return total


def client_optimizer(req, model):
    """8-bit AdamW has no DeepSpeed config type: it is passed as a client optimizer (GPU only)."""
    if req.config.optimizer != "adamw8bit":
        return None
    import bitsandbytes as bnb

    from autotune.deepspeed_config import ADAMW

    return bnb.optim.AdamW8bit(
        [p for p in model.parameters() if p.requires_grad],
        lr=ADAMW["lr"],
        betas=tuple(ADAMW["betas"]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
    )


class Phases:
    """record_function ranges per phase; on a GPU also the allocator's peak per phase."""

    def __init__(self, gpu_mem):
        self.gpu_mem, self.peaks, self.reserved = gpu_mem, {}, 0

    def __call__(self, name: str):
        import contextlib

        from torch.profiler import record_function

        @contextlib.contextmanager
        def phase():
            with record_function("autotune." + name):
                if self.gpu_mem is not None:
                    self.gpu_mem.start()
                yield
                if self.gpu_mem is not None:
                    self.peaks[name] = max(self.peaks.get(name, 0), self.gpu_mem.peak())
                    self.reserved = max(self.reserved, self.gpu_mem.reserved())

        return phase()


def inject(fault: str | None, rank: int) -> None:
    """TrialRequest.fault, on rank 0 only, so the other ranks are left waiting in a collective."""
    if rank != 0 or fault is None:
        return
    if fault == "hang":
        print("injected hang: rank 0 sleeps forever", flush=True)
        while True:
            time.sleep(60)
    if fault == "crash":
        raise RuntimeError("injected crash (TrialRequest.fault='crash')")
    if fault == "exit":
        print(f"injected exit: rank 0 exits with code {FAULT_EXIT_CODE}", flush=True)
        os._exit(FAULT_EXIT_CODE)
    if fault == "cuda-oom":
        # what C10_CUDA_CHECK raises when a CUDA call outside the caching allocator (a cuBLAS workspace, NCCL's
        # buffers) finds no memory (c10/cuda/CUDAException.h): a RuntimeError, not torch.OutOfMemoryError
        raise RuntimeError(
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call"
        )


class StepLog:
    """fp16: per optimizer step, whether DeepSpeed skipped its update for an overflow, and the loss scale after it.
    Wraps the engine's own step() on the instance; an optimizer step happened when global_steps moved (it does at
    every gradient-accumulation boundary, skipped or not), skipped when skipped_steps moved with it
    (runtime/engine.py _take_model_step)."""

    def __init__(self, engine):
        self.skipped: list[bool] = []
        self.scales: list[float] = []
        self._engine, self._step, self._seen = engine, engine.step, engine.global_steps
        engine.step = self

    def __call__(self, *args, **kwargs):
        e = self._engine
        before = e.skipped_steps
        out = self._step(*args, **kwargs)
        if e.global_steps != self._seen:
            self._seen = e.global_steps
            self.skipped.append(e.skipped_steps > before)
            self.scales.append(float(e.optimizer.loss_scale))
        return out


def profiler(on_gpu: bool, profile: bool):
    """The window the config is measured in. CPU: the autograd profiler with memory events, which IS the memory
    measurement (torch.profiler.profile would import torch._inductor at its first start: 1.2-4 s per rank on 2
    cores). GPU with --profile: torch.profiler.profile with CPU and CUDA activities (Kineto, CUPTI), not the autograd
    profiler's use_device="cuda", which without use_kineto is the legacy profiler timing every op with CUDA events
    (torch/autograd/profiler.py: ProfilerState.CUDA). GPU without --profile: nothing (the allocator's counters)."""
    import contextlib

    if on_gpu:
        if not profile:
            return contextlib.nullcontext()
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as kineto

        return kineto(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True)
    from torch.autograd.profiler import profile as autograd_profile

    return autograd_profile(use_cpu=True, profile_memory=True)


def device_of(tokens):
    return tokens.device if hasattr(tokens, "device") else tokens["input_ids"].device


# ---- Ulysses sequence parallelism (DeepSpeed ALST, runtime/sequence_parallel/ulysses_sp.py) ------------------
def sequence_parallel_attention(req):
    """Wrap the model's attention with Ulysses and make DeepSpeed's sequence-parallel groups; the `mpu` for
    deepspeed.initialize and what `sequence_parallel_release` restores. register_with_transformers replaces
    transformers' ALL_ATTENTION_FUNCTIONS[attention] with its all-to-all wrapper (a process-wide change) and makes
    the groups in parallel_state_sp's module globals, which it asserts are unset ("sequence parallel group is already
    initialized"): a later config of this process gets both back as a fresh process has them."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from autotune.models.hf_config import config_object

    cfg = req.config
    own = ALL_ATTENTION_FUNCTIONS._local_mapping.get(cfg.attention)
    # the model's config, as a built model carries it (register_with_transformers reads `.config`; a bare
    # config would be taken for a hub name): made before the model, outside the trial's memory window
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=types.SimpleNamespace(config=config_object(req.model)),
        core_attn_implementation=cfg.attention,
        sequence_parallel_size=cfg.sequence_parallel_size,
        micro_batch_size=cfg.micro_batch,
        seq_length_is_variable=True,
    )
    return mpu, (cfg.attention, own)


def sequence_parallel_release(saved) -> None:
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name, own = saved
    if own is None:
        del ALL_ATTENTION_FUNCTIONS[name]
    else:
        ALL_ATTENTION_FUNCTIONS[name] = own
    parallel_state_sp._release_sequence_parallel_groups()


def sequence_parallel_batch(tokens, device, mpu):
    """This rank's share of a (b, s+1) batch, the way UlyssesSPDataLoaderAdapter hands it out: the Trainer's
    input_ids = labels = tokens[:, :-1] and position_ids 0..s-1, gathered over the sp group and cut along the
    sequence; the labels come back shifted as `shift_labels` (the next token, -100 after the last), cut the same
    way. The ranks of a group hold the same batch (seeded by rank // (tp x sp)), so the first micro batch the
    adapter yields is the group's batch and serves every step (a trial trains on a fixed batch)."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    x = tokens[:, :-1]
    batch = {
        "input_ids": x,
        "labels": x.clone(),
        "position_ids": torch.arange(x.shape[1], device=x.device).expand_as(x).contiguous(),
    }
    # the groups of register_with_transformers' mpu (deepspeed.utils.groups returns the same once initialize has it)
    adapter = UlyssesSPDataLoaderAdapter(
        [batch],
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=mpu.get_sequence_parallel_world_size(),
        device=device,
    )
    shard = next(iter(adapter))
    return {k: v.to(device).contiguous() for k, v in shard.items() if torch.is_tensor(v)}  # cut: strided


def sequence_parallel_loss(engine, shard):
    """This rank's share of the sp group's token-weighted mean loss: its tokens' summed cross entropy over the
    group's labelled-token count (transformers' ForCausalLMLoss with num_items_in_batch, loss_utils.py). Summed
    over the group it is the sequence's mean, whose gradients DeepSpeed sums over the sp ranks (engine.py
    allreduce_bucket). Not the tutorial's all_gather of losses: it fails in backward on gloo with sp < world.
    `labels` makes the model compute a loss at all (modeling_llama.py); it uses `shift_labels` then."""
    import torch
    from deepspeed.utils import groups

    labels = shard["shift_labels"]
    count = (labels != -100).sum().to(torch.float32)
    torch.distributed.all_reduce(count, group=groups._get_sequence_parallel_group())
    return engine(
        input_ids=shard["input_ids"],
        position_ids=shard["position_ids"],
        labels=labels,
        shift_labels=labels,
        num_items_in_batch=count,
    ).loss


def train(engine, req, rank: int, world: int, data, phases: Phases, sync) -> dict:
    """Warm-up then measured optimizer steps on a fixed batch; the loss is averaged over ranks."""
    import torch
    from torch.profiler import record_function

    from autotune.impl import impl_for

    cfg, tokens = req.config, data[0]
    # Ulysses: data[1] is this rank's share of the token-weighted loss (sequence_parallel_loss)
    loss_of = data[1] if len(data) > 1 else impl_for(req.model, req.config).loss
    losses, times, step_peaks, step_ends = [], [], [], []
    for step in range(req.warmup_steps + req.steps):
        measured = step >= req.warmup_steps
        if step == req.warmup_steps:
            inject(req.fault if req.fault != "nan" else None, rank)
        phases.peaks = {}
        sync()
        t0 = time.perf_counter()
        with record_function(f"autotune.step{step}"):
            total = torch.zeros((), dtype=torch.float64, device=device_of(tokens))
            for _ in range(cfg.grad_accum):
                with phases("forward"):
                    loss = loss_of(engine, tokens)
                if req.fault == "nan" and rank == 0 and step == req.warmup_steps:
                    loss = loss * float("nan")
                total += loss.detach().double()
                with phases("backward"):
                    engine.backward(loss)
                with phases("optimizer"):
                    engine.step()
            sync()
        if measured:
            times.append(time.perf_counter() - t0)
            step_peaks.append(dict(phases.peaks))
            if phases.gpu_mem is not None:
                step_ends.append(phases.gpu_mem.live())
        torch.distributed.all_reduce(total)
        # each sp rank holds its share of its group's mean (their sum): the mean over the world / sp groups
        losses.append(total.item() / cfg.grad_accum / (world // cfg.sequence_parallel_size))
        if not math.isfinite(losses[-1]):
            break
    return {"losses": losses, "step_times_s": times, "gpu_step_phase_peaks": step_peaks, "gpu_step_ends": step_ends}


def run_config(req, *, rank: int, world: int, local_rank: int):
    """Build, initialise, train and measure one config on this rank; its RankReport."""
    import deepspeed
    import torch

    from autotune.deepspeed_config import deepspeed_config
    from autotune.parallel import data_parallel_rank
    from autotune.trial import memprof
    from autotune.trial.record import RankReport

    t_begin = time.perf_counter()
    cfg, cluster = req.config, req.cluster
    on_gpu = not cluster.gpu.is_cpu
    device = torch.device(f"cuda:{local_rank}" if on_gpu else "cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    ds_cfg = deepspeed_config(cfg, req.model, cluster, req.optimizer_impl)
    # A fixed batch per data-parallel rank (the loss must fall). The tp ranks of one group must see the same
    # batch (DeepSpeed asserts it at the first forward, engine.py check_dataloader_inputs_same_across_ranks),
    # and the sp ranks of a Ulysses group share one too (UlyssesSPDataLoaderAdapter cuts it along the sequence).
    sp = cfg.sequence_parallel_size
    gen = torch.Generator().manual_seed(1000 + data_parallel_rank(cfg, rank))
    batch = torch.randint(0, req.model.vocab_size, (cfg.micro_batch, cfg.seq_len + 1), generator=gen)
    data = (batch.to(device),)  # (b, s+1): the implementation's loss takes inputs and targets from it
    del batch
    mpu = sp_saved = None
    if sp > 1:  # before the window, as the plain batch is: this rank's share of it is not the step's memory
        mpu, sp_saved = sequence_parallel_attention(req)
        data = (sequence_parallel_batch(data[0], device, mpu), sequence_parallel_loss)
    window = profiler(on_gpu, req.profile)
    gpu_mem = memprof.GpuPhases(device) if on_gpu else None
    phases = Phases(gpu_mem)
    t0 = time.perf_counter()
    timings = {"setup_s": t0 - t_begin}
    with window as prof:
        with phases("init"):
            model = build_model(req, device, ds_cfg)
            timings["build_s"] = time.perf_counter() - t0
            # [0]: the engine alone (the optimizer held here would outlive release()). Only what trains, as a
            # generator: a list held here kept a ZeRO-1 fp32 config's 5 MB of parameters live into the next.
            trainable = (p for p in model.parameters() if p.requires_grad)
            engine = deepspeed.initialize(
                model=model, model_parameters=trainable, config=ds_cfg, optimizer=client_optimizer(req, model), mpu=mpu
            )[0]
            if cfg.deepcompile:  # DeepSpeed runs without DeepCompile until compile() is called (engine.forward)
                engine.compile()
            steps = StepLog(engine) if cfg.precision == "fp16" else None
        timings["init_s"] = time.perf_counter() - t0
        param_bytes = local_param_bytes(engine.module)
        init_peak_gpu = phases.peaks.pop("init", None)
        t1 = time.perf_counter()
        rec = train(engine, req, rank, world, data, phases, sync)
        timings["train_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    timings["profiler_stop_s"] = t2 - t1 - timings["train_s"]
    if on_gpu:
        mem = gpu_memory(init_peak_gpu, phases, rec.pop("gpu_step_phase_peaks"), gpu_mem)
        mem["step_end_bytes"] = rec.pop("gpu_step_ends")
    else:
        rec.pop("gpu_step_phase_peaks"), rec.pop("gpu_step_ends")
        mem = cpu_memory(memprof.CpuCurve.from_profiler(prof), req, rank)
    if rank == 0 and on_gpu:
        Path(req.out_dir, "memory_summary.txt").write_text(torch.cuda.memory_summary(device))
    if req.profile:
        prof.export_chrome_trace(str(Path(req.out_dir, "trace.json" if rank == 0 else f"trace_rank{rank}.json")))
    timings["analysis_s"] = time.perf_counter() - t2
    out = {**rec, **mem, "param_bytes": param_bytes, **classify(req, rec, mem, device)}
    if cfg.precision == "fp16":
        # `loss_scale` is a property of every DeepSpeed fp16 optimizer (fp16/fused_optimizer.py,
        # fp16/unfused_optimizer.py, zero/stage_1_and_2.py, zero/stage3.py): the scaler's cur_scale.
        out["loss_scale"] = float(engine.optimizer.loss_scale)
        out["overflow_count"] = int(engine.skipped_steps)  # warm-up and measured steps; aggregate tells them apart
        out["step_skipped"], out["step_loss_scales"] = steps.skipped, steps.scales
    t3 = time.perf_counter()
    release(engine)
    if sp_saved is not None:
        sequence_parallel_release(sp_saved)
    del engine, model, prof, steps
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    timings["teardown_s"] = time.perf_counter() - t3
    return RankReport(**out, timings=timings)


def release(engine) -> None:
    """Free what DeepSpeed 0.19.8 keeps of an engine after destroy(), so the next config starts from ~0:
    FWD_MODULE_STACK (runtime/zero/parameter_offload.py) and the class-level lru_cache
    PartitionedParameterCoordinator.__params_to_release (partitioned_param_coordinator.py) held 12.6 MB
    per tiny-llama ZeRO-3 config; and torch.nn.functional.linear, which zero.Init replaces for good."""
    import torch
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    engine.destroy()
    parameter_offload.FWD_MODULE_STACK.clear()
    fn = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    inner = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]  # under instrument_w_nvtx
    for f in [fn, *inner]:
        if hasattr(f, "cache_clear"):
            f.cache_clear()
    # "This will persist unless manually reset" (partition_parameters.py _enable_mem_efficient_linear): its
    # linear saves frozen layers' inputs too (+1.2 MB on a tiny Llama LoRA at ZeRO-0 after a ZeRO-3 config).
    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def cpu_memory(curve, req, rank: int) -> dict:
    """Init, per-step, per-phase peaks from the profiler's curve (memprof), relative to the baseline."""
    init_peak, _ = curve.peak(*curve.span("autotune.init"))
    steps, ends, best = [], [], (0, 0)
    for step in range(req.warmup_steps, req.warmup_steps + req.steps):
        name = f"autotune.step{step}"
        if name not in curve.ranges:
            break  # diverged before this step
        peak, t_peak = curve.peak(*curve.span(name))
        steps.append(peak)
        ends.append(curve.live_at(curve.span(name)[1]) - curve.baseline_bytes)
        best = max(best, (peak, t_peak))
    at = curve.phase_peak_times(f"autotune.step{req.warmup_steps + len(steps) - 1}") if steps else {}
    phase = {k: v for k, (v, _) in at.items()}
    if steps:  # the step's peak, then each phase's of the last step, then what was allocated
        tables = [curve.live_table(best[1])] + [
            f"{name} phase of the last step:\n{curve.live_table(t)}" for name, (_, t) in at.items()
        ]
        Path(req.out_dir, "memory_summary.txt" if rank == 0 else f"memory_summary_rank{rank}.txt").write_text(
            "\n\n".join(tables + [curve.alloc_table()])
        )
    return {
        "init_peak_bytes": init_peak,
        "peak_bytes": best[0] if steps else None,
        "step_peak_bytes": steps,
        "step_end_bytes": ends,
        "phase_peak_bytes": phase,
        "baseline_bytes": curve.baseline_bytes,
        "reserved_bytes": None,
    }


def gpu_memory(init_peak: int | None, phases: Phases, step_phase_peaks: list[dict], gpu_mem) -> dict:
    steps = [max(p.values()) for p in step_phase_peaks if p]
    return {
        "init_peak_bytes": init_peak,
        "peak_bytes": max(steps) if steps else None,
        "step_peak_bytes": steps,
        "step_end_bytes": [],
        "phase_peak_bytes": {k: v for k, v in (step_phase_peaks or [{}])[-1].items()},
        "baseline_bytes": gpu_mem.baseline_bytes,
        "reserved_bytes": phases.reserved,
    }


def classify(req, rec: dict, mem: dict, device) -> dict:
    """ok, diverged, or oom against the per-rank cap; decided on values all ranks agree on."""
    import torch

    if not math.isfinite(rec["losses"][-1]):
        return {
            "status": "diverged",
            "reason": f"non-finite loss {rec['losses'][-1]} at step {len(rec['losses']) - 1} (mean over ranks)",
        }
    peaks = torch.tensor([mem["init_peak_bytes"] or 0, mem["peak_bytes"] or 0], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    cap = req.cluster.capacity_bytes
    for what, value in zip(("model build + deepspeed.initialize", "a training step"), peaks.tolist()):
        if value > cap:
            return {
                "status": "oom",
                "reason": f"measured peak of {int(value):,} tensor bytes in {what} "
                f"exceeds the per-rank cap of {cap:,} bytes "
                f"(--gpus {req.cluster.text or req.cluster.gpu.name})",
            }
    return {"status": "ok", "reason": ""}


if __name__ == "__main__":
    sys.exit(main(sys.argv))
