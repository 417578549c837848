"""One rank of a script trial: `python -m autotune.trial.script_rank PAYLOAD` (a pickled list of one TrialRequest),
started by autotune/trial/launch.py in place of the worker, with the same environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun and DeepSpeed's launcher set them; docs/trials.md).

It runs the user's script as `python SCRIPT ARGS --deepspeed JSON` would (runpy, `__main__`, the script's folder first
on sys.path, in the directory autotune ran in) with hooks on DeepSpeed that measure what the worker measures of its own
loop, read from the script's engine:

- `deepspeed.initialize` (the Trainer reaches it through accelerate, accelerator.py _prepare_deepspeed): the engine,
  the parameters each rank holds, the end of the init window;
- `DeepSpeedEngine.forward`, `.backward`, `.step`: the phases' record_function ranges, the tokens of each forward
  (its input_ids), each micro batch's loss; an optimizer step ends where `global_steps` moves (runtime/engine.py
  _take_model_step), the step's wall time ends there (after a device synchronize on GPU), so the step time holds
  everything the script does between two steps: its data loader, collator, logging;
- `DeepSpeedEngine._autotuning_exit`, which DeepSpeed calls inside step() once the JSON's autotuning section's
  end_profile_step has run (rank 0 writes its metric, then every rank calls exit(), and nothing after it runs in the
  script): the measurement is finished there, before DeepSpeed's exit, and the rank leaves at once.

Memory as the worker reads it (autotune/trial/memprof.py): on CPU the autograd profiler's allocation events with
c10's counter flag, from before the script starts (its model, data and optimizer all count; the baseline is what the
process held before the script), on GPU the caching allocator's counters. The rank writes `rank<R>.json` and the
`@@autotune start/done 0` markers the launcher reads; a script that raises, exits, or ends before its last measured
step writes why, with its own output in the log.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import runpy
import sys
import time
import traceback
from pathlib import Path

from autotune.trial.worker import EXIT_ABANDON, die_with_parent, emit, import_muon_eagerly, is_out_of_memory


class Recorder:
    """What the hooks see of the script's first engine, one rank."""

    def __init__(self, req, rank: int, on_gpu: bool):
        import torch

        self.req, self.rank, self.on_gpu = req, rank, on_gpu
        self.last = req.warmup_steps + req.steps  # optimizer steps the script runs
        self.engine = None
        self.ranges: dict[str, object] = {}
        self.t0 = time.perf_counter()
        self.t_initialize: float | None = None
        self.t_init: float | None = None
        self.bounds: list[float] = []
        self.losses: list[float] = []
        self._micro: list = []
        self._tokens: list[tuple[int, int]] = []
        self.tokens: list[int] = []
        self.seq_lens: set[int] = set()
        self.skipped: list[bool] = []
        self.scales: list[float] = []
        self._skipped_before = 0
        self.param_bytes: int | None = None
        self.done = False
        self.t_setup = 0.0
        self.gpu: dict = {"steps": [], "ends": []}
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if on_gpu else None
        self.prof = None
        if on_gpu:
            torch.cuda.set_device(self.device)
            self.gpu["baseline"] = torch.cuda.memory_allocated(self.device)
        else:
            from torch.autograd.profiler import profile

            # the window the worker measures in (worker.profiler): every CPU tensor the script allocates from here
            self.prof = profile(use_cpu=True, profile_memory=True)
            self.prof.__enter__()
        self.open("autotune.init")

    # ---- record_function ranges opened and closed across calls (memprof reads their spans) -------------------
    def open(self, name: str) -> None:
        from torch.autograd.profiler import record_function

        rf = record_function(name)
        rf.__enter__()
        self.ranges[name] = rf

    def close(self, name: str) -> None:
        rf = self.ranges.pop(name, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize(self.device)

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def initialized(self, engine) -> None:
        from autotune.trial.worker import local_param_bytes

        self.sync()
        self.engine, self.t_init = engine, time.perf_counter()
        self.close("autotune.init")
        self.param_bytes = local_param_bytes(engine.module)
        if self.on_gpu:
            import torch

            self.gpu["init_peak"] = torch.cuda.max_memory_allocated(self.device) - self.gpu["baseline"]
            torch.cuda.reset_peak_memory_stats(self.device)
        self.open("autotune.step0")
        from autotune.trial.script import engine_mismatch

        why = engine_mismatch(self.req, self.facts())
        if why:
            self.finish("crashed", why)

    def forward(self, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = next((a for a in args if hasattr(a, "dtype") and not a.is_floating_point()), None)
        if ids is not None and ids.dim() >= 2:
            self._tokens.append((ids.shape[0], ids.shape[-1]))
            self.seq_lens.add(int(ids.shape[-1]))

    def backward(self, loss) -> None:
        if hasattr(loss, "detach"):
            self._micro.append(loss.detach().float())

    def step_start(self, engine) -> None:
        self._skipped_before = engine.skipped_steps
        self.open("autotune.optimizer")

    def step_end(self, engine, moved: bool) -> None:
        self.close("autotune.optimizer")
        if moved:
            self.boundary(engine)

    def boundary(self, engine) -> None:
        """An optimizer step ended (global_steps moved)."""
        import torch

        self.sync()
        t = time.perf_counter()
        i = len(self.bounds)
        self.bounds.append(t)
        self.losses.append(float(torch.stack(self._micro).mean()) if self._micro else math.nan)
        self._micro = []
        self.tokens.append(sum(b * s for b, s in self._tokens))
        self._tokens = []
        if engine.fp16_enabled():  # as the worker's StepLog: a skipped update moved skipped_steps
            self.skipped.append(engine.skipped_steps > self._skipped_before)
            self.scales.append(float(engine.optimizer.loss_scale))
        if self.on_gpu:
            self.gpu["steps"].append(torch.cuda.max_memory_allocated(self.device) - self.gpu["baseline"])
            self.gpu["ends"].append(torch.cuda.memory_allocated(self.device) - self.gpu["baseline"])
            torch.cuda.reset_peak_memory_stats(self.device)
        self.close(f"autotune.step{i}")
        if i + 1 < self.last:
            self.open(f"autotune.step{i + 1}")
        elif not engine.autotuning_enabled():
            # a JSON without DeepSpeed's autotuning section (a script that builds its own): stop here all the same
            self.finish("ok", "")

    def facts(self) -> dict:
        e = self.engine
        precision = "bf16" if e.bfloat16_enabled() else "fp16" if e.fp16_enabled() else "fp32"
        return {
            "train_batch_size": int(e.train_batch_size()),
            "micro_batch": int(e.train_micro_batch_size_per_gpu()),
            "grad_accum": int(e.gradient_accumulation_steps()),
            "zero_stage": int(e.zero_optimization_stage()),
            "precision": precision,
            "seq_lens": sorted(self.seq_lens),
        }

    # ---- the end -------------------------------------------------------------------------------------------------
    def finish(self, status: str, reason: str, tb: str = "", code: int = 0) -> None:
        """Write this rank's report and leave (os._exit: nothing of the script runs after its last measured step;
        on a failure EXIT_ABANDON, so that the launcher kills the group at once)."""
        from autotune.trial.record import RankReport

        if self.done:
            return
        self.done = True
        t_end = time.perf_counter()
        for name in list(self.ranges)[::-1]:
            self.close(name)
        report: dict = {}
        timings = {"setup_s": self.t_setup}
        if self.engine is not None and self.t_init is not None:
            steps = [b - a for a, b in zip([self.t_init, *self.bounds], self.bounds)]
            w = self.req.warmup_steps
            report.update(
                losses=self.losses,
                step_times_s=steps[w : self.last],
                param_bytes=self.param_bytes,
                engine={**self.facts(), "tokens_per_step": self.tokens[w : self.last], "steps_run": len(self.bounds)},
            )
            if self.skipped:
                report.update(step_skipped=self.skipped, step_loss_scales=self.scales)
                report["loss_scale"] = self.scales[-1] if self.scales else None
            timings.update(
                build_s=self.t_initialize - self.t0 if self.t_initialize else self.t_init - self.t0,
                init_s=self.t_init - self.t0,
                train_s=(self.bounds[-1] if self.bounds else t_end) - self.t_init,
            )
        t1 = time.perf_counter()
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
        t2 = time.perf_counter()
        if self.engine is not None:
            report.update(self.memory())
        if status == "ok" and not all(math.isfinite(v) for v in self.losses):
            bad = next(i for i, v in enumerate(self.losses) if not math.isfinite(v))
            status, reason = "diverged", f"non-finite loss {self.losses[bad]} at step {bad} (this rank's)"
        if self.engine is not None and timings.get("init_s") is not None:
            timings.update(profiler_stop_s=t2 - t1, analysis_s=time.perf_counter() - t2, teardown_s=0.0)
        report.update(status=status, reason=reason, traceback=tb, time=time.time(), timings=timings)
        if self.rank == 0:
            metric = Path(self.req.out_dir, "autotuning_metric.json")
            if metric.exists() and "engine" in report:
                report["engine"]["deepspeed_metric"] = json.loads(metric.read_text())
        Path(self.req.out_dir, f"rank{self.rank}.json").write_text(
            json.dumps(RankReport(**report).to_dict(), allow_nan=True)
        )
        emit("done", 0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if status == "ok" else EXIT_ABANDON)

    def memory(self) -> dict:
        if self.on_gpu:
            g = self.gpu
            import torch

            return {
                "init_peak_bytes": g.get("init_peak"),
                "peak_bytes": max(g["steps"][self.req.warmup_steps :], default=None),
                "step_peak_bytes": g["steps"][self.req.warmup_steps :],
                "step_end_bytes": g["ends"][self.req.warmup_steps :],
                "baseline_bytes": g["baseline"],
                "reserved_bytes": torch.cuda.max_memory_reserved(self.device),
            }
        from autotune.trial import memprof
        from autotune.trial.worker import cpu_memory

        return cpu_memory(memprof.CpuCurve.from_profiler(self.prof), self.req, self.rank)


def install(rec: Recorder) -> None:
    """The hooks on DeepSpeed (see the module docstring); only the first engine is measured."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    initialize = deepspeed.initialize

    def hooked_initialize(*args, **kwargs):
        if rec.engine is None:
            rec.t_initialize = time.perf_counter()
        out = initialize(*args, **kwargs)
        if rec.engine is None:
            rec.initialized(out[0])
        return out

    deepspeed.initialize = hooked_initialize
    forward, backward, step, autotuning_exit = (
        DeepSpeedEngine.forward,
        DeepSpeedEngine.backward,
        DeepSpeedEngine.step,
        DeepSpeedEngine._autotuning_exit,
    )

    def hooked_forward(self, *args, **kwargs):
        if self is not rec.engine:
            return forward(self, *args, **kwargs)
        rec.forward(args, kwargs)
        from torch.autograd.profiler import record_function

        with record_function("autotune.forward"):
            return forward(self, *args, **kwargs)

    def hooked_backward(self, loss, *args, **kwargs):
        if self is not rec.engine:
            return backward(self, loss, *args, **kwargs)
        rec.backward(loss)
        from torch.autograd.profiler import record_function

        with record_function("autotune.backward"):
            return backward(self, loss, *args, **kwargs)

    def hooked_step(self, *args, **kwargs):
        if self is not rec.engine:
            return step(self, *args, **kwargs)
        before = self.global_steps
        rec.step_start(self)
        out = step(self, *args, **kwargs)
        rec.step_end(self, self.global_steps != before)
        return out

    def hooked_exit(self):
        if self is not rec.engine:
            return autotuning_exit(self)
        rec.close("autotune.optimizer")
        rec.boundary(self)  # the last step: DeepSpeed calls this inside step(), after global_steps moved
        try:
            autotuning_exit(self)  # rank 0 writes DeepSpeed's metric, then exit()
        except SystemExit:
            pass
        rec.finish("ok", "")

    DeepSpeedEngine.forward, DeepSpeedEngine.backward = hooked_forward, hooked_backward
    DeepSpeedEngine.step, DeepSpeedEngine._autotuning_exit = hooked_step, hooked_exit


def main(argv: list[str]) -> int:
    die_with_parent()
    t_start = time.perf_counter()
    import warnings

    warnings.filterwarnings("ignore", message=r".* is deprecated\. Please use .*", category=FutureWarning)
    import torch

    from autotune.trial import memprof
    from autotune.trial.script import script_argv

    memprof.enable_cpu_memory_reporting()  # before the script allocates anything (memprof's docstring)
    import deepspeed
    import deepspeed.ops

    # As the worker: no shared-memory comm op (compiled at first use, 42 s, and leaks /dev/shm files)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import_muon_eagerly()
    payload = Path(argv[1]).resolve()
    # the trial's folder is the payload's (the script runs elsewhere: a relative out_dir would mean another folder)
    req = dataclasses.replace(pickle.loads(payload.read_bytes())[0], out_dir=payload.parent)
    rank = int(os.environ["RANK"])
    threads = int(os.environ.get("AUTOTUNE_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    on_gpu = not req.cluster.gpu.is_cpu
    emit("start", 0)
    json_path = Path(req.out_dir, "deepspeed_config.json").resolve()
    sys.argv = script_argv(req, json_path)
    sys.path.insert(0, str(Path(req.script.path).parent))
    print(
        f"rank {rank}/{os.environ['WORLD_SIZE']}: autotune runs {' '.join(sys.argv)} (torch {torch.__version__}, "
        f"deepspeed {deepspeed.__version__}, {torch.get_num_threads()} threads, ready in "
        f"{time.perf_counter() - t_start:.2f} s)",
        flush=True,
    )
    rec = Recorder(req, rank, on_gpu)
    rec.t_setup = time.perf_counter() - t_start
    install(rec)
    try:
        runpy.run_path(req.script.path, run_name="__main__")
        ended = "returned"
    except SystemExit as e:
        ended = f"exited with code {e.code}" if e.code not in (None, 0) else "exited"
    except BaseException as e:  # the script's own failure: its traceback goes to the log
        traceback.print_exc()
        reason = f"{type(e).__name__}: {e}".strip()[:2000]
        rec.finish("oom" if is_out_of_memory(e) else "crashed", reason, traceback.format_exc()[-4000:])
    if rec.engine is None:
        rec.finish(
            "crashed",
            f"the script {ended} without calling deepspeed.initialize: a script trial measures its DeepSpeed engine",
        )
    rec.finish(
        "crashed",
        f"the script {ended} after {len(rec.bounds)} optimizer steps, before the {rec.last} autotune runs "
        f"({req.warmup_steps} warm-up + {req.steps} measured): let it train at least that many steps, and keep the "
        f"JSON's autotuning section (DeepSpeed stops the script there)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
