"""Search spaces: YAML files a user can read and copy (`search_spaces/*.yaml`), validated with
errors that name the bad key and its line, and expanded into the TrainConfigs to try.

Format (every key optional; a scalar means a one-value list):

    zero_stage: [0, 1, 2, 3]
    precision: [auto]            # auto = bf16 where the device has it, else fp16
    micro_batch: [1, 2, 4, 8]
    ckpt_layers: all             # every k in 0..L; or a list of ints, "L", "L/2", "3L/4"
    grad_accum: [1]              # replaced by global / (micro * world) under --global-batch
    optimizer: [adamw]
    offload_optimizer: [false]
    attention: [sdpa]
    trial: {steps: 6, warmup_steps: 2, timeout: 10m}

Line numbers come from PyYAML's node marks (`yaml.compose`; `Mark.line` is 0-based).
"""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from autotune.hardware import Cluster
from autotune.models import ModelSpec, SpecError
from autotune.space import ATTENTIONS, OPTIMIZERS, PRECISIONS, TrainConfig, check_config
from autotune.units import parse_duration_s

SPACES_DIR = Path(__file__).resolve().parent.parent / "search_spaces"
DEFAULT_SPACE = SPACES_DIR / "default.yaml"

DEFAULTS: dict[str, tuple] = {
    "zero_stage": (0, 1, 2, 3), "precision": ("auto",), "micro_batch": (1, 2, 4, 8, 16),
    "ckpt_layers": ("all",), "grad_accum": (1,), "optimizer": ("adamw",),
    "offload_optimizer": (False,), "attention": ("sdpa",),
}
TRIAL_KEYS = ("steps", "warmup_steps", "timeout")
_CKPT = re.compile(r"(\d*)L(?:/(\d+))?")


@dataclass(frozen=True, kw_only=True)
class TrialSettings:
    steps: int = 6
    """Measured optimizer steps per trial."""
    warmup_steps: int = 2
    timeout_s: float = 600.0
    """Wall-clock limit of one trial."""


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The values to try per TrainConfig field; ckpt_layers stays symbolic until a model is known."""

    zero_stage: tuple[int, ...] = DEFAULTS["zero_stage"]
    precision: tuple[str, ...] = DEFAULTS["precision"]
    micro_batch: tuple[int, ...] = DEFAULTS["micro_batch"]
    ckpt_layers: tuple[int | str, ...] = DEFAULTS["ckpt_layers"]
    grad_accum: tuple[int, ...] = DEFAULTS["grad_accum"]
    optimizer: tuple[str, ...] = DEFAULTS["optimizer"]
    offload_optimizer: tuple[bool, ...] = DEFAULTS["offload_optimizer"]
    attention: tuple[str, ...] = DEFAULTS["attention"]
    trial: TrialSettings = field(default_factory=TrialSettings)
    path: str = ""
    text: str = ""
    """The YAML as read, kept in the study so a resumed search uses the same space."""

    def ckpt_values(self, num_layers: int) -> list[int]:
        """Resolve `all`, `L`, `L/2`, `3L/4` and ints (clipped to L) into sorted distinct k."""
        out: set[int] = set()
        for v in self.ckpt_layers:
            if v == "all":
                out.update(range(num_layers + 1))
            elif isinstance(v, int):
                out.add(min(v, num_layers))
            else:
                m = _CKPT.fullmatch(v)
                out.add(min(num_layers, num_layers * int(m.group(1) or 1) // int(m.group(2) or 1)))
        return sorted(out)


@dataclass(frozen=True)
class Expansion:
    """The candidates of a space for one model/cluster, and what was left out and why."""

    candidates: list[TrainConfig]
    excluded: dict[str, int]
    """reason -> count of combinations dropped before the memory model (invalid, batch does not divide)."""


def load_space(path: str | Path | None = None) -> SearchSpace:
    """Read and validate a search space file (None: search_spaces/default.yaml, or the same values
    built in where the package is installed without the search_spaces folder)."""
    if path is None and not DEFAULT_SPACE.exists():
        return SearchSpace(path="<built-in default>", text="")
    p = Path(path) if path is not None else DEFAULT_SPACE
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(f"search space {p} does not exist (examples in {SPACES_DIR})") from None
    return parse_space(text, str(p))


def parse_space(text: str, where: str = "<space>") -> SearchSpace:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else "?"
        raise SpecError(f"search space {where}, line {line}: not valid YAML: {e.problem}") from None
    if root is None:
        return SearchSpace(path=where, text=text)
    if not isinstance(root, yaml.MappingNode):
        raise SpecError(f"search space {where}, line {root.start_mark.line + 1}: expected a mapping of "
                        f"keys ({', '.join(DEFAULTS)}, trial)")
    kw: dict[str, Any] = {}
    for key, value_node, _ in _entries(root, where, (*DEFAULTS, "trial")):
        kw[key] = _trial(value_node, where) if key == "trial" else _values(key, value_node, where)
    return SearchSpace(**kw, path=where, text=text)


def _entries(node: yaml.MappingNode, where: str, allowed, prefix: str = ""):
    """(key, value node, "search space W, line N") per entry; an unknown or repeated key is an error."""
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = key_node.value
        at = f"search space {where}, line {key_node.start_mark.line + 1}"
        if key in seen:
            raise SpecError(f"{at}: key '{prefix}{key}' given twice")
        if key not in allowed:
            raise SpecError(f"{at}: unknown key '{prefix}{key}'{_hint(key, allowed)}; allowed: {', '.join(allowed)}")
        seen.add(key)
        yield key, value_node, at


def _hint(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _scalar(node: yaml.Node) -> Any:
    return SafeConstructor().construct_object(node, deep=True)


def _items(key: str, node: yaml.Node, where: str) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        if not node.value:
            raise SpecError(f"search space {where}, line {node.start_mark.line + 1}: {key}: empty list; "
                            f"give at least one value or drop the key")
        return node.value
    if isinstance(node, yaml.MappingNode):
        raise SpecError(f"search space {where}, line {node.start_mark.line + 1}: {key}: expected a value "
                        f"or a list of values, got a mapping")
    return [node]


def _values(key: str, node: yaml.Node, where: str) -> tuple:
    out: list = []
    for item in _items(key, node, where):
        at = f"search space {where}, line {item.start_mark.line + 1}: {key}"
        if not isinstance(item, yaml.ScalarNode):
            raise SpecError(f"{at}: expected a plain value, got a nested {item.id}")
        v = _scalar(item)
        if not _allowed(key, v):
            raise SpecError(f"{at}: {v!r} is not allowed; {_ALLOWED_TEXT[key]}")
        if v not in out:
            out.append(v)
    return tuple(out)


_ALLOWED_TEXT = {
    "zero_stage": "choose from 0, 1, 2, 3",
    "precision": f"choose from auto, {', '.join(PRECISIONS)}",
    "micro_batch": "positive integers",
    "grad_accum": "positive integers",
    "ckpt_layers": "integers >= 0, 'all', 'L', 'L/2', '3L/4' (L = the model's layers)",
    "optimizer": f"choose from {', '.join(OPTIMIZERS)}",
    "offload_optimizer": "true or false",
    "attention": f"choose from {', '.join(ATTENTIONS)}",
}


def _allowed(key: str, v: Any) -> bool:
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if key == "zero_stage":
        return is_int and v in (0, 1, 2, 3)
    if key in ("micro_batch", "grad_accum"):
        return is_int and v >= 1
    if key == "ckpt_layers":
        return (is_int and v >= 0) or (isinstance(v, str) and (v == "all" or _ckpt_ok(v)))
    if key == "offload_optimizer":
        return isinstance(v, bool)
    choices = {"precision": ("auto", *PRECISIONS), "optimizer": OPTIMIZERS, "attention": ATTENTIONS}[key]
    return isinstance(v, str) and v in choices


def _ckpt_ok(v: str) -> bool:
    m = _CKPT.fullmatch(v)
    return bool(m) and int(m.group(2) or 1) >= 1 and int(m.group(1) or 1) <= int(m.group(2) or 1)


def _trial(node: yaml.Node, where: str) -> TrialSettings:
    if not isinstance(node, yaml.MappingNode):
        raise SpecError(f"search space {where}, line {node.start_mark.line + 1}: trial: expected a mapping "
                        f"with {', '.join(TRIAL_KEYS)}")
    kw: dict[str, Any] = {}
    for key, value_node, at in _entries(node, where, TRIAL_KEYS, prefix="trial."):
        at += f": trial.{key}"
        v = _scalar(value_node)
        if key == "timeout":
            try:
                kw["timeout_s"] = parse_duration_s(str(v))
            except ValueError as e:
                raise SpecError(f"{at}: {e}") from None
            continue
        low = 1 if key == "steps" else 0
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise SpecError(f"{at}: expected an integer >= {low}, got {v!r}")
        kw[key] = v
    return TrialSettings(**kw)


def expand(space: SearchSpace, model: ModelSpec, cluster: Cluster, *, seq_len: int,
           global_batch: int | None = None) -> Expansion:
    """Every valid TrainConfig of `space`, in a fixed order; drops what check_config refuses.

    Under `global_batch`, grad_accum = global / (micro * world); micro batches that do not divide
    it are left out, as DeepSpeed requires train_batch = micro * accum * world exactly.
    """
    world = cluster.world_size
    excluded: dict[str, int] = {}
    precisions = []
    for p in space.precision:
        p = ("bf16" if cluster.gpu.bf16 else "fp16") if p == "auto" else p
        if p not in precisions:
            precisions.append(p)
    out: list[TrainConfig] = []
    seen: set[tuple] = set()
    for z, prec, mb, k, ga, opt, off, attn in itertools.product(
            space.zero_stage, precisions, space.micro_batch, space.ckpt_values(model.num_layers),
            space.grad_accum, space.optimizer, space.offload_optimizer, space.attention):
        if global_batch is not None:
            if global_batch % (mb * world):
                why = f"micro batch {mb} x {world} devices does not divide --global-batch {global_batch}"
                excluded[why] = excluded.get(why, 0) + 1
                continue
            ga = global_batch // (mb * world)
        try:
            cfg = TrainConfig(zero_stage=z, precision=prec, micro_batch=mb, ckpt_layers=k, grad_accum=ga,
                              optimizer=opt, offload_optimizer=off, attention=attn, seq_len=seq_len)
            check_config(cfg, model, cluster)
        except SpecError as e:
            excluded[str(e)] = excluded.get(str(e), 0) + 1
            continue
        if cfg.key() not in seen:
            seen.add(cfg.key())
            out.append(cfg)
    if not out:
        reasons = "; ".join(f"{n} x {r}" for r, n in excluded.items()) or "the space is empty"
        raise SpecError(f"search space {space.path or '<space>'} has no valid candidate for {model.name} on "
                        f"{cluster.describe()}: {reasons}")
    return Expansion(candidates=out, excluded=excluded)
