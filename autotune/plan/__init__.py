"""`autotune plan`: which GPUs to rent for a token budget, ranked by hours and dollars.

Per GPU option (a cluster: type and count), the fastest configuration that fits, found by the
search's own parts, composed here and not copied:

    search_space.expand -> memory.estimate per candidate -> search.Plan (the groups of
    search_order.speed_order: per group its first member that fits) -> search.prior.default_prior (the cost
    model on GPUs) -> the group head with the highest prior

then hours = tokens / (tokens/s), dollars = hours x GPUs x $/GPU-hour, $ per million tokens. Every
throughput is the cost model's (simulated), or the cost model rescaled by a measured study of that
GPU type (`--calibrate`, `calibration_from_study`). Prices are inputs (autotune/plan/prices.py).

`--global-batch N` compares every option at the same sequences per optimizer step, as users fix it before they
choose hardware (convergence depends on it): the space is expanded as the search expands it under its
--global-batch (micro batch x data-parallel ranks x grad accum = N, search.space.expand), and an option that
cannot reach N exactly is left out with the reason. Without it each option runs at its own fastest batch,
which the table shows.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotune.errors import SpecError
from autotune.hardware import Cluster, gpu_presets, gpu_table, parse_gpus
from autotune.models import ModelSpec
from autotune.parallel import global_batch as batch_of
from autotune.plan.prices import Price
from autotune.search.space import SearchSpace
from autotune.train_config import TrainConfig

DEFAULT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
"""The issue's default options: every preset GPU type at 1-64 GPUs in powers of two, on nodes of 8."""

PLAN_SPACE = {"zero_stage": (0, 1, 2, 3), "micro_batch": (1, 2, 4, 8, 16), "ckpt_layers": (0, "L/2", "L")}
"""The default space of a plan: the search's default (search_spaces/default.yaml) with checkpointing cut
from every k in 0..L to 0, L/2 and L, so that an option prices 60 candidates, not ~800 (13B: 41 k per
stage and micro batch). A plan says it used this space; --space FILE uses the user's."""


@dataclass(frozen=True)
class Network:
    """The network between an option's nodes as the cost model prices it (costmodel.link_bytes_per_s)."""

    label: str
    """What the table prints: "one node", "1600 Gb/s per node", ..."""
    assumed: str = ""
    """Non-empty where the figure is an assumption with no reference system behind it (data/gpus.yaml
    `network_assumed`), and the user did not give it with @net=: what was assumed."""

    def to_json(self) -> dict:
        return {"label": self.label, "assumed": self.assumed or None}


def network_of(cluster: Cluster) -> Network:
    """The network between `cluster`'s nodes: none for one node; else the node's NICs together, given (@net=) or
    the preset's, marked when the preset's figure is assumed (data/gpus.yaml `network_assumed`, e.g. one 100 Gb/s
    Ethernet NIC per node of RTX 4090s, which have no reference system)."""
    if cluster.num_nodes == 1:
        return Network("one node")
    entry = gpu_table()[cluster.gpu.name]
    per_node = cluster.gpu.inter_node_gbps * cluster.gpus_per_node * 8  # GB/s per GPU -> Gb/s per node
    given = cluster.gpu.inter_node_gbps != entry["inter_node_gbps"]  # @net= replaced the preset's
    label = f"{per_node:,.0f} Gb/s per node" + (" (given)" if given else "")
    assumed = "" if given else str(entry.get("network_assumed") or "")
    return Network(label + (" ASSUMED" if assumed else ""), assumed)


@dataclass(frozen=True)
class Option:
    """One priced GPU option: the fastest fitting configuration found and what N tokens cost on it."""

    gpus: str
    gpu_type: str
    num_gpus: int
    config: TrainConfig
    tokens_per_s: float
    """Whole cluster, tokens per second (simulated, or simulated x a calibration factor)."""
    hours: float
    usd: float
    price: Price
    source: str = "simulated"
    """simulated (the cost model) or "simulated, calibrated by study NAME (x F)"."""
    pareto: bool = False
    network: Network | None = None
    """The network between the option's nodes, and whether it is an assumption (network_of)."""

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro batch x data-parallel ranks x grad accum (autotune.parallel)."""
        return batch_of(self.config, self.num_gpus)

    @property
    def usd_per_m_tokens(self) -> float:
        return self.usd / self.tokens_m

    @property
    def tokens_m(self) -> float:
        return self.tokens_per_s * self.hours * 3600 / 1e6

    def to_json(self) -> dict:
        return {
            "gpus": self.gpus,
            "tokens_per_s": self.tokens_per_s,
            "hours": self.hours,
            "usd": self.usd,
            "usd_per_m_tokens": self.usd_per_m_tokens,
            "usd_per_gpu_hour": self.price.usd_per_gpu_hour,
            "price_source": self.price.describe(),
            "config": self.config.to_dict(),
            "global_batch": self.global_batch,
            "network": self.network.to_json() if self.network else None,
            "simulated": True,
            "source": self.source,
            "pareto": self.pareto,
        }


@dataclass(frozen=True)
class Unfit:
    gpus: str
    reason: str


@dataclass(frozen=True)
class PlanResult:
    options: list[Option]
    """Ranked by `by`, within the budgets."""
    unfit: list[Unfit] = field(default_factory=list)
    """Options with no candidate that fits or no price, or over a budget, with why."""
    space: str = ""
    by: str = "usd"
    tokens: float = 0.0
    global_batch: int | None = None
    """The sequences per optimizer step every option was priced at (--global-batch), or None: each its own."""


def default_options() -> list[str]:
    """Every priced GPU preset (not CPU ranks) at 1-64 GPUs in powers of two, nodes of the type's
    gpus_per_node (8 for all priced types)."""
    from autotune.plan.prices import default_prices

    priced = default_prices()
    return [f"{n}x{name}" for name in gpu_presets() if name in priced for n in DEFAULT_COUNTS]


def plan_space(method: str | None, space: SearchSpace | None) -> SearchSpace:
    """The space of a plan: the user's (--space), else PLAN_SPACE; --method sets its `method`."""
    base = space or SearchSpace.of(**PLAN_SPACE, path="<plan default: search default with ckpt 0, L/2, L>")
    if method is None:
        return base
    return SearchSpace(values={**base.values, "method": (method,)}, trial=base.trial, path=base.path, text=base.text)


def best_config(
    model: ModelSpec, cluster: Cluster, space: SearchSpace, seq_len: int, global_batch: int | None = None
) -> tuple[TrainConfig, float] | str:
    """(the fastest fitting config, its simulated tokens/s over the cluster), or why there is none.
    The candidates, estimate, grouping and prior are the search's (module docstring); under `global_batch` the
    candidates are those whose micro batch x data-parallel ranks x grad accum is exactly that (search.space.expand)."""
    from autotune.memory import estimate
    from autotune.search.loop import Candidate, Plan
    from autotune.search.order import speed_order
    from autotune.search.prior import default_prior
    from autotune.search.space import expand

    try:
        exp = expand(space, model, cluster, seq_len=seq_len, global_batch=global_batch)
    except SpecError as e:
        return _unreachable(e, space, cluster, global_batch)
    cands = [Candidate(c, estimate(model, cluster, c)) for c in exp.candidates]
    heads = Plan(cands, lambda c: c.est.fits, speed_order(model)).available(set())
    if not heads:
        smallest = min(cands, key=lambda c: c.est.total_bytes)
        return (
            f"nothing of {len(cands)} candidates fits: the smallest needs {smallest.est.total_bytes / 2**30:.1f} "
            f"GiB per device of {smallest.est.capacity_bytes / 2**30:.1f}"
        )
    prior = default_prior(model, cluster)
    best = max(heads, key=lambda c: prior(c.cfg))
    return best.cfg, prior(best.cfg) * best.cfg.seq_len


def _unreachable(e: SpecError, space: SearchSpace, cluster: Cluster, global_batch: int | None) -> str:
    """Why an option has no candidate: expand's reasons, or, when every candidate missed the global batch, that
    in one line (micro batch x data-parallel ranks must divide it)."""
    why = str(e)
    if global_batch is None or "does not divide --global-batch" not in why:
        return why
    others = [r for r in why.split(": ", 1)[-1].split("; ") if "does not divide --global-batch" not in r]
    if others:
        return why
    mbs = ", ".join(str(v) for v in space.values.get("micro_batch", ()))
    return (
        f"cannot reach global batch {global_batch} exactly: for every micro batch of the space ({mbs}), micro batch "
        f"x data-parallel ranks (the {cluster.world_size} GPUs / tp x sp) does not divide {global_batch}"
    )


def price_option(
    gpus: str,
    cluster: Cluster,
    cfg: TrainConfig,
    tokens_per_s: float,
    tokens: float,
    price: Price,
    source: str = "simulated",
) -> Option:
    """hours = tokens / tokens/s; usd = hours x GPUs x $/GPU-hour."""
    hours = tokens / tokens_per_s / 3600.0
    return Option(
        gpus=gpus,
        gpu_type=cluster.gpu.name,
        num_gpus=cluster.world_size,
        config=cfg,
        tokens_per_s=tokens_per_s,
        hours=hours,
        usd=hours * cluster.world_size * price.usd_per_gpu_hour,
        price=price,
        source=source,
        network=network_of(cluster),
    )


def pareto_front(options: list[Option]) -> set[int]:
    """Indices of the options no other beats on both hours and dollars (lower is better; an equal
    pair keeps the first)."""
    front = set()
    for i, a in enumerate(options):
        dominated = any(
            (b.hours <= a.hours and b.usd <= a.usd) and (b.hours < a.hours or b.usd < a.usd or j < i)
            for j, b in enumerate(options)
            if j != i
        )
        if not dominated:
            front.add(i)
    return front


def make_plan(
    model: ModelSpec,
    tokens: float,
    gpus: list[str],
    *,
    seq_len: int,
    method: str | None = None,
    space: SearchSpace | None = None,
    prices: dict[str, Price],
    max_hours: float | None = None,
    max_usd: float | None = None,
    by: str = "usd",
    calibration: dict[str, tuple[float, str]] | None = None,
    global_batch: int | None = None,
    progress=None,
) -> PlanResult:
    """Price every option of `gpus`, mark the hours-vs-dollars front, rank by `by`, apply the budgets.
    `calibration`: GPU type -> (factor, what it came from), multiplying that type's simulated tokens/s.
    `global_batch`: price every option at that many sequences per optimizer step (module docstring)."""
    if not (tokens > 0 and math.isfinite(tokens)):
        raise SpecError(f"--tokens must be a positive number, got {tokens}")
    if by not in ("usd", "hours"):
        raise SpecError(f"--by must be usd or hours, got {by!r}")
    if global_batch is not None and (isinstance(global_batch, bool) or global_batch < 1):
        raise SpecError(f"--global-batch must be at least 1, got {global_batch}")
    sp = plan_space(method, space)
    priced, unfit = [], []
    for text in gpus:
        cluster = parse_gpus(text)  # an unknown type is a SpecError: exit 2 with the reason
        if cluster.gpu.is_cpu:
            raise SpecError(f"--gpus {text}: CPU ranks have no cost model and no rental price; plan GPU types")
        price = prices.get(cluster.gpu.name)
        if price is None:
            unfit.append(Unfit(text, f"no price for {cluster.gpu.name}: give --price {cluster.gpu.name}=USD"))
            continue
        if progress:
            progress(text)
        found = best_config(model, cluster, sp, seq_len, global_batch)
        if isinstance(found, str):
            unfit.append(Unfit(text, found))
            continue
        cfg, tok_s = found
        source = "simulated"
        if calibration and cluster.gpu.name in calibration:
            factor, what = calibration[cluster.gpu.name]
            tok_s, source = tok_s * factor, f"simulated x {factor:.3f} ({what})"
        priced.append(price_option(cluster.text, cluster, cfg, tok_s, tokens, price, source))
    front = pareto_front(priced)
    priced = [_with_front(o, i in front) for i, o in enumerate(priced)]
    result = _budgeted(priced, unfit, sp, by, tokens, max_hours, max_usd)
    return replace(result, global_batch=global_batch)


def _with_front(o: Option, on: bool) -> Option:
    return replace(o, pareto=on)


def _budgeted(
    priced: list[Option],
    unfit: list[Unfit],
    sp: SearchSpace,
    by: str,
    tokens: float,
    max_hours: float | None,
    max_usd: float | None,
) -> PlanResult:
    """Rank and apply the budgets; a budget nothing meets is a SpecError naming the closest option."""
    if not priced:
        why = "; ".join(f"{u.gpus}: {u.reason}" for u in unfit) or "no options"
        raise SpecError(f"no GPU option can train this: {why}")
    within = [
        o for o in priced if (max_hours is None or o.hours <= max_hours) and (max_usd is None or o.usd <= max_usd)
    ]
    if not within:
        fastest, cheapest = min(priced, key=lambda o: o.hours), min(priced, key=lambda o: o.usd)
        budget = " and ".join(
            b
            for b in (
                f"--max-hours {max_hours:g}" if max_hours is not None else "",
                f"--max-usd {max_usd:g}" if max_usd is not None else "",
            )
            if b
        )
        raise SpecError(
            f"no option meets {budget}: the fastest, {fastest.gpus}, takes {fastest.hours:.3g} h "
            f"(${fastest.usd:,.0f}); the cheapest, {cheapest.gpus}, costs ${cheapest.usd:,.0f} "
            f"({cheapest.hours:.3g} h) (simulated)"
        )
    over = [Unfit(o.gpus, f"over budget: {o.hours:.3g} h, ${o.usd:,.0f}") for o in priced if o not in within]
    key = (lambda o: (o.usd, o.hours)) if by == "usd" else (lambda o: (o.hours, o.usd))
    return PlanResult(sorted(within, key=key), unfit + over, sp.path, by, tokens)


def batch_words(global_batch: int | None, options: list[Option], seq_len: int) -> str:
    """What the table's head and the picture's title say of the batch: the one fixed for every option, or that each
    option runs at its own fastest (and their range)."""
    if global_batch is not None:
        return f"global batch {global_batch} sequences ({global_batch * seq_len:,} tokens) for every option"
    sizes = sorted({o.global_batch for o in options})
    spread = "" if not sizes else f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    spread = f"{spread} sequences; " if spread else ""
    return f"global batch not fixed: each option's fastest ({spread}--global-batch N fixes it)"


@dataclass(frozen=True)
class PlanReport:
    """What `autotune plan` shows: the ranked plan, for which model and length, and where its picture is."""

    result: PlanResult
    model: str
    seq_len: int
    picture: Path

    def to_json(self) -> dict:
        """`autotune plan --json`'s object."""
        from autotune.plan.prices import NOTE

        result = self.result
        return {
            "model": self.model,
            "tokens": result.tokens,
            "seq_len": self.seq_len,
            "global_batch": result.global_batch,
            "by": result.by,
            "space": result.space,
            "source": "simulated",
            "options": [o.to_json() for o in result.options],
            "left_out": [{"gpus": u.gpus, "reason": u.reason} for u in result.unfit],
            "picture": str(self.picture),
            "prices_note": NOTE,
        }

    def render(self) -> str:
        """`autotune plan`'s table: options ranked, the front starred, each option's global batch and network
        between nodes (an assumed one marked), what was left out and why, the prices."""
        from autotune.plan.prices import NOTE

        result = self.result
        w = max([12] + [len(o.gpus) for o in result.options])
        lines = [
            f"plan: {self.model}, {result.tokens:.4g} tokens at seq len {self.seq_len}, ranked by {result.by} "
            f"(every throughput simulated by the cost model; * = on the hours-vs-dollars Pareto front)",
            batch_words(result.global_batch, result.options, self.seq_len),
            f"space: {result.space}",
            "",
            f"{'':2}{'gpus':<{w}} {'tokens/s (sim)':>15} {'hours':>9} {'USD':>10} {'$/M tok':>8} {'$/GPU-h':>8} "
            f"{'global batch':>12}  {'network between nodes':<27} config (ZeRO, micro batch, grad accum, ckpt layers, "
            "precision)",
        ]
        for o in result.options:
            c = o.config
            net = o.network.label if o.network else ""
            lines.append(
                f"{'*' if o.pareto else ' ':2}{o.gpus:<{w}} {o.tokens_per_s:>15,.0f} {o.hours:>9.3g} {o.usd:>10,.2f} "
                f"{o.usd_per_m_tokens:>8.3f} {o.price.usd_per_gpu_hour:>8.2f} {o.global_batch:>12}  {net:<27} "
                f"z{c.zero_stage} mb{c.micro_batch} ga{c.grad_accum} ck{c.ckpt_layers} {c.precision}"
                + (f" {c.method}" if c.method != "full" else "")
                + (f"  [{o.source}]" if o.source != "simulated" else "")
            )
        assumed = sorted({(o.gpu_type, o.network.assumed) for o in result.options if o.network and o.network.assumed})
        if assumed:
            lines += [""] + [
                f"ASSUMED network between {gpu} nodes: {what}; the plan's hours for them rest on it: give yours "
                f"with --gpus NODESxCOUNTx{gpu}@net=GBITSGbps"
                for gpu, what in assumed
            ]
        if result.unfit:
            lines += ["", "left out:"] + [f"  {u.gpus}: {u.reason}" for u in result.unfit]
        lines += [
            "",
            "prices: "
            + "; ".join(
                sorted({f"{o.gpu_type} {o.price.usd_per_gpu_hour:.2f} ({o.price.describe()})" for o in result.options})
            ),
            NOTE,
            f"picture (simulated): {self.picture}",
        ]
        return "\n".join(lines)


def picture_path(root: Path, model: str, inputs: dict) -> Path:
    """Where a plan's picture goes by default: trials/plan_MODEL_HASH.png, HASH of every input that changes the plan
    (`inputs`: model, tokens, options, space, prices, budgets, ranking, calibration, global batch, ...), so plans of
    other inputs keep their own picture and the same plan run again redraws its own."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return root / f"plan_{Path(model).stem}_{digest}.png"


def plan_gpus(
    model: str,
    tokens: float,
    *,
    impl: str | None = None,
    model_factory: str | None = None,
    gpus: str | list[str] | None = None,
    method: str | None = None,
    seq_len: int | None = None,
    space: str | Path | None = None,
    price: list[str] | None = None,
    prices_file: str | None = None,
    max_hours: float | None = None,
    max_usd: float | None = None,
    by: str = "usd",
    calibrate: list[str] | None = None,
    global_batch: int | None = None,
    picture: str | Path | None = None,
    progress: bool = False,
) -> PlanReport:
    """`autotune plan` as a library: resolve the inputs as the command line gives them, price every option
    (make_plan), draw the picture (default trials/plan_MODEL_HASH.png, picture_path). `gpus`: "8xA100,8xH100" or a
    list (default: default_options()); `price`: ["H100=2.49", ...] over `prices_file` over data/prices.yaml;
    `calibrate`: measured study names; `global_batch`: sequences per optimizer step for every option;
    `progress`: say each option on stderr as it is priced."""
    from autotune.models import default_seq_len, resolve_model
    from autotune.plan.calibrate import calibration_from_studies
    from autotune.plan.picture import draw_plan, plan_points, plan_title
    from autotune.plan.prices import prices_for
    from autotune.search.space import load_space
    from autotune.search.study import trials_root

    spec = resolve_model(model, implementation=impl or "hf", factory=model_factory)
    seq_len = seq_len if seq_len is not None else default_seq_len(spec)
    if isinstance(gpus, str):
        gpus = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else None
    options = list(gpus) if gpus is not None else default_options()
    if not options:
        raise SpecError("--gpus: no option given; e.g. --gpus 8xA100,8xH100")
    prices = prices_for(price, prices_file)
    calibration = calibration_from_studies(calibrate or [])
    sp = load_space(space) if space else None
    say = (lambda g: print(f"[plan] pricing {g} ...", file=sys.stderr)) if progress else None
    result = make_plan(
        spec,
        tokens,
        options,
        seq_len=seq_len,
        method=method,
        space=sp,
        prices=prices,
        max_hours=max_hours,
        max_usd=max_usd,
        by=by,
        calibration=calibration,
        global_batch=global_batch,
        progress=say,
    )
    inputs = {
        "model": spec.name,
        "impl": spec.implementation,
        "factory": spec.factory,
        "tokens": tokens,
        "gpus": options,
        "method": method,
        "seq_len": seq_len,
        "space": (sp.path, sp.text) if sp else None,
        "prices": {k: p.usd_per_gpu_hour for k, p in sorted(prices.items())},
        "max_hours": max_hours,
        "max_usd": max_usd,
        "by": by,
        "calibration": calibration,
        "global_batch": global_batch,
    }
    path = Path(picture) if picture else picture_path(trials_root(), spec.name, inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    title = plan_title(spec.name, tokens, batch_words(global_batch, result.options, seq_len))
    draw_plan(plan_points(result), path, title)
    return PlanReport(result, spec.name, seq_len, path)
