"""Which grids codecarbon's offline tracker has figures for: the countries of its global energy mix and
the regions of its regional tables (USA states, Canadian provinces, Chinese provinces, Nordic bidding
zones). The job spec checks ``carbon`` against them: codecarbon itself prices an unknown country at the
world average, and an unknown region at the national one, while the report still names the grid given.

Read from codecarbon's own data files, without importing codecarbon (pandas and its trackers), so a spec
is checked in milliseconds.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

# codecarbon's suffixes of a Chinese province's name (core/emissions.py, _CHINA_REGION_SUFFIX)
_CHINA_SUFFIX = re.compile(r"\s+(autonomous region|municipality|province|sheng|shi|zizhiqu)$")
_NORDIC_PREFIX = {"SWE": "SE", "NOR": "NO", "FIN": "FI"}
_REGIONAL_TABLES = {"USA": "2023/usa_emissions.json", "CAN": "2023/canada_energy_mix.json"}


@functools.cache
def _table(name: str) -> dict | None:
    spec = importlib.util.find_spec("codecarbon")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "data" / "private_infra" / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # another codecarbon layout: nothing to check against


def countries() -> set[str] | None:
    """The ISO 3166-1 alpha-3 codes codecarbon has an energy mix for (None: its data cannot be read)."""
    mix = _table("global_energy_mix.json")
    return set(mix) if mix is not None else None


def regions(country: str) -> dict[str, str] | None:
    """The regions codecarbon has figures for in ``country``, each as matched (lower-case for USA and
    Canada, upper-case for the Nordic zones) -> as shown; None where it has none (the national figure)."""
    if country in _REGIONAL_TABLES:
        table = _table(_REGIONAL_TABLES[country])
        return {k: k for k in table if not k.startswith("_")} if table else None
    if country in _NORDIC_PREFIX:
        table = _table("nordic_emissions.json")
        zones = [z for z in (table or {}).get("data", {}) if z.startswith(_NORDIC_PREFIX[country])]
        return {z: z for z in zones} or None
    if country == "CHN":
        table = _table("2023/china_provincial_emissions.json")
        provinces = (table or {}).get("data", {}).values()
        return {name: p["names"][0] for p in provinces for name in p.get("names", [])} or None
    return None


def region_key(country: str, region: str) -> str:
    """``region`` as codecarbon matches it in ``country``'s table."""
    if country in _NORDIC_PREFIX:
        return region.upper()
    folded = " ".join(region.lower().split())
    return _CHINA_SUFFIX.sub("", folded) if country == "CHN" else folded
