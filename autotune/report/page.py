"""The one-page report: report.md and report.html (pictures embedded, opens offline).

Order, as a user reads it: the winner and a three-line why (speed, memory headroom and the next
micro batch, what was ruled out), then the pictures, then the ranked table and the reasons for
pruning (autotune.report.render's Markdown, without its title).
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from autotune.report.pictures import NOT_RECORDED, Pictures
from autotune.search import study as st
from autotune.units import GiB

CAPTIONS = {
    "memory_terms": "Where the memory goes: the peak per device split into its terms, per ranked run and "
    "for each ZeRO stage's pruned candidate closest to fitting.",
    "frontier": "Every decided candidate: throughput against estimated peak memory; pruned candidates at the "
    "cost model's throughput (hollow: never run).",
    "step_time": "Where the step goes: compute, recompute, exposed communication, optimizer.",
}


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def why_lines(study, p: Pictures, recs: list | None = None) -> list[str]:
    """Three lines: why the winner is fastest, how close to the edge it is, what was ruled out."""
    runs = [b for b in p.memory if b.status == "ok"]
    if not runs:
        return ["No configuration ran successfully: see the reasons for pruning and failure below."]
    recs = {r.number: r for r in (st.records(study) if recs is None else recs)}
    win, speed = recs[runs[0].trial], {f.trial: f.throughput for f in p.frontier}
    c, s = win.config, speed[win.number]
    line1 = (
        f"**Winner #{win.number}**: ZeRO {c.zero_stage}, micro batch {c.micro_batch}, grad accum "
        f"{c.grad_accum}, {c.ckpt_layers} checkpointed layers, {c.precision}, seq len {c.seq_len}: "
        f"{s:.4g} {p.objective}/s ({p.source}; the study ranks by {p.objective}/s)"
    )
    if len(runs) > 1:
        s2 = speed[runs[1].trial]
        line1 += f", {100 * (s / s2 - 1):.1f}% faster than #{runs[1].trial} ({s2:.4g})" + within_noise(
            s / s2 - 1, win.result
        )
    t = next((b for b in p.time if b.trial == win.number), None)
    if t and len(t.parts) > 1:
        share = ", ".join(f"{k} {100 * v / t.step_time_s:.0f}%" for k, v in t.parts.items() if v > 0)
        line1 += f"; its step: {share} ({t.source})"
    b = runs[0]
    largest = max(b.groups, key=b.groups.get)
    allowance = sum(b.overhead.values())
    # Two peaks, each named: the table's tensor peak, and that plus the framework allowance (memory/overhead.py),
    # which is what the memory model holds against the capacity; on CPU ranks there is no allowance.
    with_allowance = "with the framework allowance" if allowance else "of tensors (no framework allowance on CPU ranks)"
    line2 = (
        f"**Memory**: peak {_gib(b.total_bytes)} {with_allowance} of {_gib(b.capacity_bytes)} "
        f"({100 * b.total_bytes / b.capacity_bytes:.1f}%, headroom {_gib(b.capacity_bytes - b.total_bytes)}) "
        f"in {b.phase}"
        + (
            f" = tensor peak {_gib(b.tensor_peak_bytes)} (the table's) + allowance {_gib(allowance)} "
            f"({', '.join(k.replace('_', ' ') for k in b.overhead)})"
            if allowance
            else ""
        )
        + ", "
        + (f"largest: {largest} {_gib(b.groups[largest])}" if largest != NOT_RECORDED else "its terms not recorded")
        + f"; {next_micro_batch(p.shown, c.micro_batch, win.number, bool(allowance))}"
    )
    ran = {recs[x.trial].config.zero_stage for x in runs}
    ruled = [
        f"ZeRO {z} needs at least {_gib(x.total_bytes)}"
        for x in p.memory
        if x.status == "pruned" and (z := recs[x.trial].config.zero_stage) not in ran
    ]
    line3 = "**Ruled out**: " + (
        "; ".join(ruled) + f" ({'with the framework allowance' if allowance else 'tensors'}, estimated; capacity "
        f"{_gib(b.capacity_bytes)}: no candidate of {'that stage' if len(ruled) == 1 else 'those stages'} fits)"
        if ruled
        else "no ZeRO stage entirely by memory"
        if "closest_pruned" in p.shown
        else "not recorded (the search stores the closest candidate each ZeRO stage pruned when it ends)"
    )
    return [line1, line2, line3]


def within_noise(margin: float, result) -> str:
    """A clause for the winner's margin over the runner-up where the winner's own measured steps spread by more
    than it (the slowest rank's step times, max - min over their median): one trial each does not tell the two
    apart. On two CPU ranks of a shared machine the steps of one trial spread by a median 10-16% and the same
    configuration read 8% apart between searches (docs/search.md); simulated trials have no spread."""
    if result is None or not result.step_time_s or not result.step_time_spread_s:
        return ""
    spread = result.step_time_spread_s / result.step_time_s
    if margin >= spread:
        return ""
    return (
        f" (within the {100 * spread:.0f}% spread of the winner's own measured steps: one trial each does not "
        "tell the two apart; the space's `trial: steps` measures more)"
    )


def next_micro_batch(shown: dict, micro_batch: int, trial: int, allowance: bool = True) -> str:
    """What one more micro batch would need, as the search stored it for its best run (shown: Pictures.shown): its
    estimated total, with the framework allowance where the devices have one (`allowance`)."""
    nxt = shown.get("next_micro_batch") or {}
    if nxt.get("trial") != trial:
        return f"micro batch {micro_batch + 1}: not recorded (the search estimates it for its best run when it ends)"
    if "invalid" in nxt:  # a config the settings refuse has no estimate
        return f"one more micro batch is not a valid config ({nxt['invalid']})"
    return (
        f"micro batch {nxt['micro_batch']} would need {_gib(nxt['total_bytes'])} "
        f"{'with the framework allowance' if allowance else 'of tensors'} "
        f"({'fits' if nxt['fits'] else 'does not fit'}, estimated)"
    )


def markdown(title: str, head: str, why: list[str], pictures: list[Path], body: str) -> str:
    lines = [f"# {title}", "", head, "", "## Why this configuration", ""] + [f"- {w}" for w in why]
    lines += ["", "## Pictures", ""]
    for pic in pictures:
        lines += [f"![{pic.stem}]({pic.name})", "", f"_{CAPTIONS.get(pic.stem, pic.stem)}_", ""]
    lines += ["## Ranked runs", "", body.strip(), ""]
    return "\n".join(lines)


_TABLE_SEP = re.compile(r"^\|(-+\|)+$")
_INLINE = ((re.compile(r"\*\*(.+?)\*\*"), r"<b>\1</b>"), (re.compile(r"_(.+?)_$"), r"<i>\1</i>"))


def _inline(text: str) -> str:
    out = html.escape(text)
    for pat, rep in _INLINE:
        out = pat.sub(rep, out)
    return out


def to_html(md: str, out_dir: Path) -> str:
    """The Markdown this module and render() write (headings, lists, tables, images) as one
    self-contained page: images inlined as data URIs so it opens offline from anywhere."""
    body, table = [], []

    def flush_table():
        if table:
            rows = [r.strip("|").split("|") for r in table if not _TABLE_SEP.match(r)]
            cells = [
                "<tr>" + "".join(f"<{t}>{_inline(c.strip())}</{t}>" for c in r) + "</tr>"
                for t, r in (("th" if i == 0 else "td", r) for i, r in enumerate(rows))
            ]
            body.append("<table>" + "".join(cells) + "</table>")
            table.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        img = re.fullmatch(r"!\[(.*)\]\((.+)\)", line)
        if img:
            data = base64.b64encode((out_dir / img.group(2)).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(img.group(1))}" src="data:image/png;base64,{data}">')
        elif line.startswith("#"):
            n = len(line) - len(line.lstrip("#"))
            body.append(f"<h{n}>{_inline(line[n:].strip())}</h{n}>")
        elif line.startswith("- "):
            body.append(f"<li>{_inline(line[2:])}</li>")
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
    flush_table()
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}img{max-width:100%}"
        "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;padding:2px 6px}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>autotune report</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_page(
    study, out_dir: Path, p: Pictures, pictures: list[Path], head: list[str], body: str, recs: list | None = None
) -> list[Path]:
    """report.md and report.html in out_dir; `head` is report.header()'s lines (a third for a script's study) and `body`
    render()'s Markdown without its title (passed in: report imports this module, not the reverse);
    `recs` the study's records where the caller read them."""
    md = markdown(head[0], "\n\n".join(head[1:]), why_lines(study, p, recs), pictures, body)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.html").write_text(to_html(md, out_dir))
    return [out_dir / "report.md", out_dir / "report.html"]
