"""The promotion gate: whether a new version takes the ``champion`` alias, by the job's rule.

``registry.promote_if`` names a metric, a direction (``max`` / ``min``), the gain over the champion a
version must exceed (``min_gain``) and an optional carbon ceiling (``max_emissions_kg``): a version whose
job emitted more never becomes champion, even the first. A version that does not win is pointed at by
``candidate``. The decision and its reason are recorded on the version (``trainyard.gate``), which
also marks the gate as done, so a registration finished after a crash does not judge a version twice.
A version a person Rejected before its gate ran (``trainyard models reject`` while its job waited for the
gate, or after the job failed before it) is not judged and takes no alias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainyard.model_card import METRIC_TAG_PREFIX
from trainyard.spec import PromoteIf

GATE_TAG = "trainyard.gate"
EMISSIONS_TAG = "carbon.emissions_kg"
GATE_ROUNDS = 5  # a gate's rounds against champions other gates set meanwhile (see ``gate``)
CHAMPION, CANDIDATE = "champion", "candidate"
APPROVAL_TAG = "approval_status"  # a version's SageMaker-style approval (registry, registry_admin)
REJECTED = "Rejected"


@dataclass(frozen=True, slots=True)
class GateDecision:
    """Whether a new version takes ``champion``, and why (recorded on the version)."""

    wins: bool
    reason: str


def decide(
    rule: PromoteIf | None, ours: float | None, theirs: float | None, has_champion: bool, emissions_kg: float | None
) -> GateDecision:
    """The promotion rule. ``ours`` / ``theirs``: the gate metric of the new version and of the champion.

    A metric that is not a number (NaN: a diverged run's loss) never wins, and loses to any number: by
    comparison alone a NaN champion could never be beaten, every comparison with NaN being false."""
    if rule is not None and ours is not None and not math.isfinite(ours):
        return GateDecision(False, f"this version's {rule.metric} is {ours} (did training diverge?)")
    if rule is not None and rule.max_emissions_kg is not None:
        if emissions_kg is None:
            return GateDecision(False, f"emissions unknown; the carbon ceiling is {rule.max_emissions_kg} kgCO2e")
        if emissions_kg > rule.max_emissions_kg:
            return GateDecision(False, f"emitted {emissions_kg:g} kgCO2e, over the {rule.max_emissions_kg:g} ceiling")
    if not has_champion:
        return GateDecision(True, "no champion yet")
    if rule is None:
        return GateDecision(False, "no registry.promote_if gate: the champion moves only by hand")
    if ours is None:
        return GateDecision(False, f"this version has no final {rule.metric}")
    if theirs is None or not math.isfinite(theirs):
        return GateDecision(True, f"the champion has no {rule.metric}" + ("" if theirs is None else f" ({theirs})"))
    gain = (ours - theirs) if rule.direction == "max" else (theirs - ours)
    # a gain equal to min_gain does not win, however the subtraction rounds (0.8 - 0.7 is 0.10000000000000009)
    wins = gain > rule.min_gain and not math.isclose(gain, rule.min_gain, rel_tol=1e-9, abs_tol=1e-12)
    verdict = "beats" if wins else "does not beat"
    return GateDecision(
        wins,
        f"{rule.metric} {ours:.6g} {verdict} the champion's {theirs:.6g} by more than {rule.min_gain:g} "
        f"({rule.direction})",
    )


def gate(client, rule: PromoteIf | None, name: str, version) -> GateDecision:
    """Move ``champion`` to the new version when it wins, else point ``candidate`` at it; record why.

    MLflow has no compare-and-set for aliases, so two jobs finishing together could each beat the
    champion they read and the last to write would win, better or not. After moving ``champion`` the
    gate reads it back: if another gate moved it meanwhile, this version is judged again against that
    one (a few rounds at most; each round leaves the better of the two).
    """
    if (version.tags or {}).get(APPROVAL_TAG) == REJECTED:  # a person rejected it first (while it waited for the gate)
        reason = "not judged: the version was Rejected before its gate ran; it takes no alias"
        client.set_model_version_tag(name, version.version, GATE_TAG, reason)
        return GateDecision(False, reason)
    metric = rule.metric if rule else None
    ours = _version_metric(client, version, metric)
    emissions = _float((version.tags or {}).get(EMISSIONS_TAG))
    for _ in range(GATE_ROUNDS):
        champion = alias_version(client, name, CHAMPION)
        if champion is not None and str(champion.version) == str(version.version):
            decision = GateDecision(True, "already champion")  # an earlier attempt moved the alias, then stopped
            break
        rejected = champion is not None and (champion.tags or {}).get(APPROVAL_TAG) == REJECTED
        if rejected and rule is not None:  # judged unfit by a person: no bar to the next version the gate passes
            decision = decide(rule, ours, None, True, emissions)  # as a champion with no metric: beaten if ours is one
            if decision.wins:
                decision = GateDecision(True, f"the champion v{champion.version} was Rejected")
        else:
            theirs = _version_metric(client, champion, metric) if champion is not None else None
            decision = decide(rule, ours, theirs, champion is not None, emissions)
            if champion is not None and theirs is not None and (metric or "").startswith("val_"):
                decision = GateDecision(decision.wins, decision.reason + _other_validation(version, champion))
        if not decision.wins:
            client.set_registered_model_alias(name, CANDIDATE, version.version)
            break
        client.set_registered_model_alias(name, CHAMPION, version.version)
        now = alias_version(client, name, CHAMPION)
        if now is None or str(now.version) == str(version.version):
            break
    if decision.wins:  # an earlier attempt's gate may have made it candidate, then stopped before its tag
        _drop_candidate(client, name, version)
    client.set_model_version_tag(name, version.version, GATE_TAG, f"{_role(decision)}: {decision.reason}")
    return decision


def make_champion(client, name: str, version) -> None:
    """Point ``champion`` at ``version`` by hand (``trainyard models promote``); ``candidate`` leaves it."""
    client.set_registered_model_alias(name, CHAMPION, version.version)
    _drop_candidate(client, name, version)


def _drop_candidate(client, name: str, version) -> None:
    """``candidate`` off ``version``, where it points there (a champion is no candidate)."""
    candidate = alias_version(client, name, CANDIDATE)
    if candidate is not None and str(candidate.version) == str(version.version):
        client.delete_registered_model_alias(name, CANDIDATE)


def _role(decision: GateDecision) -> str:
    return CHAMPION if decision.wins else CANDIDATE


def _version_metric(client, version, metric: str | None) -> float | None:
    """A version's final ``metric``: its tag, else (versions registered before the tag) its run's; None
    when neither is there (a run deleted, as ``mlflow gc`` deletes them, has no metric to give)."""
    from mlflow.exceptions import MlflowException

    if metric is None:
        return None
    tagged = _float((version.tags or {}).get(f"{METRIC_TAG_PREFIX}{metric}"))
    if tagged is not None or not version.run_id:
        return tagged
    try:
        return client.get_run(version.run_id).data.metrics.get(metric)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def _other_validation(version, champion) -> str:
    """A note where the two versions were validated on different data (a refreshed validation channel): their
    metrics are compared as recorded, which a person reading the decision should know."""
    key = "data.validation.manifest_digest"
    ours, theirs = (version.tags or {}).get(key), (champion.tags or {}).get(key)
    if ours is None or theirs is None or ours == theirs:
        return ""
    return f"; note: the champion was validated on other data (manifest {theirs[:19]}, this version's {ours[:19]})"


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def alias_version(client, name: str, alias: str):
    """The version ``alias`` points at, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise
