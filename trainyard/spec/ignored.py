"""The settings a job gives that would not do what they seem to (``ignored_settings``): warnings, not
refusals (``trainyard validate`` and every run print them)."""

from __future__ import annotations

import difflib

from pydantic import BaseModel

from trainyard import grid_data
from trainyard.redaction import SECRET_NAME
from trainyard.spec.job import TrainingJob
from trainyard.spec.pruning import DEFAULT_PRUNING
from trainyard.spec.sections import Hyperparameters
from trainyard.spec.sifting import DEFAULT_NOISY_SHARE


def ignored_settings(job: TrainingJob) -> list[str]:
    """Settings the job gives that will not do what they seem to (ignored, read as something else, or a
    secret recorded in the clear), each worded for a warning.

    Settings under a switched-off stage are warned about, not refused: turning a stage off with
    ``enabled: false`` while keeping its tuning in the file is how such a stage is paused.
    """
    ignored = []
    for name in job.channels():
        close = difflib.get_close_matches(name, ["validation"], n=1, cutoff=0.75)
        if name not in ("train", "validation") and close:
            ignored.append(
                f"inputs.{name}: as spelt, an extra channel for the entrypoint, not the validation set; "
                f"rename it inputs.{close[0]} if that is what it is"
            )
    ignored += _ignored_hyperparameters(job)
    if job.resources.work_pool == "local" and job.resources.job_variables:
        ignored.append(
            f"resources.job_variables ({', '.join(sorted(job.resources.job_variables))}): a work pool's, for the "
            "groups' flow runs; a local job's groups run beside the pipeline, in its environment"
        )
    for key, value in sorted((job.hyperparameters.model_extra or {}).items()):
        if SECRET_NAME.search(key) and isinstance(value, str):  # (max_tokens: 512 is a count)
            ignored.append(
                f"hyperparameters.{key}: named as a secret, but hyperparameters are recorded as given (MLflow "
                "params, the job's lineage, Prefect's run parameters); give the entrypoint a secret through the "
                "work pool's env, from a secret store"
            )
    if job.resources.gpus_per_replica > 1:
        ignored.append(
            f"resources.gpus_per_replica: {job.resources.gpus_per_replica}: a group trains on one GPU (more a group "
            "is not built yet), so the others it reserves stay idle; give 1 and raise resources.replicas instead"
        )
    if job.algorithm.task == "regression" and job.inputs.train.classes:
        ignored.append("inputs.train.classes: a classifier's; a regression's labels are numbers, read as they are")
    if job.stopping.validate_every_epochs > 1 and job.inputs.validation is None:
        ignored.append("stopping.validate_every_epochs: the job has no validation channel; add inputs.validation")
    if job.carbon.region is not None and grid_data.regions(job.carbon.country_iso_code) is None:
        ignored.append(
            f"carbon.region: codecarbon has regional figures for USA, CAN, CHN, SWE, NOR and FIN only; "
            f"{job.carbon.country_iso_code}'s national figure is used"
        )
    sifting = job.sifting
    if not sifting.enabled:
        tuned = _tuned(sifting, {"enabled", "prefilter"})
        if tuned:
            ignored.append(
                f"sifting.{', sifting.'.join(tuned)}: online sifting is off; set sifting.enabled: true to use them"
            )
    # (adaptive: the keep rule's settings serve a clean channel's pick)
    elif sifting.beta == 0 and not sifting.adaptive:
        keep_rule = {"score", "selection", "proxy", "delay_steps", "loss_history_length", "reuse_loss_epochs"}
        if not sifting.prunes:
            fix = (
                "a streamed channel cannot prune: set sifting.beta above 0"
                if job.inputs.train.mode == "stream"
                else "set sifting.beta above 0, or sifting.prune.learnt_fraction or hardest_fraction above 0"
            )
            ignored.append(f"sifting.enabled: with beta 0 and no pruning, no row is filtered; {fix}")
            keep_rule.add("min_class_fraction")  # (pruning's hardest rule keeps it too)
        # (a resolved delay_steps holds its default, which depends on score and selection)
        tuned = [name for name in _tuned(sifting, set(), {"delay_steps": sifting.default_delay()}) if name in keep_rule]
        if tuned:
            ignored.append(
                f"sifting.{', sifting.'.join(tuned)}: settings of the keep rule, which is off with sifting.beta 0 "
                "(its default on a file-mode train channel: pruning alone); set sifting.beta above 0 to use them"
            )
    # (its default, 0.1, applies where it can: a job that gives the rule, or a regression or streamed one, is not
    # warned about a value it never set)
    if sifting.enabled and not sifting.adaptive and sifting.noisy_share not in (None, DEFAULT_NOISY_SHARE):
        why = (
            "a regression job's labels have no chance level to tell noise by"
            if job.algorithm.task == "regression"
            else "a streamed train channel is not read whole before training"
            if job.inputs.train.mode == "stream"
            else "the rule is given (beta, score, selection, prune or reuse_loss_epochs)"
        )
        ignored.append(f"sifting.noisy_share: nothing is measured, as {why}; the rule is sifting's default or yours")
    ignored += sifting.ignored_proxy_settings(job.algorithm.builtin, job.algorithm.task == "regression")
    if sifting.enabled and sifting.beta and sifting.prune is not None and "prune" in sifting.model_fields_set:
        # the keep rule and a prune given in part: what it leaves out is the default pruning's (0, 0 and 1 before
        # 2026-12-06), with the keep rule a combination the benchmark measured below the keep rule alone (stop 27)
        left = [name for name in DEFAULT_PRUNING if name not in sifting.prune.model_fields_set]
        if left:
            values = ", ".join(f"{name} {getattr(sifting.prune, name):g}" for name in left)
            ignored.append(
                f"sifting.prune: left out, {values} are the default pruning's, beside the keep rule (beta "
                f"{sifting.beta:g}); give them (0 turns that part off) if that is not what you meant"
            )
    if not sifting.prefilter_on:
        # (noisy_share's measure trains reference models by the prefilter's reference settings and seed)
        measuring = {"reference_epochs", "reference_hidden_sizes", "reference_learning_rate", "seed"}
        tuned = _tuned(sifting.prefilter, {"enabled"} | (measuring if sifting.adaptive else set()))
        if tuned:
            switch = (
                "sifting.prefilter.enabled"
                if sifting.prefilter.enabled is False or sifting.enabled
                else "sifting.enabled"
            )
            ignored.append(
                f"sifting.prefilter.{', sifting.prefilter.'.join(tuned)}: the prefilter is off; "
                f"set {switch}: true to use them"
            )
    return ignored


def _ignored_hyperparameters(job: TrainingJob) -> list[str]:
    """Hyperparameters the job sets that nothing reads as set (``ignored_settings``)."""
    hp, ignored = job.hyperparameters, []
    for key in sorted(hp.model_extra or {}):  # an entrypoint's (a built-in's are refused)
        close = difflib.get_close_matches(key, list(Hyperparameters.model_fields), n=1, cutoff=0.8)
        if close:
            ignored.append(
                f"hyperparameters.{key}: passed to the entrypoint as spelt, while Trainyard reads "
                f"hyperparameters.{close[0]} (now {getattr(hp, close[0])!r}); rename it if that is what it is"
            )
    tuned = set(_tuned(hp, set()))
    # An entrypoint gets every hyperparameter and may read momentum for its own layers; a built-in does not
    if "momentum" in tuned and hp.optimizer != "sgd" and job.algorithm.builtin is not None:
        ignored.append("hyperparameters.momentum: read by sgd only, not adam; set optimizer: sgd to use it")
    if "min_lr_fraction" in tuned and hp.lr_schedule == "constant":
        ignored.append(
            "hyperparameters.min_lr_fraction: the learning rate is constant; set lr_schedule: cosine or linear "
            "to decay to it"
        )
    if "hidden_sizes" in tuned and job.algorithm.builtin == "linear-regression":
        ignored.append("hyperparameters.hidden_sizes: linear-regression has no hidden layers; remove it")
    return ignored


def _tuned(model: BaseModel, leave_out: set[str], resolved: dict | None = None) -> list[str]:
    """The fields of ``model`` that differ from their defaults (``resolved``: what a field left unset was resolved
    to, where that is not its declared default). Not ``model_fields_set``: a spec that went through ``model_dump``
    (a job submitted to a deployment) has every field set."""
    resolved = resolved or {}
    return sorted(
        name
        for name, info in type(model).model_fields.items()
        if name not in leave_out
        and getattr(model, name) not in (info.get_default(call_default_factory=True), resolved.get(name, object()))
    )
