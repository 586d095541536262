"""Reading a spec: from YAML or a dict, with ``--set`` overrides, into a ``TrainingJob`` or a ``SpecError``
with one line per problem."""

from __future__ import annotations

import copy
import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import AliasChoices, BaseModel, ValidationError
from pydantic.fields import FieldInfo

from trainyard.errors import SpecError
from trainyard.spec.job import TrainingJob

# The last part of a pydantic error's location when the field takes one of several types: which of them
# the value failed as. Our field names are lower-case words; these are the types pydantic names.
_UNION_TAG = re.compile(r"int|str|bool|float|none|(literal|list|dict|function-\w+)\[.*\]|[A-Z]\w*")
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "str": "text", "bool": "true or false"}


def problems_of(exc: ValidationError) -> list[str]:
    """One ``"field: message"`` line per pydantic error, worded to say what to do; a value that fits none
    of a field's types is one line naming them all (pydantic gives one error per type tried)."""
    lines: list[str] = []
    tried: dict[str, list[str]] = {}  # field -> the types its value failed as, in order
    inputs: dict[str, Any] = {}
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        kind = err["type"]
        if (
            len(loc) > 1
            and _UNION_TAG.fullmatch(loc[-1])
            # (not a key of the user's: an unknown "Label" or "S3_URI", or YAML's null:, looks like a type's name)
            and kind not in ("extra_forbidden", "invalid_key")
            and not kind.startswith("value_error")
        ):
            field = ".".join(loc[:-1])
            if field not in tried:
                lines.append(field)  # a placeholder, filled in below, where its first error came
            tried.setdefault(field, []).append(loc[-1])
            inputs[field] = err.get("input")
            continue
        lines.extend(problems_of_error(err))
    for field, tags in tried.items():
        words = [_TYPE_WORDS.get(t, t.removeprefix("literal[").removesuffix("]")) for t in tags]
        either = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
        lines[lines.index(field)] = f"{field}: give {either} (got {inputs[field]!r})"
    return lines


def problems_of_error(err: Any) -> list[str]:
    """The lines of one pydantic error: a field's one, or a whole-job check's, which name their fields."""
    loc = ".".join(str(p) for p in err["loc"])
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "missing":
        msg = "required; add it"
    elif kind == "extra_forbidden":
        close = difflib.get_close_matches(str(err["loc"][-1]).lower(), _known_fields(err["loc"]), n=1, cutoff=0.6)
        msg = f"unknown field; did you mean {close[0]}? " if close else "unknown field; "
        msg += "remove it or fix its spelling"
    elif kind == "invalid_key":  # YAML's null:, true: or 3: as a key
        loc = ".".join(str(p) for p in err["loc"][:-1])
        msg = f"the key {err.get('input')!r} is not a name (YAML reads null, true and numbers as values); quote it"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        msg = f"a section: give its fields as a mapping, e.g. {{field: value}} (got {err.get('input')!r})"
    elif not isinstance(err.get("input"), dict | list) and "input" in err and not kind.startswith("value_error"):
        msg = f"{msg} (got {err['input']!r})"
    # Whole-job checks already name their fields, one problem a line.
    return [f"{loc}: {msg}"] if loc else msg.split("\n")


def _known_fields(loc: tuple) -> list[str]:
    """The field names (aliases included) of the section an error's location ``loc`` ends in, for a
    "did you mean"; none where the path does not lead to a section (a dict's key, a list's index)."""
    models: list[type[BaseModel]] = [TrainingJob]
    for part in loc[:-1]:
        if isinstance(part, int):  # a list's item: of the sections the list holds
            continue
        models = [m for model in models for m in _models_in(_field_type(model, str(part)))]
    return sorted(
        {name for model in models for field, info in model.model_fields.items() for name in _names(field, info)}
    )


def _names(field: str, info: FieldInfo) -> list[str]:
    """A field's name and the others it is accepted by (``beta_value`` for ``beta``)."""
    alias = info.validation_alias
    others = alias.choices if isinstance(alias, AliasChoices) else [alias] if isinstance(alias, str) else []
    return [field, *(name for name in others if isinstance(name, str))]


def _field_type(model: type[BaseModel], name: str) -> Any:
    """The type of ``model``'s field ``name``; for a name it does not declare, the type of its extra fields
    (``Inputs``' channels beside train and validation), if it takes any."""
    if name in model.model_fields:
        return model.model_fields[name].annotation
    extra = (
        typing.get_type_hints(model).get("__pydantic_extra__") if model.model_config.get("extra") == "allow" else None
    )
    return typing.get_args(extra)[1] if typing.get_origin(extra) is dict else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The sections an annotation can hold, through ``X | None``, unions and a dict's values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict and len(args) == 2:
        args = args[1:]
    return [model for arg in args for model in _models_in(arg)]


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
        problems = problems_of(exc) + _skipped_job_problems(exc, data)
    raise SpecError(problems)


# What the whole-job checks read. A failing field among them is not replaced by its default for a second
# pass: the checks would judge the default (replicas: 0 dropped for 1 would make a drill for group 1 "not a
# replica group"), and a problem the user does not have is worse than one named a try later.
READ_ACROSS_SECTIONS = (
    "inputs",
    "output",
    "algorithm",
    "resources",
    "elastic",
    "sifting",
    "hyperparameters.batch_size",  # (sifting's draw per step)
    "stopping.target_metric",
    "stopping.patience_epochs",
    "stopping.restore_best",
    "registry.promote_if",
)


def _skipped_job_problems(exc: ValidationError, data: dict) -> list[str]:
    """The whole-job checks (``TrainingJob._consistent``) that pydantic skipped because a field failed.

    When no failing field is one they read (``READ_ACROSS_SECTIONS``), they run again on a copy without
    the failing fields (each falls back to its default; a failing ``name``, required and read by none, is
    replaced by a valid one), so one ``validate`` names a bad name, a bad epoch count and a missing label
    at once, not one per try.
    """
    failing = [tuple(str(p) for p in err["loc"]) for err in exc.errors() if err["loc"]]
    if len(failing) < len(exc.errors()) or not failing:
        return []  # the whole-job checks ran: they are among the errors already
    # a failing field within one they read, or a whole section holding one (hyperparameters' names)
    if any(
        _within(".".join(loc), read) or _within(read, ".".join(loc)) for loc in failing for read in READ_ACROSS_SECTIONS
    ):
        return []
    trimmed = copy.deepcopy(data)
    for loc in failing:
        _drop(trimmed, loc)
    if ("name",) in failing:
        trimmed["name"] = "job"  # required, and read by no whole-job check: any valid name will do
    try:
        TrainingJob.model_validate(trimmed)
    except ValidationError as again:
        return [line for err in again.errors() if not err["loc"] for line in problems_of_error(err)]
    return []


def _within(path: str, section: str) -> bool:
    """Whether the dotted ``path`` is ``section`` or inside it."""
    return path == section or path.startswith(f"{section}.")


def _drop(data: object, loc: tuple[str, ...]) -> None:
    """Remove the value at ``loc`` (keys, or list indices as text) from nested dicts and lists, if there."""
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(data, dict) and part in data:
            if last:
                del data[part]
                return
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data) and not last:
            data = data[int(part)]
        else:
            return


class _DuplicateKey(yaml.YAMLError):
    """A mapping key given twice."""


MERGE_TAG = "tag:yaml.org,2002:merge"


def _load_yaml(text: str, name: str = "<spec>"):
    """``yaml.safe_load``, refusing a key given twice in one mapping (PyYAML keeps the last silently, so a
    second ``resources:`` block dropped the first without a word). Checked on the composed node tree, before
    anything is built: a merge key's (``<<: *defaults``) keys may be overridden, as YAML means them to be."""
    loader = yaml.SafeLoader(text)
    loader.name = name  # where its errors say they are: the file, not "<unicode string>"
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(loader, node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(loader: yaml.SafeLoader, root: yaml.Node) -> None:
    stack, visited = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in visited:  # an alias: the node it names is walked once
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, value_node in node.value:
                stack.append(value_node)
                if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue  # merged keys may be overridden; a list or mapping as a key is the spec's to refuse
                key = loader.construct_object(key_node)
                if key in seen:
                    line = key_node.start_mark.line + 1
                    raise _DuplicateKey(f"{key!r} is given twice, at lines {seen[key]} and {line}; keep one")
                seen[key] = key_node.start_mark.line + 1


def load_job(path: str | Path, overrides: list[str] | None = None) -> TrainingJob:
    """Read a YAML job spec, apply ``--set`` overrides, and validate it."""
    path = Path(path)
    try:
        data = _load_yaml(path.read_text(), str(path))
    except FileNotFoundError:
        raise SpecError([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}: is a folder; give the job spec's YAML file"]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"]) from None
    except OSError as exc:  # unreadable: permissions, a broken link
        raise SpecError([f"{path}: cannot be read ({exc.strerror or exc})"]) from None
    except _DuplicateKey as exc:
        raise SpecError([f"{path}: {exc}"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"{path}: not valid YAML ({exc})"]) from None
    data = data if data is not None else {}
    if isinstance(data, dict):
        apply_overrides(data, overrides or [])
    return parse_job(data)
