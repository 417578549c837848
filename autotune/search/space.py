"""Search spaces: YAML files a user can read and copy (`search_spaces/*.yaml`), validated with
errors that name the bad key and its line, and expanded into the TrainConfigs to try.

Format: the keys are TrainConfig's searched fields (autotune/train_config.py), every one optional
(omitted: the field's `space` default); a scalar means a one-value list:

    zero_stage: [0, 1, 2, 3]
    precision: [auto]            # auto = bf16 where the device has it, else fp16
    micro_batch: [1, 2, 4, 8]
    ckpt_layers: all             # every k in 0..L; or a list of ints, "L", "L/2", "3L/4"
    grad_accum: [1]              # replaced by global / (micro * world) under --global-batch
    optimizer: [adamw]
    offload_optimizer: [false]
    attention: [auto]            # auto = what transformers picks for the class (sdpa where it has it)
    seq_len: [auto]              # auto = the study's --seq-len; or [2048, 4096, 8192]
    trial: {steps: 6, warmup_steps: 2, timeout: 10m}

Line numbers come from PyYAML's node marks (`yaml.compose`; `Mark.line` is 0-based).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from autotune.errors import SpecError
from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.models.hf_config import default_attention
from autotune.train_config import LORA_FIELDS, TrainConfig, allowed_text, check_config, check_value, searched_fields
from autotune.units import parse_duration_s

SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"
DEFAULT_SPACE = SPACES_DIR / "default.yaml"

TRIAL_KEYS = ("steps", "warmup_steps", "timeout")
_CKPT = re.compile(r"(\d*)L(?:/(\d+))?")


def defaults() -> dict[str, tuple]:
    """The values tried per searched TrainConfig field when a space omits its key."""
    return {f.name: f.metadata["space"] for f in searched_fields()}


@dataclass(frozen=True, kw_only=True)
class TrialSettings:
    steps: int = 6
    """Measured optimizer steps per trial."""
    warmup_steps: int = 2
    timeout_s: float = 600.0
    """Wall-clock limit of one trial."""


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The values to try per searched TrainConfig field; ckpt_layers stays symbolic until a model is
    known, precision may say `auto`."""

    values: dict[str, tuple] = field(default_factory=defaults)
    """Every searched field (train_config.searched_fields) -> the values to try."""
    trial: TrialSettings = field(default_factory=TrialSettings)
    path: str = ""
    text: str = ""
    """The YAML as read, kept in the study so a resumed search uses the same space."""

    @classmethod
    def of(cls, *, trial: TrialSettings | None = None, path: str = "", text: str = "", **values) -> "SearchSpace":
        """A space from keyword values (one tuple per field given); the rest take their defaults."""
        unknown = set(values) - set(defaults())
        if unknown:
            raise SpecError(
                f"search space: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(defaults())}"
            )
        return cls(
            values={**defaults(), **{k: tuple(v) for k, v in values.items()}},
            trial=trial or TrialSettings(),
            path=path,
            text=text,
        )

    def ckpt_values(self, num_layers: int) -> list[int]:
        """Resolve `all`, `L`, `L/2`, `3L/4` and ints (clipped to L) into sorted distinct k."""
        out: set[int] = set()
        for v in self.values["ckpt_layers"]:
            if v == "all":
                out.update(range(num_layers + 1))
            elif isinstance(v, int):
                out.add(min(v, num_layers))
            else:
                m = _CKPT.fullmatch(v)
                out.add(min(num_layers, num_layers * int(m.group(1) or 1) // int(m.group(2) or 1)))
        return sorted(out)

    def resolved(self, name: str, model: ModelSpec, cluster: Cluster, seq_len: int | None = None) -> list:
        """The concrete values of one field for this model and cluster (`all`/`L/2` -> layer counts,
        `auto` precision -> bf16 where the device has it, else fp16, `auto` seq_len -> `seq_len`,
        `auto` attention -> what transformers picks for the model's class: hf_config.default_attention)."""
        if name == "ckpt_layers":
            return self.ckpt_values(model.num_layers)
        vals = self.values[name]
        if name == "seq_len":
            vals = [seq_len if v == "auto" else v for v in vals]
        if name == "precision":
            vals = [("bf16" if cluster.gpu.bf16 else "fp16") if p == "auto" else p for p in vals]
        if name == "attention":
            vals = [default_attention(model) if a == "auto" else a for a in vals]
        return list(dict.fromkeys(vals))


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
    except IsADirectoryError:
        raise SpecError(f"search space {p} is a directory; give a YAML file (examples in {SPACES_DIR})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"search space {p} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    space = parse_space(text, str(p))
    root = yaml.compose(text, Loader=yaml.SafeLoader)  # parse_space read it: valid YAML
    if root is None or isinstance(root, yaml.MappingNode) and not root.value:
        # an empty file, only comments, or `{}`, would search the default space while the user meant their own
        raise SpecError(
            f"search space {p} is empty (no keys); give at least one key ({', '.join(defaults())}, trial), "
            f"or drop --space for the default space ({DEFAULT_SPACE.name})"
        )
    return space


def parse_space(text: str, where: str = "<space>") -> SearchSpace:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else "?"
        raise SpecError(f"search space {where}, line {line}: not valid YAML: {e.problem}") from None
    if root is None:
        return SearchSpace(path=where, text=text)
    if not isinstance(root, yaml.MappingNode):
        raise SpecError(
            f"search space {where}, line {root.start_mark.line + 1}: expected a mapping of "
            f"keys ({', '.join(defaults())}, trial)"
        )
    kw: dict[str, Any] = {}
    for key, value_node, _ in _entries(root, where, (*defaults(), "trial")):
        kw[key] = _trial(value_node, where) if key == "trial" else _values(key, value_node, where)
    return SearchSpace.of(**kw, path=where, text=text)


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
            raise SpecError(
                f"search space {where}, line {node.start_mark.line + 1}: {key}: empty list; "
                f"give at least one value or drop the key"
            )
        return node.value
    if isinstance(node, yaml.MappingNode):
        raise SpecError(
            f"search space {where}, line {node.start_mark.line + 1}: {key}: expected a value "
            f"or a list of values, got a mapping"
        )
    return [node]


def _values(key: str, node: yaml.Node, where: str) -> tuple:
    out: list = []
    for item in _items(key, node, where):
        at = f"search space {where}, line {item.start_mark.line + 1}: {key}"
        if not isinstance(item, yaml.ScalarNode):
            raise SpecError(f"{at}: expected a plain value, got a nested {item.id}")
        v = _scalar(item)
        if not _allowed(key, v):
            raise SpecError(f"{at}: {v!r} is not allowed; {_allowed_text(key)}")
        if v not in out:
            out.append(v)
    return tuple(out)


def _allowed_text(key: str) -> str:
    """What a space may give for `key`: the field's own values, plus the symbolic ones that are
    resolved per model and cluster (SearchSpace.resolved)."""
    if key in ("precision", "attention"):
        return allowed_text(key).replace("choose from ", "choose from auto, ")
    if key == "seq_len":
        return "auto (the study's --seq-len) or " + allowed_text(key)
    if key == "ckpt_layers":
        return allowed_text(key) + ", 'all', 'L', 'L/2', '3L/4' (L = the model's layers)"
    return allowed_text(key)


def _allowed(key: str, v: Any) -> bool:
    if key == "ckpt_layers" and isinstance(v, str):
        return v == "all" or _ckpt_ok(v)
    if key in ("precision", "seq_len", "attention") and v == "auto":
        return True
    return _valid_value(key, v)


def _ckpt_ok(v: str) -> bool:
    m = _CKPT.fullmatch(v)
    return bool(m) and int(m.group(2) or 1) >= 1 and int(m.group(1) or 1) <= int(m.group(2) or 1)


def _trial(node: yaml.Node, where: str) -> TrialSettings:
    if not isinstance(node, yaml.MappingNode):
        raise SpecError(
            f"search space {where}, line {node.start_mark.line + 1}: trial: expected a mapping "
            f"with {', '.join(TRIAL_KEYS)}"
        )
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


def expand(
    space: SearchSpace, model: ModelSpec, cluster: Cluster, *, seq_len: int, global_batch: int | None = None
) -> Expansion:
    """Every valid TrainConfig of `space`, in a fixed order (the product of the searched fields' lists, in
    their declaration order); drops what check_config refuses. `seq_len` is what the space's `auto` sequence
    length means (the study's --seq-len).

    Under `global_batch`, grad_accum = global / (micro * dp), dp = world / (autotp_size x sequence_parallel_size);
    micro batches that do not divide it are left out, as DeepSpeed requires train_batch = micro * accum * dp exactly.

    Most of a large space's product is refused by `TrainConfig.check_combination` (1.2M of full.yaml's 1.27M),
    which reads a few fields only (`_combination_fields`). So that check runs once per combination of those
    fields, and the others (micro batch, checkpointing, sequence length, ...) are multiplied in only where it
    passes; the result, its order and the reasons' order are those of checking every combination in turn
    (`_expand_each`, which runs instead under `global_batch` or should the check read any other field;
    full.yaml for 13B x 4xA100: 8.1 s -> 4.4 s CPU)."""
    names = [f.name for f in searched_fields()]
    lists = [space.resolved(n, model, cluster, seq_len) for n in names]
    if global_batch is not None:  # micro batch and the parallel sizes decide first (measured no faster split)
        return _expand_each(space, model, cluster, names, lists, global_batch)
    checked = _combination_fields()
    ci = [i for i, n in enumerate(names) if n in checked]
    fi = [i for i, n in enumerate(names) if n not in checked]
    n_free = 1
    for i in fi:
        n_free *= len(lists[i])
    defaults = TrainConfig().to_dict()
    # a combination whose values each pass check_value, and whose combination passed check_combination on the
    # namespace, is built without checking them again (TrainConfig.prechecked); any other is built with the checks,
    # which say why it is refused. Where check_combination reads an adapter setting, which __post_init__ resets
    # without adapters before it checks, the namespace's check is not the config's: every config is built checked.
    valid = [[_valid_value(n, v) for v in values] for n, values in zip(names, lists)]
    trusted = not checked & set(LORA_FIELDS)  # the fields not searched keep their defaults, valid by TrainConfig()
    found: list[tuple[tuple[int, ...], TrainConfig]] = []
    counts: dict[str, int] = {}
    first: dict[str, tuple[int, ...]] = {}

    def exclude(why: str, at: tuple[int, ...], n: int = 1) -> None:
        counts[why] = counts.get(why, 0) + n
        first[why] = min(first.get(why, at), at)

    at = [0] * len(names)
    for cidx in itertools.product(*(range(len(lists[i])) for i in ci)):
        for i, j in zip(ci, cidx):
            at[i] = j
        for i in fi:
            at[i] = 0
        base = {**defaults, **{names[i]: lists[i][j] for i, j in zip(ci, cidx)}}
        ns = _Reads(**base)
        try:
            TrainConfig.check_combination(ns)
            refused = None
        except SpecError as e:
            refused = str(e)
        if ns._reads - checked:  # a field this split did not see: check every combination instead
            return _expand_each(space, model, cluster, names, lists, global_batch)
        if refused is not None:
            exclude(refused, tuple(at), n_free)
            continue
        for fidx in itertools.product(*(range(len(lists[i])) for i in fi)):
            for i, j in zip(fi, fidx):
                at[i] = j
            values = {**base, **{names[i]: lists[i][j] for i, j in zip(fi, fidx)}}
            where = tuple(at)
            try:
                if trusted and all(valid[i][j] for i, j in enumerate(where)):
                    cfg = TrainConfig.prechecked(values)
                else:
                    cfg = TrainConfig(**{n: values[n] for n in names})
                check_config(cfg, model, cluster)
            except SpecError as e:
                exclude(str(e), where)
                continue
            found.append((where, cfg))
    found.sort(key=lambda f: f[0])
    out: list[TrainConfig] = []
    seen: set[tuple] = set()
    for _, cfg in found:
        if cfg.key() not in seen:
            seen.add(cfg.key())
            out.append(cfg)
    return _expansion(space, model, cluster, out, {why: counts[why] for why in sorted(counts, key=first.get)})


def _valid_value(name: str, v: Any) -> bool:
    try:
        check_value(name, v)
    except SpecError:
        return False
    return True


def _expansion(
    space: SearchSpace, model: ModelSpec, cluster: Cluster, out: list[TrainConfig], excluded: dict[str, int]
) -> Expansion:
    if not out:
        reasons = "; ".join(f"{n} x {r}" for r, n in excluded.items()) or "the space is empty"
        raise SpecError(
            f"search space {space.path or '<space>'} has no valid candidate for {model.name} on "
            f"{cluster.describe()}: {reasons}"
        )
    return Expansion(candidates=out, excluded=excluded)


def _expand_each(
    space: SearchSpace, model: ModelSpec, cluster: Cluster, names: list[str], lists: list, global_batch: int | None
) -> Expansion:
    """`expand`, checking every combination of the product in turn."""
    world = cluster.world_size
    excluded: dict[str, int] = {}
    out: list[TrainConfig] = []
    seen: set[tuple] = set()
    # refused combinations first, on one plain namespace updated in place: a frozen TrainConfig costs far more
    ns = SimpleNamespace(**TrainConfig().to_dict())
    values = ns.__dict__
    for combo in itertools.product(*lists):
        values.update(zip(names, combo))
        model_ranks = values["autotp_size"] * values["sequence_parallel_size"]
        if global_batch is not None and world % model_ranks == 0:  # else check_config says why
            # the tp (and sp) ranks of a group share a batch: data-parallel ranks are world / (tp x sp)
            # (autotune/parallel.py data_parallel_size)
            mb, dp = values["micro_batch"], world // model_ranks
            if global_batch % (mb * dp):
                why = (
                    f"micro batch {mb} x {dp} data-parallel ranks (tp {values['autotp_size']}, sp "
                    f"{values['sequence_parallel_size']}) does not divide --global-batch {global_batch}"
                )
                excluded[why] = excluded.get(why, 0) + 1
                continue
            values["grad_accum"] = global_batch // (mb * dp)
        try:
            TrainConfig.check_combination(ns)
            cfg = TrainConfig(**{n: values[n] for n in names})
            check_config(cfg, model, cluster)
        except SpecError as e:
            excluded[str(e)] = excluded.get(str(e), 0) + 1
            continue
        if cfg.key() not in seen:
            seen.add(cfg.key())
            out.append(cfg)
    return _expansion(space, model, cluster, out, excluded)


class _Reads(SimpleNamespace):
    """A namespace that notes the names of the attributes read from it (`_reads`): expand's guard that
    check_combination read only the fields `_combination_fields` found."""

    def __init__(self, **kw):
        super().__init__(**kw)
        object.__setattr__(self, "_reads", set())

    def __getattribute__(self, name: str):
        if not name.startswith("_"):
            object.__getattribute__(self, "_reads").add(name)
        return object.__getattribute__(self, name)


@cache
def _combination_fields() -> frozenset[str]:
    """The TrainConfig fields `check_combination` names: attributes it reads, and strings it getattr's."""
    code, names, todo = TrainConfig.check_combination.__code__, set(), []
    todo.append(code)
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        for k in c.co_consts:
            if isinstance(k, str):
                names.add(k)
            elif isinstance(k, tuple):
                names.update(x for x in k if isinstance(x, str))
            elif hasattr(k, "co_consts"):
                todo.append(k)
    return frozenset(names & {f.name for f in dataclasses.fields(TrainConfig)})
