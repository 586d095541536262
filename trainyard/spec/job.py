"""``TrainingJob``, the whole spec, with its checks across sections, and the settings it would ignore."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, Field, field_validator, model_validator

from trainyard import grid_data
from trainyard.redaction import SECRET_NAME
from trainyard.spec.base import _NAME_RE, _Model, constrained
from trainyard.spec.data import Channel, Inputs, Output
from trainyard.spec.sections import (
    Algorithm,
    Carbon,
    Elastic,
    Hyperparameters,
    PromoteIf,
    Registry,
    Resources,
    Retries,
    Stopping,
)
from trainyard.spec.sifting import DEFAULT_PRUNING, Sifting


class TrainingJob(_Model):
    """One training job: data in, a registered model out."""

    name: str = Field(
        description="Letters, digits and hyphens; 1-63 characters.",
        json_schema_extra=constrained("string", pattern=_NAME_RE.pattern, maxLength=63),
    )
    algorithm: Algorithm = Field(description="The model to train.")
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters, description="Training settings.")
    inputs: Inputs = Field(description="Input channels: train, and optionally validation.")
    output: Output = Field(description="Where the model and summary go.")
    resources: Resources = Field(default_factory=Resources, description="Replica groups and work pool.")
    sifting: Sifting = Field(default_factory=Sifting, description="Online smart sifting.")
    elastic: Elastic = Field(default_factory=Elastic, description="Elastic training and failure drills.")
    stopping: Stopping = Field(default_factory=Stopping, description="Stopping conditions.")
    carbon: Carbon = Field(default_factory=Carbon, description="Carbon accounting.")
    registry: Registry = Field(default_factory=Registry, description="Model registration.")
    retries: Retries = Field(default_factory=Retries, description="Retries of failed replica groups.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"{v!r}: use 1-63 letters, digits or hyphens, not starting or ending with a hyphen")
        return v

    @model_validator(mode="after")
    def _sifting_defaults(self) -> TrainingJob:
        """Sifting's unset defaults, which depend on the train channel and the task (left unset when it is
        off). Runs before ``_consistent`` (pydantic runs after-validators in the order defined), whose
        checks read the resolved values."""
        if self.sifting.enabled:
            resolved = self.sifting.resolved(self.inputs.train.mode == "stream", self.algorithm.task == "regression")
            object.__setattr__(self, "sifting", resolved)
        return self

    @model_validator(mode="after")
    def _consistent(self) -> TrainingJob:
        problems = []
        for name, channel in self.channels().items():
            if name not in ("train", "validation") and self.algorithm.builtin is not None:
                # Extra channels are side files for an entrypoint: a built-in reads none, so one is a typo
                # (inputs.validaton) or a leftover, and would be downloaded for nothing.
                close = difflib.get_close_matches(name, ["validation", "train"], n=1, cutoff=0.6)
                hint = f"did you mean inputs.{close[0]}? " if close else ""
                problems.append(
                    f"inputs.{name}: built-in algorithms read only inputs.train and inputs.validation; {hint}"
                    "remove it, or rename it"
                )
            if name not in ("train", "validation") and channel.mode == "stream":
                problems.append(f"inputs.{name}.mode: only a parquet train channel can stream; use file")
            if name not in ("train", "validation") and channel.distribution == "sharded":
                # Laid out whole in TRAINYARD_CHANNEL_<NAME> for every group; accepting "sharded" would
                # silently give each group everything.
                problems.append(
                    f"inputs.{name}.distribution: an extra channel's files are given whole to every group (side "
                    "files for an entrypoint); use replicated. Only the train channel is sharded"
                )
        if self.algorithm.builtin is not None:
            for key in sorted(self.hyperparameters.model_extra or {}):
                # Other keys are an entrypoint's own settings; a built-in reads none, so one is a typo
                # (learnin_rate) that would leave the default in force without a word.
                close = difflib.get_close_matches(key, list(Hyperparameters.model_fields), n=1, cutoff=0.6)
                hint = f"did you mean hyperparameters.{close[0]}? " if close else ""
                problems.append(
                    f"hyperparameters.{key}: not a setting of the built-in {self.algorithm.builtin} (other keys "
                    f"are passed to an entrypoint); {hint}remove it, or rename it"
                )
        for name, channel in self.table_channels().items():
            if self.algorithm.builtin is not None and channel.label is None:
                problems.append(f"inputs.{name}.label: required for builtin algorithms; name the label column")
            if channel.format == "raw":
                problems.append(f"inputs.{name}.format: raw files cannot be {name} data; use parquet, csv or jsonl")
            if channel.mode == "stream" and (name != "train" or channel.format != "parquet"):
                problems.append(f"inputs.{name}.mode: only a parquet train channel can stream; use file")
            if name == "validation" and channel.distribution == "sharded":
                problems.append(
                    "inputs.validation.distribution: every group validates on the whole channel; use replicated"
                )
            if channel.label is not None and channel.label in (channel.features or ()):
                problems.append(
                    f"inputs.{name}.features: lists the label {channel.label!r}, which the model would then be given "
                    "as an input; remove it from the features"
                )
        problems += self._validation_problems()
        problems += self._output_problems()
        target = self.stopping.target_metric
        if target is not None:
            problems += self._metric_problems("stopping.target_metric.name", target.name)
        gate = self.gate
        if gate is not None and gate.metric is not None:  # the gate fills the metric in: always set
            problems += self._metric_problems("registry.promote_if.metric", gate.metric)
            if gate.mode is not None and gate.mode != gate.direction:  # PromoteIf checks this only with a metric
                better = "bigger" if gate.direction == "max" else "smaller"
                problems.append(
                    f"registry.promote_if.mode: {gate.mode} would promote a worse model: the gate compares "
                    f"{gate.metric} (the task's default metric), which is better {better}; use {gate.direction}, "
                    "or leave mode out"
                )
        most_groups = self.resources.max_replicas or self.resources.replicas  # what Resources resolves it to
        if target is not None and target.name == "train_loss" and most_groups > 1:
            # Each group's train_loss is over its own share of the batches: the groups would reach the
            # target at different epochs and stop apart. Validation metrics are of the shared parameters.
            problems.append(
                "stopping.target_metric.name: train_loss is each replica group's own, so groups would stop at "
                "different epochs; use val_loss (with inputs.validation), or one replica group (max_replicas: 1)"
            )
        problems += _gpu_variables(self.resources)
        if self.stopping.patience_epochs is not None and self.inputs.validation is None:
            problems.append("stopping.patience_epochs: needs a validation channel; add inputs.validation")
        if self.stopping.restore_best and self.inputs.validation is None:
            problems.append(
                "stopping.restore_best: the best epoch is judged on validation metrics; add inputs.validation"
            )
        if self.sifting.by_reducible_loss:
            if self.inputs.train.mode == "stream":
                problems.append(
                    "sifting.score: reducible_loss needs the prefilter's reference losses, which a streamed channel "
                    "does not get: use loss, or inputs.train.mode: file"
                )
            if self.sifting.prefilter.enabled is False:
                problems.append(
                    "sifting.score: reducible_loss needs the prefilter's reference losses: "
                    "remove sifting.prefilter.enabled: false"
                )
        pre = self.sifting.prefilter
        if self.inputs.train.mode == "stream" and (
            pre.enabled or pre.drop_learnt_fraction or pre.drop_unlearnable_fraction
        ):
            # Left unset, the prefilter is simply not run on a streamed channel (sifting.enabled's default must
            # not turn a valid streamed job into an error); asked for, it would silently drop nothing.
            problems.append(
                "sifting.prefilter: a streamed channel is never read whole before training, so it cannot be "
                "prefiltered: remove sifting.prefilter, or inputs.train.mode: file"
            )
        if self.sifting.prunes and self.inputs.train.mode == "stream":
            problems.append(
                "sifting.prune: a streamed channel's rows are not all in memory to remember their losses: "
                "set learnt_fraction and hardest_fraction to 0, or inputs.train.mode: file"
            )
        if self.sifting.enabled and self.sifting.beta:
            beta, prune = self.sifting.settled()
            dealt = prune.dealt_batch(self.hyperparameters.batch_size)
            if round(dealt * (1 + beta)) <= dealt:  # sifting.candidate_batch: every candidate would be kept
                problems.append(
                    f"sifting.beta: {beta:g} draws round({dealt} * {1 + beta:g}) = {dealt} candidates a step for "
                    f"{dealt} kept, so none is passed over and every scoring pass is wasted; raise sifting.beta to "
                    f"at least {1 / dealt:.2g} or hyperparameters.batch_size, or set sifting.beta 0"
                )
        if self.sifting.enabled and self.sifting.reuse_loss_epochs and self.inputs.train.mode == "stream":
            problems.append(
                "sifting.reuse_loss_epochs: a streamed channel's rows are not all in memory to remember their losses: "
                "set it to 0, or inputs.train.mode: file"
            )
        drills: set[tuple[int, int]] = set()
        for i, fault in enumerate(self.elastic.fault_injection):
            if fault.replica >= self.resources.replicas:
                problems.append(
                    f"elastic.fault_injection.{i}.replica: {fault.replica} is not a replica group "
                    f"(there are {self.resources.replicas}: 0..{self.resources.replicas - 1})"
                )
            if (fault.replica, fault.at_step) in drills:  # the second could never fire
                problems.append(
                    f"elastic.fault_injection.{i}.at_step: group {fault.replica} already has a drill at step "
                    f"{fault.at_step}; give each of its drills its own step"
                )
            drills.add((fault.replica, fault.at_step))
        if problems:
            # A ValueError raised here carries no location, so the field names are in the text; one problem a
            # line (the messages themselves use "; " between a problem and its fix).
            raise ValueError("\n".join(problems))
        return self

    def _validation_problems(self) -> list[str]:
        """The validation channel is read with the train channel's label, features and classes: its own,
        where they differ, would be ignored without a word."""
        train, validation = self.inputs.train, self.inputs.validation
        if validation is None:
            return []
        problems = []
        if train.label is not None and validation.label not in (None, train.label):
            problems.append(
                f"inputs.validation.label: {validation.label!r}, but the train channel's is {train.label!r}; the "
                f"validation rows are scored on the train channel's label: make it {train.label!r}"
            )
        for field in ("features", "classes"):
            ours = getattr(validation, field)
            if ours is not None and ours != getattr(train, field):
                problems.append(
                    f"inputs.validation.{field}: the validation channel is read with the train channel's {field}; "
                    f"set them on inputs.train.{field}, and remove this one"
                )
        return problems

    def _output_problems(self) -> list[str]:
        """An output prefix inside an input prefix: the job's model and summary would be read as that
        channel's data by the next job (``model.pt``, ``summary.json`` are objects under its prefix)."""
        out = self.output.s3_uri.rstrip("/") + "/"
        return [
            f"output.s3_uri: {self.output.s3_uri} is inside inputs.{name}.s3_uri ({channel.s3_uri}), so later jobs "
            "would read this job's outputs as that channel's data; write the outputs under another prefix"
            for name, channel in self.channels().items()
            if channel.s3_data_type == "prefix" and channel.s3_uri.endswith("/") and out.startswith(channel.s3_uri)
        ]

    @property
    def gate(self) -> PromoteIf | None:
        """``registry.promote_if`` with its metric filled in for the task (val_accuracy or val_rmse)."""
        rule = self.registry.promote_if
        if rule is None or rule.metric is not None:
            return rule
        default = "val_rmse" if self.algorithm.task == "regression" else "val_accuracy"
        return rule.model_copy(update={"metric": default})

    def _metric_problems(self, field: str, metric: str) -> list[str]:
        """Why ``metric`` cannot be read in this job: a validation metric without validation data, or
        another task's metric."""
        problems = []
        if metric.startswith("val_") and self.inputs.validation is None:
            problems.append(f"{field}: {metric} needs a validation channel; add inputs.validation")
        if metric == "val_accuracy" and self.algorithm.task == "regression":
            problems.append(f"{field}: val_accuracy is for classifiers; use val_rmse")
        if metric == "val_rmse" and self.algorithm.task == "classification":
            problems.append(f"{field}: val_rmse is for regression; use val_accuracy")
        return problems

    def channels(self) -> dict[str, Channel]:
        """The configured channels by name (``train`` first)."""
        chans = {"train": self.inputs.train}
        if self.inputs.validation is not None:
            chans["validation"] = self.inputs.validation
        return chans | dict(self.inputs.__pydantic_extra__ or {})

    def table_channels(self) -> dict[str, Channel]:
        """The channels read as tables for training and validation."""
        return {k: v for k, v in self.channels().items() if k in ("train", "validation")}

    @property
    def model_name(self) -> str:
        """The registered model name."""
        return self.registry.model_name or self.name


def _gpu_variables(resources) -> list[str]:
    """``job_variables.gpus`` against ``gpus_per_replica``, which sets each group's ``gpus`` (pool_launcher)."""
    gpus = resources.job_variables.get("gpus")
    if gpus is None or gpus == resources.gpus_per_replica:
        return []
    if not resources.gpus_per_replica:
        return [
            f"resources.job_variables.gpus: {gpus} GPUs reserved for each group, which sees none with "
            f"gpus_per_replica 0 (a CPU job); set resources.gpus_per_replica: {gpus} instead"
        ]
    return [
        f"resources.job_variables.gpus: {gpus} disagrees with resources.gpus_per_replica {resources.gpus_per_replica}, "
        "which sets each group's gpus; leave gpus out of job_variables"
    ]


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
    elif sifting.beta == 0:
        keep_rule = {"score", "selection", "proxy", "delay_steps", "loss_history_length", "reuse_loss_epochs"}
        if not sifting.prunes:
            fix = (
                "a streamed channel cannot prune: set sifting.beta above 0"
                if job.inputs.train.mode == "stream"
                else "set sifting.beta above 0, or sifting.prune.learnt_fraction or hardest_fraction above 0"
            )
            ignored.append(f"sifting.enabled: with beta 0 and no pruning, no row is filtered; {fix}")
            keep_rule.add("min_class_fraction")  # (pruning's hardest rule keeps it too)
        tuned = [name for name in _tuned(sifting, set()) if name in keep_rule]
        if tuned:
            ignored.append(
                f"sifting.{', sifting.'.join(tuned)}: settings of the keep rule, which is off with sifting.beta 0 "
                "(its default on a file-mode train channel: pruning alone); set sifting.beta above 0 to use them"
            )
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
        tuned = _tuned(sifting.prefilter, {"enabled"})
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


def _tuned(model: BaseModel, leave_out: set[str]) -> list[str]:
    """The fields of ``model`` that differ from their defaults. Not ``model_fields_set``: a spec that went
    through ``model_dump`` (a job submitted to a deployment) has every field set."""
    return sorted(
        name
        for name, info in type(model).model_fields.items()
        if name not in leave_out and getattr(model, name) != info.get_default(call_default_factory=True)
    )
