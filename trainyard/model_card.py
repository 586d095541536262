"""What a registered model version says about itself: its lineage tags and its model card.

The lineage tags make a version traceable to its data (channel URIs and manifest digests), its code
(git commit or package version), its job spec, its compute and carbon, and its final metrics. The
pipeline passes what only it knows (manifests, FLOPs, energy, the Prefect run); this module adds what
the engine knows. The model card is the same record as Markdown, for people: the version's
description in MLflow and ``model_card.md`` in its run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
from pathlib import Path

from trainyard.redaction import redact_spec
from trainyard.spec import TrainingJob

CODE_VERSION_ENV = "TRAINYARD_CODE_VERSION"
"""Overrides the detected code version (an image tag, a commit baked into a container without ``.git``)."""

CODE_VERSION_TAG = "trainyard.code_version"
JOB_SPEC_TAG = "trainyard.job_spec"
ENTRYPOINT_TAG = "trainyard.entrypoint_sha256"
METRIC_TAG_PREFIX = "metrics."


def code_version() -> str:
    """``git:<commit>`` (``+dirty`` with uncommitted changes) of the checkout Trainyard runs from, else
    ``trainyard==<version>`` of the installed package."""
    if os.environ.get(CODE_VERSION_ENV):
        return os.environ[CODE_VERSION_ENV]
    here = str(Path(__file__).resolve().parent)
    try:
        top = subprocess.run(
            ["git", "-C", here, "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        # Trainyard's own checkout only: an installed copy inside another project's folder (its .venv) would
        # otherwise record that project's commit
        if Path(top).resolve() != Path(here).parent or not (Path(top) / "pyproject.toml").is_file():
            raise subprocess.SubprocessError("not Trainyard's checkout")
        commit = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return f"git:{commit}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        pass  # not a checkout (an installed wheel), or no git: the package version is what there is
    try:
        return f"trainyard=={importlib.metadata.version('trainyard')}"
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def entrypoint_digest(entrypoint: str) -> str:
    """``sha256:<hex>`` of the source file of an entrypoint's module (``pkg.models`` of ``pkg.models:build``),
    as the process registering the model imports it: which version of the user's model code the job ran
    (Trainyard's own is ``code_version``). Other modules it imports are not covered. ``unknown`` where the
    module has no source file here (a compiled extension, or not importable)."""
    try:
        spec = importlib.util.find_spec(entrypoint.split(":")[0])
        origin = Path(spec.origin) if spec and spec.origin else None
        return f"sha256:{hashlib.sha256(origin.read_bytes()).hexdigest()}" if origin and origin.is_file() else "unknown"
    except (ImportError, ValueError, OSError):
        return "unknown"


def lineage_tags(job: TrainingJob, final_metrics: dict[str, float]) -> dict[str, str]:
    """The engine's share of a version's lineage: code version (and an entrypoint's source digest), job spec,
    final metrics."""
    tags = {
        CODE_VERSION_TAG: code_version(),
        JOB_SPEC_TAG: json.dumps(redact_spec(job.model_dump(mode="json")), sort_keys=True, separators=(",", ":")),
    }
    if job.algorithm.entrypoint:
        tags[ENTRYPOINT_TAG] = entrypoint_digest(job.algorithm.entrypoint)
    tags |= {f"{METRIC_TAG_PREFIX}{k}": f"{v:.6g}" for k, v in final_metrics.items()}
    return tags


def training_tags(outcome, sifting_enabled: bool) -> dict[str, str]:
    """Recovery and training stats of a ``TrainingOutcome`` as lineage tags."""
    seconds = [r.get("recovery_seconds") for r in outcome.recoveries if r.get("recovery_seconds") is not None]
    return {
        "training.stop_reason": str(outcome.stop_reason),
        # the epoch whose parameters the version holds, where not the last (stopping.restore_best)
        "training.restored_epoch": str(outcome.restored_epoch or "none"),
        "training.steps": str(outcome.steps),
        "training.samples_trained": str(outcome.samples_trained),
        "elastic.failures": str(len(outcome.failures)),
        "elastic.recoveries": str(len(outcome.recoveries)),
        "elastic.recovery_seconds_max": f"{max(seconds):.3g}" if seconds else "0",
        "sifting.enabled": str(sifting_enabled).lower(),
    }


def tagged_metrics(tags: dict[str, str]) -> dict[str, str]:
    """A version's final metrics from its ``metrics.<name>`` tags (``lineage_tags``), by name, sorted."""
    return {k.removeprefix(METRIC_TAG_PREFIX): v for k, v in sorted(tags.items()) if k.startswith(METRIC_TAG_PREFIX)}


def io_metadata(schema: dict) -> dict:
    """What the model takes and gives, from the training plan's schema: its input columns in order, and
    for a classifier the class each output (logit) stands for, in order."""
    meta = {"task": schema["task"], "features": list(schema["features"]), "label": schema["label"]}
    if schema["task"] == "classification":
        meta["classes"] = list(schema["classes"])
    return meta


def render(name: str, job_id: str, tags: dict[str, str], io: dict | None = None) -> str:
    """The model card (Markdown) of a version from its lineage tags: data, metrics, carbon, lineage; and,
    given ``io`` (``io_metadata``), its inputs and outputs."""
    channels = sorted({k.split(".")[1] for k in tags if k.startswith("data.") and k.count(".") >= 2})
    lines = [f"# {name}", "", f"Trained by Trainyard job `{job_id}`.", ""]
    if io:
        columns = ", ".join(f"`{f}`" for f in io["features"])
        lines += [
            "## Inputs and outputs",
            "",
            f"Input: float32, {len(io['features'])} columns in this order: {columns}.",
        ]
        if "classes" in io:
            classes = ", ".join(f"`{c}`" for c in io["classes"])
            lines.append(f"Output: one logit per class of `{io['label']}`, in order: {classes} (argmax: the class).")
        else:
            lines.append(f"Output: the predicted `{io['label']}`, one number per row.")
        lines.append("")
    lines += ["## Data", ""]
    if channels:
        lines += ["| channel | URI | manifest digest |", "| --- | --- | --- |"]
        for ch in channels:
            uri, digest = tags.get(f"data.{ch}.uri", "?"), tags.get(f"data.{ch}.manifest_digest", "?")
            lines.append(f"| {ch} | `{uri}` | `{digest}` |")
    else:
        lines.append("No data lineage was recorded.")
    if tags.get("sifting.filtered_manifest_digest"):
        lines += [
            "",
            f"The prefilter chose the training rows: filtered manifest `{tags['sifting.filtered_manifest_digest']}`.",
        ]
    metrics = tagged_metrics(tags)
    lines += ["", "## Metrics", "", "| metric | final value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in sorted(metrics.items())] or ["| (none) | |"]
    lines += ["", "## Compute and carbon", "", "| what | value |", "| --- | --- |"]
    for key, label in (
        ("compute.flops_total", "FLOPs"),
        ("carbon.energy_kwh", "energy (kWh)"),
        ("carbon.emissions_kg", "emissions (kgCO2e)"),
    ):
        lines.append(f"| {label} | {tags.get(key, 'not recorded')} |")
    shown = {"data.", METRIC_TAG_PREFIX, "compute.flops_total", "carbon.energy_kwh", "carbon.emissions_kg"}
    # the approval and the gate's decision change by hand after the card is written (approve, reject, promote,
    # gate): the version's tags say them; a card kept them as they were, beside tags that said otherwise
    changing = ("approval_status", "trainyard.gate")  # (and approval_status.by, .at, .reason)
    rest = {k: v for k, v in tags.items() if not k.startswith((*shown, *changing)) and k != JOB_SPEC_TAG}
    lines += ["", "## Lineage", "", "| tag | value |", "| --- | --- |"]
    lines += [f"| {k} | `{v}` |" for k, v in sorted(rest.items())]
    if JOB_SPEC_TAG in tags:
        spec = json.dumps(json.loads(tags[JOB_SPEC_TAG]), indent=2)
        lines += ["", "## Job spec", "", "```json", spec, "```"]
    return "\n".join(lines) + "\n"


DESCRIPTION_MAX = 4500  # MLflow keeps a version's description in a 5,000-character column (Postgres, MySQL)


def description(card: str) -> str:
    """The card as a version's description: whole when it fits MLflow's column, else without its job spec
    (the longest part), else cut, saying where the whole card is (``model_card.md`` in the version's run)."""
    if len(card) <= DESCRIPTION_MAX:
        return card
    note = "\n\n*The whole card, job spec included, is `model_card.md` in this version's run.*\n"
    shorter = card.split("\n## Job spec", 1)[0].rstrip()
    return shorter[: DESCRIPTION_MAX - len(note)] + note
