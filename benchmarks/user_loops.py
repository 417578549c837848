"""What users run, against autotune's trial and estimate: the plain Hugging Face + peft + DeepSpeed loop and the
transformers Trainer with the exported DeepSpeed JSON, on 2 CPU ranks, measured with the trial's own counter.

    python benchmarks/user_loops.py                  # the recorded runs (benchmarks/data/user_loop_runs.csv) against
                                                     # today's estimate: per case estimate, trial, plain loop, Trainer
    python benchmarks/user_loops.py --measure        # run every case again in all three loops (~20 s a run)
    python benchmarks/user_loops.py --measure --only issue51-llama-lora   # these cases (comma-separated; the table's
                                                                          # first column)
    python benchmarks/user_loops.py --measure --loops trainer             # only these loops (comma-separated)

The three loops of one case get the same DeepSpeed JSON (autotune.deepspeed_config.deepspeed_config, what `autotune
trial` writes and `autotune export` exports), the same transformers config, the same peft LoraConfig
(impl/lora.py lora_config_dict) and a fixed random batch per rank:

- `trial`: autotune.trial.launch.run_trials (autotune/trial/worker.py train()).
- `plain`: issue 51's user loop, all of it: `AutoModelForCausalLM.from_config(config)` under a live
  `HfDeepSpeedConfig`, `peft.get_peft_model(model, LoraConfig(...))` (peft's defaults), checkpointing as `autotune
  export` prints it (`model.activation_checkpointing_enable({"use_reentrant": False})`, and for the first k of L
  layers each later layer's flag off), `deepspeed.initialize(model=, model_parameters=<trainable>, config=<JSON>)`,
  then per step `loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()`.
- `trainer`: `transformers.Trainer` with the TrainingArguments `autotune export` prints (tests/hf_trainer_run.py
  `trainer_args`; `gradient_checkpointing=True` when every layer is checkpointed, else as `plain`), the model made
  after the arguments (their HfDeepSpeedConfig builds it under zero.Init at ZeRO-3), peft as `plain`.

Memory: c10's FLAGS_caffe2_report_cpu_memory_usage and the profiler's allocation events (autotune/trial/memprof.py),
relative to the live bytes before the model is built, per optimizer step (record_function ranges; the Trainer's
from its on_step_begin/on_step_end callbacks). A row keeps every rank's step peaks after the warm-up; it is judged
at its largest (the worst timing, as docs/memory.md prices it). The bar (issue 51): median |error| at most 1%,
worst at most 3%, never more than 1% under.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from cases import FAMILIES, ISSUE51_LLAMA, spec_of, summary  # noqa: E402

from autotune.hardware import parse_gpus  # noqa: E402
from autotune.train_config import TrainConfig  # noqa: E402

CSV = HERE / "data" / "user_loop_runs.csv"
RANKS = 2
CLUSTER = f"{RANKS}xcpu"
WARMUP, STEPS = 2, 3
LOOPS = ("trial", "plain", "trainer")

ISSUE51 = ISSUE51_LLAMA
"""Issue 51's case 1: the Llama config a new user tried."""

LORA = dict(method="lora", lora_rank=8, lora_targets="all-linear", lora_alpha=16, lora_dropout=0.05)

# (name, family, transformers config, TrainConfig fields; ckpt_layers -1: every layer)
CASES: list[tuple[str, str, dict, dict]] = [
    ("issue51-llama-lora", "llama", ISSUE51, dict(zero_stage=3, ckpt_layers=-1, micro_batch=2, seq_len=256, **LORA)),
    ("issue51-llama-full", "llama", ISSUE51, dict(zero_stage=3, ckpt_layers=-1, micro_batch=2, seq_len=256)),
    ("issue51-llama-lora-k2", "llama", ISSUE51, dict(zero_stage=3, ckpt_layers=2, micro_batch=2, seq_len=256, **LORA)),
    *[
        (f"{family}-z3-{what}", family, FAMILIES[family], dict(zero_stage=3, ckpt_layers=-1, **extra))
        for family in ("gpt2", "qwen2", "gpt_neox", "mistral")
        for what, extra in (
            ("lora", dict(micro_batch=2, seq_len=192, **LORA)),
            ("full", dict(micro_batch=2, seq_len=192)),
        )
    ],
    (
        "qwen2-z3-full-k1-fp32",
        "qwen2",
        FAMILIES["qwen2"],
        dict(zero_stage=3, ckpt_layers=1, micro_batch=3, seq_len=128, precision="fp32"),
    ),
]
"""Issue 51: ZeRO-3 with checkpointing, LoRA and full fine-tuning, five families (bf16 unless said; every layer
checkpointed, the first k where named)."""


def case_configs(only: str | None = None) -> list[tuple[str, str, dict, TrainConfig]]:
    """The cases (`only`: those named, comma-separated) with their TrainConfig."""
    names = set(only.split(",")) if only else {n for n, *_ in CASES}
    if names - {n for n, *_ in CASES}:
        sys.exit(f"--only: one or more of {', '.join(n for n, *_ in CASES)}")
    out = []
    for name, family, shape, fields in CASES:
        if name not in names:
            continue
        layers = spec_of(family, shape).num_layers
        k = fields.get("ckpt_layers", 0)
        out.append((name, family, shape, TrainConfig(**{**fields, "ckpt_layers": layers if k < 0 else k})))
    return out


# ---- one rank of the plain loop or the Trainer (started by torch.distributed.run) ------------------------------------
def _rank(loop: str, case_path: str, out_dir: str) -> None:
    case = json.loads(Path(case_path).read_text())
    from autotune.trial import memprof

    memprof.enable_cpu_memory_reporting()  # before any tensor the window should count
    import deepspeed
    import deepspeed.ops
    import torch

    # as the trial worker and tests/hf_trainer_run.py: the shared-memory comm op compiles at first use (42 s)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    from transformers import CONFIG_MAPPING

    rank = torch.distributed.get_rank()
    config = CONFIG_MAPPING[case["hf_config"]["model_type"]].from_dict(case["hf_config"])  # as hf_config.config_object
    ds, mb, seq = case["ds"], case["micro_batch"], case["seq_len"]
    steps = WARMUP + STEPS
    gen = torch.Generator().manual_seed(1000 + rank)
    # a fixed batch per rank, made before the window as the trial's is
    per_step = ds["gradient_accumulation_steps"]
    ids = torch.randint(0, config.vocab_size, (mb * per_step, seq), generator=gen)
    window = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True)
    if loop == "plain":
        with window:
            engine = _plain_setup(config, case)
            for step in range(steps):
                with torch.profiler.record_function(f"autotune.step{step}"):
                    for m in range(per_step):
                        x = ids[m * mb : (m + 1) * mb]
                        loss = engine(input_ids=x, labels=x).loss
                        engine.backward(loss)
                        engine.step()
    else:
        from hf_trainer_run import trainer_args
        from transformers import Trainer

        args = trainer_args(case["ds_path"], out_dir, max_steps=steps, checkpoint_all=case["checkpoint_all"])
        # enough sequences for every rank's steps (the Trainer's sampler spreads the dataset over the ranks)
        data = [{"input_ids": ids[i % len(ids)], "labels": ids[i % len(ids)]} for i in range(len(ids) * steps * RANKS)]
        with window:
            model = _model(config, case, args_made=True)
            Trainer(model=model, args=args, train_dataset=data, callbacks=[_step_ranges()]).train()
    curve = memprof.CpuCurve.from_profiler(window)
    peaks = [curve.peak(*curve.span(f"autotune.step{s}"))[0] for s in range(steps)]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "step_peak_bytes": peaks}))
    if rank == 0:
        s = curve.span(f"autotune.step{steps - 1}")
        Path(out_dir, "live_at_peak.txt").write_text(curve.live_table(curve.peak(*s)[1]))
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def _model(config, case: dict, args_made: bool = False):
    """from_config (under zero.Init where a live HfDeepSpeedConfig says ZeRO-3), peft's adapters with peft's
    defaults, the first k layers checkpointed as `autotune export` prints it (the Trainer's flag covers all)."""
    import torch
    from transformers import AutoModelForCausalLM

    from autotune.impl.hf import decoder_layers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=case["attention"])
    if case["lora"] is not None:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(**case["lora"]))
    k = case["ckpt_layers"]
    if k and not (args_made and case["checkpoint_all"]):
        model.activation_checkpointing_enable({"use_reentrant": False})
        for i, layer in enumerate(decoder_layers(model)):
            layer.gradient_checkpointing = i < k
    return model


def _plain_setup(config, case: dict):
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(case["ds"])  # noqa: F841 - transformers holds a weak reference to it
    model = _model(config, case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return deepspeed.initialize(model=model, model_parameters=trainable, config=case["ds"])[0]


def _step_ranges():
    """A TrainerCallback that opens `autotune.step<N>` at on_step_begin and closes it at on_step_end."""
    import torch
    from transformers import TrainerCallback

    class StepRanges(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.range = torch.autograd.profiler.record_function(f"autotune.step{state.global_step}")
            self.range.__enter__()

        def on_step_end(self, args, state, control, **kw):
            self.range.__exit__(None, None, None)

    return StepRanges()


# ---- the launcher ----------------------------------------------------------------------------------------------------
def _case_file(tmp: Path, spec, cfg: TrainConfig) -> Path:
    from autotune.deepspeed_config import deepspeed_config
    from autotune.impl import impl_for
    from autotune.impl.lora import lora_config_dict, target_modules
    from autotune.models.hf_config import config_dict

    ds = deepspeed_config(cfg, spec, parse_gpus(CLUSTER))
    ds_path = tmp / "ds.json"
    ds_path.write_text(json.dumps(ds))
    lora = None
    if cfg.method == "lora":
        import torch

        from autotune.models.hf_config import default_attention

        base = impl_for(spec)
        with torch.device("meta"):
            layers = base.layers(
                base.build(spec, dtype=torch.bfloat16, attention=default_attention(spec), num_layers=1)
            )
        lora = lora_config_dict(cfg, target_modules(cfg, layers))
    case = {
        "hf_config": config_dict(spec),
        "ds": ds,
        "ds_path": str(ds_path),
        "lora": lora,
        "micro_batch": cfg.micro_batch,
        "seq_len": cfg.seq_len,
        "ckpt_layers": cfg.ckpt_layers,
        "checkpoint_all": cfg.ckpt_layers == spec.num_layers,
        "attention": cfg.attention,
    }
    path = tmp / "case.json"
    path.write_text(json.dumps(case))
    return path


def run_loop(loop: str, spec, cfg: TrainConfig) -> list[list[int]]:
    """Each rank's step peaks after the warm-up, of a transformers model (ModelSpec `spec`) and `cfg` in one loop
    (also tests/test_lora.py's)."""
    from autotune.trial.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if loop == "trial":
            from autotune.trial.launch import run_trials
            from autotune.trial.record import TrialRequest

            req = TrialRequest(
                model=spec,
                cluster=parse_gpus(CLUSTER),
                config=cfg,
                steps=STEPS,
                warmup_steps=WARMUP,
                out_dir=tmp / "trial",
            )
            res = run_trials([req])[0]
            if res.status != "ok":
                raise RuntimeError(f"trial {res.status}: {res.reason}")
            ranks = json.loads(Path(res.out_dir, "memory_per_step.json").read_text())["ranks"]
            return [d["step_peak_bytes"] for _, d in sorted(ranks.items())]
        case = _case_file(tmp, spec, cfg)
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "LOCAL_SIZE": str(RANKS),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parent / "tests")]),
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS)]
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
        cmd += [__file__, "--rank", loop, str(case), str(tmp)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        found = sorted(tmp.glob("rank*.json"))
        if run.returncode or len(found) != RANKS:
            raise RuntimeError(f"{loop} failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        return [json.loads(p.read_text())["step_peak_bytes"][WARMUP:] for p in found]


FIELDS = ("method", "zero_stage", "precision", "ckpt_layers", "micro_batch", "seq_len", "attention")
FIELDS += ("lora_rank", "lora_targets", "lora_alpha", "lora_dropout")


def measure(only: str | None = None, loops: tuple[str, ...] = LOOPS) -> None:
    """Run the cases (`only`: one) in `loops`; the CSV keeps its other rows and is rewritten after every run."""
    import deepspeed
    import peft
    import torch
    import transformers

    versions = (
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}"
    )
    todo = [(c, loop) for c in case_configs(only) for loop in loops]
    redo = {(c[0], loop) for c, loop in todo}
    rows = [r for r in load() if (r["name"], r["loop"]) not in redo]
    order = {n: i for i, (n, *_) in enumerate(CASES)}
    for (name, family, shape, cfg), loop in todo:
        t0 = time.perf_counter()
        try:
            peaks = run_loop(loop, spec_of(family, shape), cfg)
        except RuntimeError as e:
            print(f"{name:<28} {loop:<8} ! {str(e)[-2000:]}", flush=True)
            continue
        print(f"{name:<28} {loop:<8} {max(map(max, peaks)):>12,} B  ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append(
            {
                "name": name,
                "family": family,
                "hf_config": json.dumps(shape, sort_keys=True),
                "loop": loop,
                **{f: getattr(cfg, f) for f in FIELDS},
                "step_peak_bytes": json.dumps(peaks),
                "measured_bytes": max(map(max, peaks)),
                "measured_by": f"benchmarks/user_loops.py, {RANKS} CPU ranks (gloo), {STEPS} steps after "
                f"{WARMUP}, profiler live bytes; {versions}",
            }
        )
        rows.sort(key=lambda r: (order.get(r["name"], 1e9), LOOPS.index(r["loop"])))
        CSV.parent.mkdir(parents=True, exist_ok=True)
        with CSV.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"{len(rows)} rows in {CSV}")


def load() -> list[dict]:
    if not CSV.exists():
        return []
    with CSV.open() as f:
        return list(csv.DictReader(f))


def train_config(row: dict) -> TrainConfig:
    kinds = {"method": str, "precision": str, "attention": str, "lora_targets": str, "lora_dropout": float}
    return TrainConfig(**{f: kinds.get(f, int)(row[f]) for f in FIELDS})


def report() -> dict:
    """Each case: the estimate and each loop's measured peak; the bar's figures over every run of every loop."""
    from autotune.memory import estimate

    rows = load()
    cluster = parse_gpus(CLUSTER)
    by_case: dict[str, dict] = {}
    for r in rows:
        by_case.setdefault(r["name"], {"row": r})[r["loop"]] = int(r["measured_bytes"])
    print(
        f"== user loops on {RANKS} CPU ranks: estimate vs trial, plain loop, Trainer ({len(rows)} runs, {CSV.name}) =="
    )
    print(f"  {'case':<24} {'config':<40} {'estimate':>11} " + " ".join(f"{x:>21}" for x in LOOPS))
    errors: dict[str, list[float]] = {loop: [] for loop in LOOPS}
    for name, got in by_case.items():
        r = got["row"]
        cfg = train_config(r)
        ours = estimate(spec_of(r["family"], json.loads(r["hf_config"])), cluster, cfg).tensor_peak_bytes
        cells = []
        for loop in LOOPS:
            if loop in got:
                errors[loop].append(ours / got[loop] - 1)
                cells.append(f"{got[loop]:>11,} {100 * (ours / got[loop] - 1):+7.3f}%")
            else:
                cells.append(f"{'-':>21}")
        print(f"  {name:<24} {cfg.short()[:40]:<40} {ours:>11,} " + " ".join(cells))
    out = {}
    for loop, e in errors.items():
        if e:
            s = out[loop] = summary(e)
            print(
                f"  {loop:<8} {s['n']} runs: median |error| {s['median']:.3f}%, worst {s['max']:.3f}%, worst under "
                f"{s['under']:.3f}% (bar: 1%, 3%, 1%)"
            )
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        _rank(*sys.argv[2:5])
    elif "--measure" in sys.argv:
        only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
        loops = tuple(sys.argv[sys.argv.index("--loops") + 1].split(",")) if "--loops" in sys.argv else LOOPS
        if set(loops) - set(LOOPS):
            sys.exit(f"--loops: one or more of {', '.join(LOOPS)}")
        measure(only, loops)
        report()
    else:
        report()
