"""How far the throughput cost model is from what was measured: per calibration point, median, worst.

    PYTHONPATH=. python benchmarks/costmodel_accuracy.py

Prints, for every point in autotune/data/calibration.yaml, the simulated and measured figure in
the scope it was published in (end to end, or DeepSpeed's engine timers for its autotuner's
figures) and simulated / measured - 1, then the per-term breakdown of each simulated step; then one
check that is not fitted: the end-to-end HF Trainer figure published beside the GPT-2 large timer
figures. Then `--pairs` (on by default): rows of llm-foundry's published H100 and A100 tables
(benchmarks/data/llm_foundry_pairs.csv, the same run on both GPUs) that were NOT fitted - only the
four rows in calibration.yaml were - priced and compared, absolute and as the H100/A100 ratio
(median and worst |error| of each), then the same for the 16 further pairs of PAIRS_MORE, then every 125m and 350m
row of llm-foundry's A100 tables (SMALL, issue 49) and every figure of DeepSpeed's autotuner on 16 V100 (V100:
GPT-2 to GPT-2 XL, engine timers and end to end), none fitted but the three GPT-2 large timer figures.
`--cpu` adds runs of our own: the traced op profile of a tiny model, in the stand-in's code and in
transformers', priced with this CPU's roofline (its matmul rate, copy bandwidth and per-op
overhead, measured here with one thread) against the measured forward+backward of the same code. The GPU constants (MAMF, FlashAttention,
S) are not in it: it checks the op accounting (FLOPs, bytes, kernel counts) and the roofline sum.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import time
from pathlib import Path

from autotune.costmodel import calibration_points, simulate
from autotune.train_config import TrainConfig

E2E_CHECK = {
    "point": "gpt2-large-16xv100-z1",
    "samples_per_s": 69.061,
    "source": "microsoft/DeepSpeedExamples autotuning/hf/gpt2-large/README.md, 'HF + DS autotuning "
    "(fast-mode)': 69.061 samples/s (z = 1, mbs = 3), the Trainer's end-to-end figure for the "
    "configuration whose engine-timer figure is 87.3",
}
"""Not fitted: how far the end-to-end price is from the end-to-end figure of the same setup."""


PAIRS = Path(__file__).parent / "data" / "llm_foundry_pairs.csv"
"""mosaicml/llm-foundry scripts/train/benchmarking/README.md, tables 'H100 80GB BF16' and 'A100 80GB
with 1600 Gbps node-node interconnect (RoCE)': every (model, seq len) at 8 GPUs in both tables, its
micro batch, grad accum and activation checkpointing as published (FSDP FULL_SHARD, bf16, flash attention)."""

PAIRS_MORE = Path(__file__).parent / "data" / "llm_foundry_pairs_more.csv"
"""The same two tables at mosaicml/llm-foundry commit 061f2c7ce64e655100286584a7629e2a09f827ba: the 16
further (model, seq len) pairs at 8 GPUs they publish on both GPUs (760M to 30B, seq 512-65536, 13 of
them at 8192 tokens or more). Added on 2026-12-03 to judge the model on, after the fix for long
sequences was chosen on PAIRS; nothing is fitted to them."""

SMALL = Path(__file__).parent / "data" / "llm_foundry_small.csv"
"""Every 125m and 350m row of the same README's A100 tables ('A100 80GB with 1600 Gbps node-node interconnect (RoCE)',
amp_bf16 with FSDP's DEFAULT mixed precision; 'A100 40GB with 1600 Gbps node-node interconnect (RoCE)', bf16 PURE),
at llm-foundry commit 061f2c7: 8 to 128 GPUs, seq 512-65536, micro batch 1-128, no checkpointing. Added for
issue 49 ("small models at large micro batch, about 125M-350M at micro batch 18-32 on 8-32 A100s, priced 27-30%
slower"), to judge the model on; nothing is fitted to them."""

V100 = Path(__file__).parent / "data" / "deepspeed_autotuning_v100.csv"
"""microsoft/DeepSpeedExamples autotuning/hf/{gpt2,gpt2-medium,gpt2-large,gpt2-xl}/README.md: every figure of
DeepSpeed's autotuner on 1 node of 16 V100 (fp16, HF Trainer + DeepSpeed, transformers 4.12): the autotuner's
own metric per ZeRO stage (engine timers: forward + backward + step) and the Trainer's end-to-end figure of the
configuration it chose ("HF + DS autotuning (fast-mode)"). Sequence length 1024: run_clm.py's block size is
GPT-2's n_positions; the gpt2-medium and gpt2-xl test_tune.sh pass --block_size 512 to the tuning run, but at 512
every one of their figures would be priced 1.5-2.4x what was published, at 1024 their timer figures within 18%,
and the hand-tuned gpt2-medium run at 1024 (z1 mb4 142.2) sits where the tuned one (z1 mb6 163.3) does. Only the
three GPT-2 large timer figures are fitted (calibration.yaml); issue 49 names the 0.7-1.5B ones."""

V100_OUTSIDE = {
    ("gpt2-xl", 3): "ZeRO-3 of DeepSpeed 0.5 (2021) ran at 39% of its ZeRO-2 here; what costs it that (its per-module "
    "parameter fetch on the host, for one) is not priced"
}
"""Rows printed but left out of the summary, with why."""

MPT_SHAPES = {
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 12),
    "1b": (2048, 24, 16),
    "3b": (2560, 32, 20),
}
"""(d_model, n_layers, n_heads) of llm-foundry's scripts/train/yamls/pretrain/mpt-125m/350m/760m/1b/3b.yaml
(expansion_ratio 4, vocab 50368, no bias; head dim d_model / n_heads: 64 for 125m and 350m, 128 for the rest);
7b, 13b and 30b are autotune's presets."""


def mpt(name: str, seq_len: int):
    """The MPT of llm-foundry's benchmark tables at `seq_len`, as its yaml builds it: the shape (MPT_SHAPES, or the
    preset), and learned positions of max_seq_len = the run's seq len. The yamls set no `alibi`, so MPT's
    `learned_pos_emb` default holds: the tables' NumParams grow by (seq - 512) x d_model from seq 512 on (350m:
    354,412,544 at 512, 420,997,120 at 65536), which ALiBi would not. The head dim is derived from the shape
    (head_dim=0): a spec replaced from mpt-7b kept its 128, pricing the 64-wide heads of 125m and 350m as 128 wide
    (twice the attention and projection FLOPs: issue 49's small models "27-30% slower")."""
    from autotune.models import resolve_model

    if name in MPT_SHAPES:
        h, layers, heads = MPT_SHAPES[name]
        spec = dataclasses.replace(
            resolve_model("mpt-7b", implementation="builtin"),
            name=f"mpt-{name}",
            num_layers=layers,
            hidden_size=h,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=0,
            ffn_hidden_size=4 * h,
            vocab_size=50368,
            param_count=0,
        )
    else:
        spec = resolve_model(f"mpt-{name}", implementation="builtin")
    return dataclasses.replace(spec, position="learned", max_seq_len=seq_len)


def pair_rows(path: Path = PAIRS) -> list[tuple[dict, float, float]]:
    """(row, simulated tokens/s/GPU, measured) for every row of PAIRS, priced as calibration.yaml
    prices llm-foundry's runs (Runtime: overlapped, unfused per-tensor AdamW over one flat
    parameter per block + the root; the stand-in's code with sdpa; FlashAttention in Triton, the
    `attn_impl: triton` of llm-foundry's benchmark sweep)."""
    from autotune.costmodel import Runtime
    from autotune.hardware import parse_gpus

    out = []
    for row in csv.DictReader(path.open()):
        seq = int(row["seq_len"])
        spec = mpt(row["model"], seq)
        cfg = TrainConfig(
            zero_stage=3,
            micro_batch=int(row["micro_batch"]),
            grad_accum=int(row["grad_accum"]),
            precision="bf16",
            seq_len=seq,
            attention="sdpa",
            ckpt_layers=spec.num_layers if row["activation_checkpointing"] == "true" else 0,
        )
        rt = Runtime(
            overlap_comm=True, fused_optimizer=False, optimizer_tensors=spec.num_layers + 1, attention_kernel="triton"
        )
        sim = simulate(spec, parse_gpus(f"{row['gpus']}x{row['gpu']}"), cfg, runtime=rt).tokens_per_s_per_gpu
        out.append((row, sim, float(row["tokens_per_s_per_gpu"])))
    return out


def print_pairs(path: Path = PAIRS) -> None:
    """Each row of `path` absolute and as the H100/A100 ratio, then the median and worst |error|, of
    all pairs and of those not fitted: the H100/A100 ratio figure and the absolute tokens/s one."""
    from autotune.costmodel import calibration_points

    fitted = {(p.model.name, p.cluster.gpu.name, p.config.micro_batch, p.config.seq_len) for p in calibration_points()}
    rows = pair_rows(path)
    by = {(r["model"], r["seq_len"], r["gpu"]): (s, m) for r, s, m in rows}
    print(f"\nllm-foundry pairs ({path.name}), 8 GPUs (not fitted unless marked *): simulated / measured - 1")
    print(f"{'model':<6} {'seq':>6} {'ckpt':>5} {'H100':>8} {'A100':>8} {'ratio sim':>10} {'measured':>9} {'error':>7}")
    absolute, ratio, absolute_held, ratio_held = [], [], [], []
    for r, s, m in rows:
        if r["gpu"] != "H100-80GB":
            continue
        sa, ma = by[(r["model"], r["seq_len"], "A100-80GB")]
        keys = {(f"mpt-{r['model']}", g, int(r["micro_batch"]), int(r["seq_len"])) for g in ("H100-80GB", "A100-80GB")}
        is_fit = bool(keys & fitted)
        err_r = (s / sa) / (m / ma) - 1
        ratio.append(abs(err_r))
        absolute += [abs(s / m - 1), abs(sa / ma - 1)]
        if not is_fit:
            ratio_held.append(abs(err_r))
            absolute_held += [abs(s / m - 1), abs(sa / ma - 1)]
        print(
            f"{r['model']:<6} {r['seq_len']:>6} {r['activation_checkpointing'][:5]:>5} {s / m - 1:>+8.1%} "
            f"{sa / ma - 1:>+8.1%} {s / sa:>10.2f} {m / ma:>9.2f} {err_r:>+7.1%}{' *' if is_fit else ''}"
        )
    for name, a, r in (("all", absolute, ratio), ("not fitted", absolute_held, ratio_held)):
        print(
            f"{name}: H100/A100 ratio |error| median {statistics.median(r):.1%}, worst {max(r):.1%} ({len(r)} pairs); "
            f"absolute median {statistics.median(a):.1%}, worst {max(a):.1%} ({len(a)} rows)"
        )


def print_rows(path: Path = SMALL) -> None:
    """Each A100 row of `path` priced as pair_rows prices llm-foundry's runs, its error, and the median and worst
    |error|: of all, and of issue 49's range (125m-350m, micro batch 18-32, 8-32 GPUs)."""
    rows = pair_rows(path)
    print(f"\nllm-foundry small models ({path.name}), A100 (not fitted): simulated / measured - 1")
    print(
        f"{'model':<6} {'seq':>6} {'GPUs':>5} {'gpu':<10} {'mb':>4} {'ga':>3} "
        f"{'measured':>9} {'simulated':>10} {'error':>7}"
    )
    errors, named = [], []
    for r, sim, m in rows:
        err = sim / m - 1
        errors.append(abs(err))
        if 18 <= int(r["micro_batch"]) <= 32 and 8 <= int(r["gpus"]) <= 32:
            named.append(abs(err))
        print(
            f"{r['model']:<6} {r['seq_len']:>6} {r['gpus']:>5} {r['gpu']:<10} {r['micro_batch']:>4} "
            f"{r['grad_accum']:>3} {m:>9,.0f} {sim:>10,.0f} {err:>+7.1%}"
        )
    for name, e in (("all", errors), ("issue 49's range (micro batch 18-32, 8-32 GPUs)", named)):
        print(f"{name}: |error| median {statistics.median(e):.1%}, worst {max(e):.1%} ({len(e)} rows)")


def v100_rows(path: Path = V100) -> list[tuple[dict, float, float]]:
    """(row, simulated samples/s, measured) for every row of V100, priced on 1 node of 16 V100 as calibration.yaml
    prices the GPT-2 large figures: transformers' GPT-2 traced (eager attention), fp16, the Trainer's AdamW unfused,
    overlap_comm off (the autotuner's templates), contiguous_gradients off at ZeRO-2 and -3 (template_zero2/3.json),
    each in its scope."""
    import dataclasses

    from autotune.hardware import parse_gpus
    from autotune.models import resolve_model

    points = {p.name: p for p in calibration_points()}
    base = points["gpt2-large-16xv100-z1"].runtime
    cluster = parse_gpus("1x16xV100-32GB")
    out = []
    for row in csv.DictReader(path.open()):
        z = int(row["zero_stage"])
        cfg = TrainConfig(
            zero_stage=z,
            micro_batch=int(row["micro_batch"]),
            grad_accum=1,
            precision="fp16",
            seq_len=int(row["seq_len"]),
            ckpt_layers=0,
            attention="eager",
        )
        rt = dataclasses.replace(base, contiguous_gradients=z < 2)
        sim = simulate(resolve_model(row["model"]), cluster, cfg, runtime=rt, scope=row["scope"]).samples_per_s
        out.append((row, sim, float(row["samples_per_s"])))
    return out


def print_v100(path: Path = V100) -> None:
    """Each V100 row, its error, and the median and worst |error| of those not fitted, per scope."""
    print(f"\nDeepSpeed autotuning on 1 node of 16 V100, fp16 ({path.name}; * fitted): simulated / measured - 1")
    print(f"{'model':<12} {'ZeRO':>4} {'mb':>3} {'scope':<14} {'measured':>9} {'simulated':>10} {'error':>7}")
    held: dict[str, list[float]] = {"engine_timers": [], "end_to_end": []}
    for r, sim, m in v100_rows(path):
        err = sim / m - 1
        fitted = "fitted" in r["source"]
        outside = V100_OUTSIDE.get((r["model"], int(r["zero_stage"])))
        if not fitted and not outside:
            held[r["scope"]].append(abs(err))
        mark = " *" if fitted else (f"  (left out of the summary: {outside})" if outside else "")
        print(
            f"{r['model']:<12} {r['zero_stage']:>4} {r['micro_batch']:>3} {r['scope']:<14} {m:>9.1f} {sim:>10.1f} "
            f"{err:>+7.1%}{mark}"
        )
    for scope, e in held.items():
        print(f"not fitted, {scope}: |error| median {statistics.median(e):.1%}, worst {max(e):.1%} ({len(e)} rows)")


def _median_s(fn, reps: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_roofline() -> tuple[float, float, float]:
    """(FLOP/s of a 512^3 fp32 matmul, bytes/s of a 16M-element fp32 add, seconds per op of a
    training step: the stand-in tiny-llama's forward+backward at 1 x 8 tokens, where every op is
    overhead, over its traced kernel count), one thread."""
    import torch

    from autotune import costops as co

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    flops = 2 * 512**3 / _median_s(lambda: a @ b)
    x, y, z = torch.randn(2**24), torch.randn(2**24), torch.empty(2**24)
    bw = 3 * 4 * 2**24 / _median_s(lambda: torch.add(x, y, out=z))
    spec, step = _step("tiny-llama", "builtin", "sdpa", 1, 8)
    kernels = sum(co.profile_for(spec, "builtin", "fp32", "sdpa", 1, 8).ops(spec.num_layers).values())
    return flops, bw, _median_s(step) / kernels


def _step(name: str, implementation: str, attention: str, mb: int, seq: int):
    """(spec, one fp32 forward+backward of `name` in `implementation`'s code, built through the
    model-code seam as trials build it)."""
    import torch

    from autotune.impl import impl_for
    from autotune.models import resolve_model

    spec = resolve_model(name, implementation=implementation)
    impl = impl_for(spec)
    torch.manual_seed(0)
    model = impl.build(spec, dtype=torch.float32, attention=attention)
    if implementation == "builtin":
        from autotune.impl.builtin import init_weights

        init_weights(model)  # as its trials do: nn.Linear's default init meets denormals in GPT-2's tied head
    batch = torch.randint(0, spec.vocab_size, (mb, seq + 1))

    def step():
        impl.loss(model, batch).backward()
        model.zero_grad(set_to_none=True)

    return spec, step


def cpu_cases() -> list[tuple[str, float, float]]:
    """(case, measured s, priced s) of one forward+backward of tiny models on this CPU, in the
    stand-in's code and in transformers' (each priced from its own traced op profile)."""
    import torch

    from autotune import costops as co

    torch.set_num_threads(1)  # a shared machine
    flops_s, bytes_s, op_s = cpu_roofline()
    print(
        f"\nthis CPU, one thread: matmul {flops_s / 1e9:.1f} GFLOP/s, add {bytes_s / 1e9:.1f} GB/s, "
        f"{op_s * 1e6:.1f} us per op of a training step"
    )
    out = []
    for implementation in ("builtin", "hf"):
        for name, mb, seq, attention in (
            ("tiny-gpt2", 4, 256, "sdpa"),
            ("tiny-llama", 4, 256, "sdpa"),
            ("tiny-gpt2", 2, 512, "eager"),
            ("tiny-llama", 8, 128, "sdpa"),
        ):
            spec, step = _step(name, implementation, attention, mb, seq)
            measured = _median_s(step)
            ops = co.profile_for(spec, implementation, "fp32", attention, mb, seq).ops(spec.num_layers)
            priced = sum(n * (max(op.flops / flops_s, op.nbytes / bytes_s) + op_s) for op, n in ops.items())
            out.append((f"{name} ({implementation}) mb{mb} seq{seq} {attention}", measured, priced))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="also price and time tiny models on this CPU")
    ap.add_argument("--no-pairs", action="store_true", help="skip llm-foundry's H100/A100 pairs")
    args = ap.parse_args()
    errors = []
    print(f"{'point':<24} {'metric':<22} {'scope':<14} {'measured':>10} {'simulated':>10} {'error':>7}")
    rows = []
    for p in calibration_points():
        s = simulate(p.model, p.cluster, p.config, runtime=p.runtime, scope=p.scope)
        sim = getattr(s, p.metric)
        err = sim / p.measured - 1
        errors.append(err)
        rows.append((p, s))
        print(f"{p.name:<24} {p.metric:<22} {p.scope:<14} {p.measured:>10.1f} {sim:>10.1f} {err:>+7.1%}")
    abs_err = [abs(e) for e in errors]
    print(
        f"\nmedian |error| {statistics.median(abs_err):.1%}, worst |error| {max(abs_err):.1%} "
        f"over {len(errors)} calibration figures"
    )

    print("\nper-term breakdown of each simulated step (seconds, share of the step):")
    for p, s in rows:
        terms = s.terms()
        print(
            f"  {p.name:<24} step {s.step_time_s:.4f} s, MFU {100 * s.mfu:.1f}%: "
            + ", ".join(f"{k} {v:.4f} ({100 * v / s.step_time_s:.0f}%)" for k, v in terms.items() if v)
        )

    point = next(p for p in calibration_points() if p.name == E2E_CHECK["point"])
    cfg: TrainConfig = point.config
    e2e = simulate(point.model, point.cluster, cfg, runtime=point.runtime, scope="end_to_end").samples_per_s
    measured = E2E_CHECK["samples_per_s"]
    print(
        f"\nnot fitted, end to end: {point.name} simulated {e2e:.1f} vs HF Trainer end-to-end {measured} "
        f"samples/s: {e2e / measured - 1:+.1%}\n  ({E2E_CHECK['source']})"
    )
    if not args.no_pairs:
        print_pairs(PAIRS)
        print_pairs(PAIRS_MORE)
        print_rows(SMALL)
    print_v100(V100)
    if args.cpu:
        rows = cpu_cases()
        print(f"{'CPU case (ours)':<44} {'measured s':>11} {'priced s':>10} {'error':>7}")
        errs = []
        for case, m, p in rows:
            errs.append(abs(p / m - 1))
            print(f"{case:<44} {m:>11.4f} {p:>10.4f} {p / m - 1:>+7.1%}")
        print(f"CPU cases: median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%}")


if __name__ == "__main__":
    main()
