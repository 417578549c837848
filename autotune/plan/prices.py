"""Rental prices for `autotune plan`: autotune/data/prices.yaml, overridden by --prices FILE and
--price TYPE=USD. Prices are inputs, not truths: each carries where it came from and when it was read."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import yaml

from autotune.errors import SpecError

NOTE = (
    "prices are inputs, not truths: on-demand list prices move every few weeks and differ by region and "
    "commitment; override them with --price TYPE=USD or --prices FILE"
)


@dataclass(frozen=True)
class Price:
    usd_per_gpu_hour: float
    provider: str
    source: str
    read: str = ""

    def describe(self) -> str:
        when = f", read {self.read}" if self.read else ""
        return f"{self.provider}: {self.source}{when}"


@cache
def _table() -> dict:
    return yaml.safe_load(resources.files("autotune").joinpath("data/prices.yaml").read_text())["prices"]


def offers(gpu_type: str) -> list[Price]:
    """Every listed offer for a GPU preset name, cheapest first."""
    rows = [
        Price(float(r["usd_per_gpu_hour"]), f"{r['provider']} {r['offer']}", r["source"], str(r["read"]))
        for r in _table().get(gpu_type, [])
    ]
    return sorted(rows, key=lambda p: p.usd_per_gpu_hour)


def default_prices() -> dict[str, Price]:
    """GPU type -> the lowest listed on-demand offer (data/prices.yaml)."""
    return {name: offers(name)[0] for name in _table()}


def _type_name(text: str) -> str:
    from autotune.hardware import lookup_gpu

    return lookup_gpu(text.strip())[0]  # an unknown type: SpecError naming the known ones


def _usd(text, where: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise SpecError(f"{where}: {text!r} is not a price in USD per GPU-hour") from None
    if not v > 0 or v == float("inf"):
        raise SpecError(f"{where}: a price must be a positive number of USD per GPU-hour, got {text!r}")
    return v


def parse_price(text: str) -> tuple[str, Price]:
    """`H100=0.5` -> ("H100-80GB", Price(0.5, "--price")); the type through the --gpus names and aliases."""
    if "=" not in text:
        raise SpecError(f"--price {text!r}: expected TYPE=USD, e.g. H100=2.49")
    name, value = text.split("=", 1)
    return _type_name(name), Price(_usd(value, f"--price {text}"), "--price", f"given on the command line: {text}")


def load_prices_file(path: str) -> dict[str, Price]:
    """A YAML mapping TYPE: USD per GPU-hour (e.g. `H100: 2.49`)."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"--prices {path}: no such file") from None
    except yaml.YAMLError as e:
        raise SpecError(f"--prices {path}: not valid YAML ({e})") from None
    if not isinstance(doc, dict) or not doc:
        raise SpecError(f"--prices {path}: expected a mapping TYPE: USD per GPU-hour, e.g. 'H100: 2.49'")
    return {
        _type_name(str(k)): Price(_usd(v, f"--prices {path}, {k}"), "--prices", f"{p.resolve()}: {k}: {v}")
        for k, v in doc.items()
    }


def prices_for(price_args: list[str] | None = None, prices_file: str | None = None) -> dict[str, Price]:
    """The default table, then the file's prices, then each --price (the last word wins)."""
    out = default_prices()
    if prices_file:
        out.update(load_prices_file(prices_file))
    for text in price_args or []:
        name, price = parse_price(text)
        out[name] = price
    return out
