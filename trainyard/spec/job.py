"""``TrainingJob``, the whole spec, with its checks across sections (the settings it would ignore: ``ignored``)."""

from __future__ import annotations

import difflib

from pydantic import Field, field_validator, model_validator

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
)
from trainyard.spec.sifting import Sifting
from trainyard.spec.stopping import Stopping


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
        if not _NAME_RE.fullmatch(v):
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
            if self.algorithm.builtin == "linear-regression" and gate.metric in ("val_loss", "train_loss"):
                # Its loss is the squared error over each job's own label spread (algorithms._scaled_mse):
                # a version trained on wider labels read better at a worse error.
                problems.append(
                    f"registry.promote_if.metric: {gate.metric} of the built-in linear-regression is in units of "
                    "each job's own label spread, not comparable between versions; use val_rmse"
                )
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
        # (judged on the watched metric: train_loss, where it is the target's, needs no validation channel)
        lacks_validation = self.inputs.validation is None and self.stopping.watched_metric.startswith("val_")
        if self.stopping.patience_epochs is not None and lacks_validation:
            problems.append("stopping.patience_epochs: needs a validation channel; add inputs.validation")
        if self.stopping.restore_best and lacks_validation:
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
        channel's data by the next job (``model.pt``, ``summary.json`` are objects under its prefix). An input
        without its closing slash counts as the prefix it is listed as when no object has that key (``s3://b/data``
        lists ``data/``; ``s3://b`` the bucket); were it one object, outputs under it would make it a prefix too."""
        out = self.output.s3_uri.rstrip("/") + "/"
        return [
            f"output.s3_uri: {self.output.s3_uri} is inside inputs.{name}.s3_uri ({channel.s3_uri}), so later jobs "
            "would read this job's outputs as that channel's data; write the outputs under another prefix"
            for name, channel in self.channels().items()
            if channel.s3_data_type == "prefix" and out.startswith(channel.s3_uri.rstrip("/") + "/")
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
