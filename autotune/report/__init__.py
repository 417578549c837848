"""Study -> pandas DataFrame -> ranked table (text, CSV, JSON, Markdown), report.md, trials.csv, plots.

Every number carries its origin in its column name: `(measured)` for a real run, `(simulated)`
for the cost model, `(estimated)` for the memory model. A study is searched with one executor,
so its runs share one source; a mixed study (possible only by hand) is labelled `(mixed: see
source)` and keeps a per-row `source` column.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pandas as pd

from autotune.search import study as st
from autotune.search.space import parse_space
from autotune.train_config import STABILITY_RISKS, searched_fields
from autotune.trial.record import RUN
from autotune.units import GiB

# (column label, trials_frame column): numbers that come from the run, labelled with its source
_MEASURED = (("samples/s", "samples_per_s"), ("tokens/s", "tokens_per_s"), ("TFLOPS", "tflops"), ("MFU %", "mfu_pct"))
_RESULT = (
    "samples_per_s",
    "tokens_per_s",
    "tflops",
    "mfu",
    "step_time_s",
    "peak_bytes",
    "wall_s",
    "log_tail",
    "implementation",
)


def _label(f) -> str:
    """A TrainConfig field's column label: its CLI flag's words (`--zero` -> zero), else its name's."""
    return (f.metadata["flag"] or f.name).lstrip("-").replace("_", " ").replace("-", " ")


_RUNS_AGAIN = "; it runs again on --resume"
"""How the search ends an interrupted trial's reason (search/loop.py): true when written, not always later; the
report shows `interrupted_fates` instead."""


def interrupted_fates(study: optuna.Study, recs: list[st.TrialRecord]) -> dict[int, str]:
    """Per interrupted trial, what became of its configuration, in words that stay true: run again by a later trial,
    or not, and what a --resume would do with it under the study's settings (st.Settings)."""
    decided: dict[tuple, list[st.TrialRecord]] = {}
    for r in recs:
        if r.config is not None and r.status not in ("running", "interrupted"):
            decided.setdefault(r.config.key(), []).append(r)
    settings = st.settings_of(study) or st.Settings()
    ran = sum(r.status in RUN for r in recs)  # what --n-trials counts (search/loop.py Summary.ran)
    stopped = (study.user_attrs.get("stopping") or {}).get("line")
    out = {}
    for r in recs:
        if r.status != "interrupted":
            continue
        again = [x for x in decided.get(r.config.key(), []) if x.number > r.number] if r.config else []
        if again:
            out[r.number] = f"run again as trial {again[0].number} ({again[0].status})"
        elif stopped:
            out[r.number] = "not run again: the stopping rule ended the search without it"
        elif settings.n_trials is not None and ran >= settings.n_trials:
            out[r.number] = f"not run again: --n-trials {settings.n_trials} reached"
        elif settings.exhaustive:
            out[r.number] = "not run again yet: a --resume runs it"
        else:
            out[r.number] = "not run again yet: a --resume runs it unless the stopping rule ends the search first"
    return out


def trials_frame(study: optuna.Study, recs: list[st.TrialRecord] | None = None) -> pd.DataFrame:
    """One row per trial with everything the report needs; bytes as recorded (ints). `recs`: the study's
    records when the caller has read them (a search's report reads them once for all its parts)."""
    rows = []
    recs = st.records(study) if recs is None else recs
    fates = interrupted_fates(study, recs)
    for r in recs:
        res, est = r.result, r.estimate
        rows.append(
            {
                "trial": r.number,
                "state": r.state.name,
                "status": r.status,
                "pruned_by": r.pruned_by,
                "reason": r.reason.removesuffix(_RUNS_AGAIN) if r.number in fates else r.reason,
                "then": fates.get(r.number),
                "source": r.source,
                **(r.config.to_dict() if r.config else {}),
                **{k: getattr(res, k) if res else None for k in _RESULT},
                "est_tensor_bytes": est.get("tensor_bytes"),
                "est_total_bytes": est.get("total_bytes"),
                "capacity_bytes": est.get("capacity_bytes"),
                "dominant_term": est.get("dominant_term"),
            }
        )
    df = pd.DataFrame(rows)
    if len(df):
        df["log_tail"] = df["log_tail"].fillna("")
    return df


def source_label(df: pd.DataFrame) -> str:
    sources = set(df["source"].dropna()) if "source" in df else set()
    return sources.pop() if len(sources) == 1 else ("measured" if not sources else "mixed: see source")


def ranked(df: pd.DataFrame, top: int | None = None, objective: str = "samples") -> pd.DataFrame:
    """Successful runs, fastest first by the study's objective (samples/s or tokens/s), every number
    labelled with where it came from."""
    src = source_label(df) if len(df) else "measured"
    key = "tokens_per_s" if objective == "tokens" else "samples_per_s"
    ok = df[df["status"] == "ok"].sort_values(key, ascending=False, kind="stable") if len(df) else df
    ok = ok.assign(
        mfu_pct=[None if pd.isna(v) else 100 * v for v in ok.get("mfu", [])],
        est_gib=[_gib(v) for v in ok.get("est_tensor_bytes", [])],
        peak_gib=[_gib(v) for v in ok.get("peak_bytes", [])],
    )
    out = pd.DataFrame({"rank": range(1, len(ok) + 1), "trial": ok.get("trial", pd.Series(dtype=int)).to_numpy()})

    def number(col):  # None -> NaN, so every format prints a missing value the same way
        return pd.to_numeric(ok[col].to_numpy() if len(ok) else [], errors="coerce")

    for label, col in _MEASURED:
        out[f"{label} ({src})"] = number(col)
    for f in searched_fields():
        varies = len(ok) and f.name in df and df[f.name].nunique() > 1
        if f.metadata["column"] == "always" or varies:
            out[_label(f)] = ok[f.name].to_numpy() if len(ok) else []
    # tensor bytes only, estimated and as the run saw them; the peak the memory model holds against the capacity
    # adds the framework allowance (memory/overhead.py), which the page's "Why" section shows with it
    out["tensor peak GiB (estimated)"] = number("est_gib")
    out[f"tensor peak GiB ({src})"] = number("peak_gib")
    out["status"] = ok["status"].to_numpy() if len(ok) else []
    if len(ok) and df["source"].nunique() > 1:
        out["source"] = ok["source"].to_numpy()
    # Whose code each row measured (ModelSpec.code_name): hf:<architecture>, builtin, factory:<fn>.
    out["implementation"] = ok["implementation"].to_numpy() if len(ok) else []
    return out.head(top) if top else out


def _gib(v) -> float | None:
    return None if v is None or pd.isna(v) else round(v / GiB, 3)


def outcome_counts(df: pd.DataFrame) -> dict[str, dict[str, int]]:
    """Pruned, failed and interrupted trials: counts per kind, and per reason (memory prunes grouped by
    dominant term)."""
    pruned = df[df["status"] == "pruned"]
    failed = df[df["status"].isin(["oom", "timeout", "crashed", "diverged", "interrupted"])]
    out: dict[str, dict[str, int]] = {"pruned": {}, "failed": {}, "interrupted": {}}
    # plain tuples, not iterrows: a large space prunes tens of thousands of candidates
    for by, term, why in zip(pruned["pruned_by"], pruned["dominant_term"], pruned["reason"]):
        key = (
            f"memory model: does not fit (largest term {term})"
            if by == "memory"
            else {
                "dominated": "dominated: more checkpointing, offload or smaller buckets than needed to fit",
                "oom-implied": "implied out of memory: a smaller micro batch already ran out",
            }.get(by, f"{by}: {why}")
        )
        out["pruned"][key] = out["pruned"].get(key, 0) + 1
    then = failed["then"] if "then" in failed else [None] * len(failed)
    for status, why, fate in zip(failed["status"], failed["reason"], then):
        reason = (why or "").strip().splitlines()[0][:120] if why else ""
        kind = "interrupted" if status == "interrupted" else "failed"
        key = f"{reason}; {fate}" if kind == "interrupted" else f"{status}: {reason}" if reason else status
        out[kind][key] = out[kind].get(key, 0) + 1
    return out


def objective(study: optuna.Study) -> str:
    """What the study ranked by: "samples" (per second; studies before --objective) or "tokens"."""
    return study.user_attrs[st.ATTR].get("objective", "samples")


def header(study: optuna.Study) -> list[str]:
    model, cluster, a = st.specs_of(study)
    gb = a.get("global_batch")
    seqs = parse_space(a["space_text"], a["space_path"]).values["seq_len"] if a.get("space_text") else ("auto",)
    seq = (
        f"seq len {a['seq_len']}"
        if seqs == ("auto",)
        else "seq len searched: " + ", ".join(str(a["seq_len"] if s == "auto" else s) for s in seqs)
    )
    script = st.script_of(study)
    return [
        f"study {study.study_name}: {model.describe()}",
        f"on {cluster.describe()}, {seq}"
        + (f", global batch {gb}" if gb else "")
        + f"; results {a.get('source', 'measured')}; ranked by {objective(study)}/s",
        *([f"script: {script.label()} (each trial ran it; figures read from its DeepSpeed engine)"] if script else []),
    ]


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def markdown_table(df: pd.DataFrame) -> str:
    """GitHub Markdown (pandas' to_markdown would need the tabulate package)."""
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def render(
    study: optuna.Study,
    fmt: str = "table",
    top: int | None = None,
    title: bool = True,
    recs: list[st.TrialRecord] | None = None,
) -> str:
    df = trials_frame(study, recs)
    table = ranked(df, top, objective(study))
    counts = outcome_counts(df) if len(df) else {"pruned": {}, "failed": {}, "interrupted": {}}
    if fmt == "csv":
        return table.to_csv(index=False)
    if fmt == "json":
        ranked_rows = json.loads(table.to_json(orient="records", double_precision=15))
        return (
            json.dumps(
                {
                    "study": study.study_name,
                    "source": source_label(df) if len(df) else None,
                    "implementation": st.specs_of(study)[0].code_name,
                    "script": (s := st.script_of(study)) and s.label(),
                    "ranked": ranked_rows,
                    **counts,
                    "memory_correction": study.user_attrs.get("memory_correction"),
                    "stopping": study.user_attrs.get("stopping"),
                },
                indent=1,
            )
            + "\n"
        )
    lines = header(study)
    if fmt == "markdown":
        # title=False: report_page writes the title and the winner above the table
        lines = ([f"# {lines[0]}", "", *[x for line in lines[1:] for x in (line, "")]] if title else []) + [
            markdown_table(table) if len(table) else "_no successful run_"
        ]
    else:
        lines += ["", table.map(_fmt).to_string(index=False) if len(table) else "no successful run yet"]
    corr = correction_line(study)
    if corr:
        lines += ["", corr]
    stop = (study.user_attrs.get("stopping") or {}).get("line")
    if stop:  # the stopping rule's verdict when it ended the search (autotune/search/stopping.py)
        lines += ["", f"stopped: {stop}"]
    lines += risk_lines(df, table, fmt)
    for kind in ("pruned", "failed", "interrupted"):
        total = sum(counts[kind].values())
        if kind == "interrupted" and not total:
            continue
        lines += ["", f"{'## ' if fmt == 'markdown' else ''}{kind}: {total}"]
        lines += [f"{'- ' if fmt == 'markdown' else '  '}{n} x {why}" for why, n in counts[kind].items()]
    return "\n".join(lines) + "\n"


def risk_lines(df: pd.DataFrame, table: pd.DataFrame, fmt: str) -> list[str]:
    """Ranked runs whose settings risk training stability (train_config.STABILITY_RISKS), by rank."""
    out = []
    for name, text in STABILITY_RISKS.items():
        if name not in df or not len(table):
            continue
        risky = set(df.loc[df[name].fillna(False).astype(bool), "trial"])
        ranks = [str(r) for r, t in zip(table["rank"], table["trial"]) if t in risky]
        if ranks:
            out += ["", f"{'**warning**' if fmt == 'markdown' else 'WARNING'}: rank {', '.join(ranks)}: {text}"]
    return out


def correction_line(study: optuna.Study) -> str:
    """The memory model's online correction (autotune/memory/correction.py) and its effect on the
    estimate-vs-measured error over this study's measured trials."""
    c = study.user_attrs.get("memory_correction") or {}
    if not (c.get("measured_trials") or c.get("oom_trials")):
        return ""

    def pct(x):
        return "-" if x is None else f"{100 * x:.2f}%"

    return (
        f"memory model correction: x{c['factor']:.3f} on the estimated tensor peak, from "
        f"{c['measured_trials']} measured and {c['oom_trials']} out-of-memory trials; "
        f"|estimated/measured - 1| median {pct(c['median_abs_error_before'])} -> "
        f"{pct(c['median_abs_error_after'])}, max {pct(c['max_abs_error_before'])} -> "
        f"{pct(c['max_abs_error_after'])}"
    )


def write_outputs(
    study: optuna.Study, out_dir: Path | None = None, recs: list[st.TrialRecord] | None = None
) -> list[Path]:
    """trials/<study>/report.md, report.html, trials.csv, the three pictures of report_pictures,
    throughput.png, memory.png. The study's records are read once (`recs`, or here) for all of them."""
    from autotune.report import page as report_page
    from autotune.report import pictures as report_pictures

    out_dir = Path(out_dir or st.study_dir(study.study_name))
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = st.records(study) if recs is None else recs
    df = trials_frame(study, recs)
    csv = out_dir / "trials.csv"
    csv.write_text(df.drop(columns=["log_tail"], errors="ignore").to_csv(index=False))
    pics, drawn = report_pictures.write_pictures(study, out_dir, recs)
    plots = [
        p
        for p in (
            report_pictures.plot_throughput(df, out_dir / "throughput.png"),
            report_pictures.plot_memory(df, out_dir / "memory.png"),
        )
        if p is not None
    ]
    pages = report_page.write_page(
        study, out_dir, pics, drawn + plots, header(study), render(study, "markdown", title=False, recs=recs), recs
    )
    return pages[:1] + [csv] + pages[1:] + drawn + plots
