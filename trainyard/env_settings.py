"""Settings of the machine rather than of a job, read from ``TRAINYARD_*`` environment variables: what
a platform engineer sets on the workers (timeouts, threads per group; the cache's cap is in ``cache``)."""

from __future__ import annotations

import math
import os

from trainyard.errors import TrainyardError


def seconds(name: str, default: float, at_least: float = 0.0) -> float:
    """The environment variable ``name`` as a number of seconds (``default`` where unset or empty),
    never below ``at_least``. Anything but a positive number fails naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return max(default, at_least)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise TrainyardError(f"{name}={text!r} is not a number of seconds; set a positive number, such as {default:g}")
    return max(value, at_least)


# Threads of each replica group's torch (and OpenMP), where a worker runs several groups or jobs at once.
THREADS_ENV = "TRAINYARD_TORCH_THREADS"


def count(name: str, default: int, value: object = None) -> int:
    """The environment variable ``name`` as a whole number of at least 1 (``default`` where unset or
    empty). Anything else fails naming the variable. ``value``: the variable's value as a job sets it
    for its groups (``resources.job_variables.env``), checked instead of this process's."""
    text = (os.environ.get(name, "") if value is None else str(value)).strip()
    if not text:
        return default
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise TrainyardError(f"{name}={text!r} is not a whole number of at least 1; set one, such as {default}")
    return int(text)


def flag(name: str, default: bool = False) -> bool:
    """The environment variable ``name`` as on or off (``default`` where unset or empty). Anything but ``1``,
    ``true``, ``yes``, ``on``, ``0``, ``false``, ``no`` or ``off`` (any case) fails naming the variable."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise TrainyardError(f"{name}={text!r} is neither on nor off; set 1 (or true) to turn it on, 0 to turn it off")


def cuda_visible_devices() -> list[str] | None:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` names (indices, or UUIDs), in its order; ``[]`` where it is set and
    names none (as launch sets it for a CPU group), None where it is unset (every GPU of the machine)."""
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is None:
        return None
    return [name.strip() for name in names.split(",") if name.strip() and name.strip() != "-1"]
