"""What each of ``resources.job_variables`` may hold, as Trainyard's pool templates (``infra/*-gpu-pool.json``)
declare it. Checked when the spec is parsed: Prefect's API checks a run's variables against its pool's template
only when the launch stage asks for the first group, after staging, and its refusal (a 422) read as an internal
error. ECS's narrower cpu and memory (whole numbers) are still its API's to refuse."""

from __future__ import annotations

from typing import Any


def problem(name: str, value: Any) -> str | None:
    """What is wrong with job variable ``name`` set to ``value`` (its name first), or None."""
    text = _TEXT.get(name)
    if text is not None:
        return None if value is None or isinstance(value, str) else f"{name}: {_kind(value)}; {text}"
    if name in ("cpu", "memory"):
        if value is None or isinstance(value, str) or _number(value):
            return None
        return f"{name}: {_kind(value)}; give a number or a quantity such as '4' or '16Gi'"
    if name in ("gpus", "shared_memory_mib"):
        if _whole(value) and value >= 0 or (value is None and name == "shared_memory_mib"):
            return None
        return f"{name}: {_kind(value)}; give a whole number of at least 0"
    if name in ("env", "node_selector"):
        if not isinstance(value, dict):
            return f"{name}: {_kind(value)}, not a mapping; write NAME: value lines"
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{name}: the name {key!r} is not text; quote it"
            if not (isinstance(item, str) or (item is None and name == "env")):
                # YAML reads OMP_NUM_THREADS: 4 as a number, and a pool's API refuses it
                return f"{name}.{key}: {_kind(item)}; its values are text: quote it ({str(item).lower()!r})"
        return None
    if name == "tolerations":
        if isinstance(value, list) and all(isinstance(t, dict) for t in value):
            return None
        return f"{name}: {_kind(value)}; give a list of mappings (key, operator, value, effect)"
    return None


_TEXT = {"image": "give the image's name, as text", "shm_size": "give a size as text, such as '16g'"}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return f"{str(value).lower()} is a boolean"
    if _number(value):
        return f"{value!r} is a number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"{value!r} is text"
    return f"{value!r} is a {'list' if isinstance(value, list) else 'mapping' if isinstance(value, dict) else 'value'}"
