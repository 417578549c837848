"""The plan's picture: hours against dollars per GPU option, the Pareto front joined and labelled.
As the report's pictures (autotune/report/pictures.py): computed first as plain data, so tests and the
notebook check what is drawn, then drawn with matplotlib (Agg, files only). Every point is simulated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotune.pictures import pyplot, save


@dataclass(frozen=True)
class PlanPoint:
    gpus: str
    hours: float
    usd: float
    pareto: bool
    source: str
    """simulated, or simulated x a measured study's factor (--calibrate)."""
    global_batch: int = 0
    """Sequences per optimizer step of the option's configuration."""


def plan_points(result) -> list[PlanPoint]:
    """One point per ranked option of a plan.PlanResult."""
    return [PlanPoint(o.gpus, o.hours, o.usd, o.pareto, o.source, o.global_batch) for o in result.options]


def plan_title(model: str, tokens: float, batch: str) -> str:
    """The picture's title: the model, the tokens, and which global batch the options were priced at (`batch`:
    plan.batch_words), simulated."""
    return f"{model}, {tokens:.3g} tokens: which GPUs to rent (simulated)\n{batch}"


def front(points: list[PlanPoint]) -> list[PlanPoint]:
    """The front, fastest first: the line the picture draws."""
    return sorted((p for p in points if p.pareto), key=lambda p: (p.hours, p.usd))


def draw_plan(points: list[PlanPoint], path: Path, title: str) -> Path | None:
    if not points:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    rest = [p for p in points if not p.pareto]
    if rest:
        ax.scatter([p.hours for p in rest], [p.usd for p in rest], color="C7", label=f"option (simulated): {len(rest)}")
    line = front(points)
    ax.plot(
        [p.hours for p in line],
        [p.usd for p in line],
        "-o",
        color="C0",
        zorder=3,
        label=f"Pareto front, hours vs dollars (simulated): {len(line)}",
    )
    for p in points:
        ax.annotate(
            p.gpus,
            (p.hours, p.usd),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize=8,
            color="k" if p.pareto else "C7",
        )
    # options 1-64 GPUs apart span decades: log axes; a few close ones: linear
    if max(p.hours for p in points) > 20 * min(p.hours for p in points):
        ax.set_xscale("log")
    if max(p.usd for p in points) > 20 * min(p.usd for p in points):
        ax.set_yscale("log")
    ax.set_xlabel("hours to train (simulated: cost model)")
    ax.set_ylabel("USD (simulated hours x GPUs x $/GPU-hour; prices are inputs)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    return save(fig, path)
