"""The report's three pictures, each computed first as plain data (so tests and the notebook can
check what is drawn) and then drawn with matplotlib:

- memory:   per ranked run and per ZeRO stage's closest-to-fitting pruned candidate, the estimated
            peak split into its terms (grouped) + the framework allowance, against the capacity;
            the measured peak (tensor bytes) marked on measured runs.
- frontier: every decided trial, throughput against estimated peak per device, by status.
- time:     per ranked run, the step split into compute, recompute, exposed communication and
            optimizer (cost model) or the measured step, unsplit where no profiler trace exists.

Every number carries its source: estimated / traced (memory model), simulated (cost model),
measured (a real run). Every number is read from the study: what its search stored (Search._est_attrs per
trial, SearchSession.run's study attr "report"); what an older study lacks is drawn as "not recorded".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import optuna

from autotune.pictures import pyplot, save
from autotune.search import study as st
from autotune.trial.record import FAILED
from autotune.units import GiB

NOT_RECORDED = "terms not recorded"
"""The one part of a run's bar whose terms its study did not store (runs before they were): its tensor peak."""
GROUPS = (
    "parameters",
    "gradients",
    "optimizer states",
    "activations",
    "logits",
    "buffers",
    "framework allowance",
    NOT_RECORDED,
)


def term_group(term: str) -> str:
    """The picture's group of one memory-model term. Master weights count as optimizer state (the
    fp32 copy the optimizer owns, as in the ZeRO paper's K=12); anything unknown is a buffer."""
    if term == NOT_RECORDED:
        return NOT_RECORDED
    if "logits" in term:
        return "logits"
    if "grad" in term:
        return "gradients"
    if term in ("master_weights",) or term.startswith("optimizer"):
        return "optimizer states"
    if term in ("parameters", "zero3_gathered_params"):
        return "parameters"
    if term in ("activations", "checkpointed_inputs", "recomputed_layer", "rotary_tables"):
        return "activations"
    return "buffers"


# ---- data ------------------------------------------------------------------------------------
@dataclass
class MemoryBar:
    label: str
    trial: int
    status: str
    """ok (ran) or pruned (the best candidate of its ZeRO stage that did not fit)."""
    source: str
    """Where the terms come from: estimated or traced."""
    phase: str
    terms: dict[str, int]
    """The estimate's tensor terms at the peak phase (they sum to tensor_peak_bytes)."""
    overhead: dict[str, int]
    capacity_bytes: int
    measured_peak_bytes: int | None = None
    """Tensor peak of a real run (None for simulated and pruned trials)."""

    @property
    def tensor_peak_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def total_bytes(self) -> int:
        return self.tensor_peak_bytes + sum(self.overhead.values())

    @property
    def groups(self) -> dict[str, int]:
        out = dict.fromkeys(GROUPS, 0)
        for k, v in self.terms.items():
            out[term_group(k)] += v
        out["framework allowance"] += sum(self.overhead.values())
        return out


@dataclass
class FrontierPoint:
    trial: int
    status: str
    """ok, pruned or a failure class (oom, timeout, crashed, diverged)."""
    why: str
    """For pruned: the pruner (memory, dominated, oom-implied); for failed: the class; else ''."""
    peak_bytes: int
    """Estimated peak per device, tensor + framework allowance: the one figure every trial has."""
    throughput: float | None
    """Per second, in the study's objective (Pictures.objective): samples or tokens."""
    throughput_source: str
    """measured / simulated for a run; 'simulated (not run)' for a pruned one (cost model; on the
    axis where there is none, a CPU cluster); 'none' for a failed run (drawn on the axis)."""
    winner: bool = False


@dataclass
class TimeBar:
    label: str
    trial: int
    source: str
    parts: dict[str, float]
    step_time_s: float


@dataclass
class Pictures:
    memory: list[MemoryBar] = field(default_factory=list)
    frontier: list[FrontierPoint] = field(default_factory=list)
    time: list[TimeBar] = field(default_factory=list)
    capacity_bytes: int = 0
    source: str = ""
    """The study's run source: measured or simulated."""
    objective: str = "samples"
    """What the study ranked by, per second: samples or tokens (autotune search --objective)."""
    shown: dict = field(default_factory=dict)
    """The study's user attr "report" (autotune/search/session.py): closest_pruned, next_micro_batch; {} when its
    search did not store it (a study from before it did, or one searched without open_search)."""


def _label(r: st.TrialRecord) -> str:
    c = r.config
    return f"#{r.number} z{c.zero_stage} mb{c.micro_batch} ga{c.grad_accum} ck{c.ckpt_layers}"


def _speed(r: st.TrialRecord, objective: str) -> float | None:
    return r.result.tokens_per_s if objective == "tokens" else r.result.samples_per_s


def _ranked_runs(recs: list[st.TrialRecord], objective: str) -> list[st.TrialRecord]:
    """Runs that finished, fastest first by the study's objective."""
    ok = [r for r in recs if r.status == "ok" and r.result and _speed(r, objective)]
    return sorted(ok, key=lambda r: -_speed(r, objective))


def memory_bars(recs, shown: dict | None, source: str, objective: str = "samples") -> list[MemoryBar]:
    """Ranked runs (their recorded estimate), then per ZeRO stage the memory-pruned candidate closest to
    fitting, as the search stored it (`shown`: the study's user attr "report", autotune/search/session.py).
    A run without its recorded terms (a study from before they were stored) is drawn from its stored
    totals, its terms "not recorded"; nothing is estimated again."""
    bars = []
    for r in _ranked_runs(recs, objective):
        measured = r.result.peak_bytes if source == "measured" else None
        d = r.estimate.get("detail")
        if d:
            bars.append(
                MemoryBar(
                    _label(r),
                    r.number,
                    "ok",
                    d.get("source", "estimated"),
                    d["phase"],
                    d["terms"],
                    d["overhead"],
                    d["capacity_bytes"],
                    measured,
                )
            )
            continue
        e = r.estimate
        total, tensor = e.get("model_total_bytes", e["total_bytes"]), e["tensor_bytes"]
        bars.append(
            MemoryBar(
                _label(r),
                r.number,
                "ok",
                "estimated (terms not recorded)",
                e.get("phase") or "a phase not recorded",
                {NOT_RECORDED: tensor},
                {"framework allowance": total - tensor},
                e["capacity_bytes"],
                measured,
            )
        )
    pruned = {_config_key(r.config.to_dict()): r for r in recs if r.status == "pruned" and r.config}
    for _, p in sorted(((shown or {}).get("closest_pruned") or {}).items(), key=lambda kv: int(kv[0])):
        r, d = pruned.get(_config_key(p["config"])), p["detail"]
        if r is None:  # not a trial of this study: never the case for what its search stored
            continue
        bars.append(
            MemoryBar(
                _label(r) + " (pruned)",
                r.number,
                "pruned",
                "estimated",
                d["phase"],
                d["terms"],
                d["overhead"],
                d["capacity_bytes"],
            )
        )
    return bars


def _config_key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


def frontier_points(recs, cpu: bool, source: str, objective: str = "samples") -> list[FrontierPoint]:
    """Every decided trial once. Pruned trials sit at the cost model's throughput the search stored for them
    (Search._est_attrs), marked as such; where none is stored (CPU ranks, which the cost model does not
    price, or a study from before it was stored) on the axis, saying why."""
    ranked = _ranked_runs(recs, objective)
    winner = ranked[0].number if ranked else None
    pts = []
    for r in recs:
        if r.status not in ("ok", "pruned", *FAILED) or r.config is None:
            continue  # running / interrupted: not decided
        peak = r.estimate.get("total_bytes") or 0
        if r.status == "ok":
            pts.append(
                FrontierPoint(
                    r.number, "ok", "", peak, _speed(r, objective), r.result.source or source, r.number == winner
                )
            )
        elif r.status == "pruned":
            sim = r.estimate.get("simulated_samples_per_s")
            if sim is not None and objective == "tokens":
                sim *= r.config.seq_len
            pts.append(
                FrontierPoint(
                    r.number,
                    "pruned",
                    r.pruned_by or "",
                    peak,
                    sim,
                    "simulated (not run)"
                    if sim is not None
                    else "not run: no cost model on cpu"
                    if cpu
                    else "not run: throughput not recorded",
                )
            )
        else:
            pts.append(FrontierPoint(r.number, r.status, r.status, peak, None, "none"))
    return pts


def time_bars(recs, source: str, objective: str = "samples") -> list[TimeBar]:
    """Per ranked run, the cost model's split the search stored (simulated runs), else the step whole."""
    bars = []
    for r in _ranked_runs(recs, objective):
        b = r.estimate.get("simulated_breakdown_s") if source == "simulated" else None
        if b:
            parts = {
                "compute": b["compute"] + b["attention"] + b["elementwise"],
                "recompute": b["recompute"],
                # exposed: the collectives minus what hides under compute (overlap is negative)
                "exposed communication": b["grad_reduce"] + b["param_gather"] + b["stage3_gather"] + b["overlap"],
                "optimizer": b["optimizer"],
                "offload": b["offload"],
                "host": b.get("host", 0.0),
            }
            bars.append(TimeBar(_label(r), r.number, "simulated (cost model)", parts, sum(parts.values())))
        elif source == "simulated":  # a study from before the split was stored: the step whole
            s = r.result.step_time_s or 0.0
            bars.append(
                TimeBar(_label(r), r.number, "simulated (step, not split: not recorded)", {"simulated step": s}, s)
            )
        else:
            # A search records no profiler trace (TrialRequest.profile is off), so a measured step
            # cannot be split; it is drawn whole rather than split by a guess.
            s = r.result.step_time_s or 0.0
            bars.append(
                TimeBar(_label(r), r.number, "measured (step, not split: no profiler trace)", {"measured step": s}, s)
            )
    return bars


def pictures(study: optuna.Study, recs: list[st.TrialRecord] | None = None) -> Pictures:
    """The three pictures' data, read from the study alone: its trials and its user attr "report"."""
    _, cluster, attrs = st.specs_of(study)
    recs = st.records(study) if recs is None else recs
    source, objective = attrs.get("source", "measured"), attrs.get("objective", "samples")
    shown = study.user_attrs.get("report")
    return Pictures(
        memory_bars(recs, shown, source, objective),
        frontier_points(recs, cluster.gpu.is_cpu, source, objective),
        time_bars(recs, source, objective),
        cluster.capacity_bytes,
        source,
        objective,
        shown or {},
    )


# ---- drawing ---------------------------------------------------------------------------------
def plot_memory_terms(bars: list[MemoryBar], capacity_bytes: int, path: Path) -> Path | None:
    if not bars:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 2 + 0.5 * len(bars)))
    ys = list(range(len(bars)))[::-1]  # the winner on top
    drawn = [g for g in GROUPS if g != NOT_RECORDED or any(b.groups[g] for b in bars)]
    for i, g in enumerate(drawn):
        left = [sum(b.groups[h] for h in drawn[:i]) / GiB for b in bars]
        ax.barh(ys, [b.groups[g] / GiB for b in bars], left=left, color=f"C{i}", label=g)
    meas = [(y, b.measured_peak_bytes / GiB) for y, b in zip(ys, bars) if b.measured_peak_bytes]
    if meas:
        ax.scatter(
            [m for _, m in meas], [y for y, _ in meas], marker="D", color="k", zorder=3, label="measured tensor peak"
        )
    ax.axvline(capacity_bytes / GiB, color="r", ls="--", label="device capacity")
    ax.set_yticks(ys, [f"{b.label}\n{b.source}, peak in {b.phase}" for b in bars], fontsize=8)
    ax.set_xlabel("memory per device, GiB")
    ax.set_title("peak memory per device by term (source and peak phase per bar)", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # outside: never over a bar
    return save(fig, path)


_PRUNE_STYLE = {
    "memory": ("C3", "does not fit (memory model)"),
    "dominated": ("C7", "dominated"),
    "oom-implied": ("C5", "implied out of memory"),
}


def plot_frontier(
    points: list[FrontierPoint], capacity_bytes: int, path: Path, objective: str = "samples"
) -> Path | None:
    """Runs filled (circle: measured, square: simulated); pruned hollow at the cost model's
    throughput (never a run's mark); failed runs as crosses on the axis: they have no throughput."""
    if not points:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    groups: dict[tuple, list[FrontierPoint]] = {}
    for p in points:
        groups.setdefault((p.status, p.why, p.throughput_source), []).append(p)
    for (status, why, src), pts in sorted(groups.items()):
        xs, ys = [p.peak_bytes / GiB for p in pts], [p.throughput or 0.0 for p in pts]
        if status == "ok":
            ax.scatter(
                xs, ys, marker="o" if src == "measured" else "s", color="C0", zorder=3, label=f"run ({src}): {len(pts)}"
            )
        elif status == "pruned":
            color, what = _PRUNE_STYLE.get(why, ("C8", why))
            ax.scatter(
                xs,
                ys,
                marker="o",
                facecolors="none",
                edgecolors=color,
                s=18,
                alpha=0.6,
                label=f"pruned, {what} ({src}): {len(pts)}",
            )
        else:
            ax.scatter(
                xs,
                ys,
                marker="x",
                color="C1" if status == "oom" else "C4",
                zorder=3,
                label=f"failed: {status}: {len(pts)}",
            )
    for p in points:
        if p.winner:
            ax.scatter(
                [p.peak_bytes / GiB],
                [p.throughput],
                marker="*",
                s=300,
                color="gold",
                edgecolors="k",
                zorder=4,
                label=f"winner #{p.trial}",
            )
    ax.axvline(capacity_bytes / GiB, color="r", ls="--", label="device capacity")
    ax.set_xlabel("peak memory per device, GiB (estimated: tensors + framework allowance)")
    ax.set_ylabel(f"{objective}/s (source in legend)")
    ax.set_title("every decided candidate: throughput against peak memory")
    ax.legend(fontsize=7, loc="best")
    return save(fig, path)


_TIME_COLORS = {
    "compute": "C0",
    "recompute": "C1",
    "exposed communication": "C3",
    "optimizer": "C2",
    "offload": "C4",
    "measured step": "C7",
    "simulated step": "C8",
}


def plot_time(bars: list[TimeBar], path: Path) -> Path | None:
    if not bars:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 2 + 0.5 * len(bars)))
    ys = list(range(len(bars)))[::-1]
    names = [n for n in _TIME_COLORS if any(b.parts.get(n) for b in bars)] or ["measured step"]
    for n in names:
        left = [sum(b.parts.get(m, 0.0) for m in names[: names.index(n)]) for b in bars]
        ax.barh(ys, [b.parts.get(n, 0.0) for b in bars], left=left, color=_TIME_COLORS[n], label=n)
    ax.set_yticks(ys, [b.label for b in bars])
    ax.set_xlabel(f"seconds per optimizer step ({bars[0].source})")
    ax.set_title("where the step time goes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # outside: never over a bar
    return save(fig, path)


def write_pictures(
    study: optuna.Study, out_dir: Path, recs: list[st.TrialRecord] | None = None
) -> tuple[Pictures, list[Path]]:
    """memory_terms.png, frontier.png, step_time.png (those with something to draw)."""
    p = pictures(study, recs)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_memory_terms(p.memory, p.capacity_bytes, out_dir / "memory_terms.png"),
        plot_frontier(p.frontier, p.capacity_bytes, out_dir / "frontier.png", p.objective),
        plot_time(p.time, out_dir / "step_time.png"),
    ]
    return p, [x for x in paths if x is not None]


# ---- the table's two plots (throughput.png, memory.png), from report.trials_frame ------------------
def _run_source(df) -> str:
    sources = set(df["source"].dropna()) if "source" in df else set()
    return sources.pop() if len(sources) == 1 else ("measured" if not sources else "mixed: see source")


def plot_throughput(df, path: Path) -> Path | None:
    """One bar per successful run, coloured by ZeRO stage. The legend is drawn from patches, not from
    zero-size bars at x = 0 (a bar at x = 0 is 0.8 wide and pulled the axis to -0.5 samples/s), and
    the axis starts at 0: a throughput is never negative."""
    drawn = draw_throughput(df)
    return save(drawn[0], path) if drawn else None


def draw_throughput(df):
    """(figure, axes) of plot_throughput, or None without a successful run (tests read the axes)."""
    from matplotlib.patches import Patch

    ok = df[df["status"] == "ok"].sort_values("samples_per_s") if len(df) else df
    if not len(ok):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.3 * len(ok)))
    labels = [
        f"#{r.trial} z{r.zero_stage} {r.precision} mb{r.micro_batch} ga{r.grad_accum} ckpt{r.ckpt_layers}"
        for r in ok.itertuples()
    ]
    ax.barh(labels, ok["samples_per_s"], color=[f"C{z}" for z in ok["zero_stage"]])
    ax.legend(
        handles=[Patch(color=f"C{z}", label=f"ZeRO {z}") for z in sorted(ok["zero_stage"].unique())], loc="lower right"
    )
    ax.set_xlim(left=0)
    ax.set_xlabel(f"samples/s ({_run_source(df)})")
    ax.set_title("throughput per configuration")
    return fig, ax


def plot_memory(df, path: Path) -> Path | None:
    """Estimated against measured peak per run, only for runs that were measured: a simulated run's
    peak is its estimate (the simulated executor records the estimate's tensor bytes), so every
    simulated point sits on the diagonal and says nothing."""
    if not len(df) or "source" not in df:
        return None
    runs = df[df["peak_bytes"].notna() & df["est_tensor_bytes"].notna() & (df["source"] == "measured")]
    if not len(runs):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    est, meas = runs["est_tensor_bytes"] / GiB, runs["peak_bytes"] / GiB
    for z in sorted(runs["zero_stage"].unique()):
        sel = runs["zero_stage"] == z
        ax.scatter(est[sel], meas[sel], color=f"C{z}", label=f"ZeRO {z}")
    hi = max(est.max(), meas.max()) * 1.05
    ax.plot([0, hi], [0, hi], "k--", lw=1, label="estimate = measured")
    ax.set_xlabel("peak tensor memory per device, GiB (estimated)")
    ax.set_ylabel("peak tensor memory per device, GiB (measured)")
    ax.set_title("memory model vs run (measured runs only)")
    ax.legend()
    return save(fig, path)
