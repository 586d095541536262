"""Reading a spec: from YAML or a dict, with ``--set`` overrides, into a ``TrainingJob`` or a ``SpecError``
with one line per problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainyard.errors import SpecError
from trainyard.spec.job import TrainingJob


def problems_of(exc: ValidationError) -> list[str]:
    """One ``"field: message"`` line per pydantic error, worded to say what to do."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
        if kind == "missing":
            msg = "required; add it"
        elif kind == "extra_forbidden":
            msg = "unknown field; remove it or fix its spelling"
        elif not isinstance(err.get("input"), dict | list) and "input" in err and not kind.startswith("value_error"):
            msg = f"{msg} (got {err['input']!r})"
        if loc:
            lines.append(f"{loc}: {msg}")
        else:
            # Whole-job checks already name their fields, one problem a line.
            lines.extend(msg.split("\n"))
    return lines


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a spec dict, in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SpecError([f"--set {item!r}: write it as key.path=value, e.g. hyperparameters.epochs=5"])
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError([f"--set {item!r}: {part} is not a section"])
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise SpecError(
                [
                    f"--set {item!r}: the value is not valid YAML ({exc}); quote it for YAML inside the shell's "
                    f"quotes, e.g. --set \"{key}='...'\""
                ]
            ) from None
    return data


def parse_job(data: Any) -> TrainingJob:
    """Validate a spec given as a dict (or a ``TrainingJob``); raise ``SpecError`` listing every problem."""
    if isinstance(data, TrainingJob):
        return data
    if not isinstance(data, dict):
        raise SpecError([f"(job): the spec must be a mapping of fields, got {type(data).__name__}"])
    try:
        return TrainingJob.model_validate(data)
    except ValidationError as exc:
        problems = problems_of(exc)
    raise SpecError(problems)


def load_job(path: str | Path, overrides: list[str] | None = None) -> TrainingJob:
    """Read a YAML job spec, apply ``--set`` overrides, and validate it."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}: is a folder; give the job spec's YAML file"]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"]) from None
    except OSError as exc:  # unreadable: permissions, a broken link
        raise SpecError([f"{path}: cannot be read ({exc.strerror or exc})"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"{path}: not valid YAML ({exc})"]) from None
    data = data if data is not None else {}
    if isinstance(data, dict):
        apply_overrides(data, overrides or [])
    return parse_job(data)
