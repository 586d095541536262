"""The job spec: a pydantic ``TrainingJob`` mirroring SageMaker's CreateTrainingJob.

It is the one parameter of the ``training-pipeline`` flow, so the Prefect UI renders it as a
form; every field carries a description. A bad spec is rejected here, before anything starts,
with one line per problem naming the field and the fix (``load_job`` raises ``SpecError``).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainyard.errors import SpecError

BUILTIN_ALGORITHMS = ("mlp-classifier", "linear-regression")
# Metric name -> whether bigger is better. Stopping and promotion use this table.
METRICS: dict[str, bool] = {"val_accuracy": True, "val_loss": False, "val_rmse": False, "train_loss": False}
_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Model(BaseModel):
    # allow_inf_nan: a beta or learning rate of .inf or .nan passes gt=0 checks, and fails only in training
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class Algorithm(_Model):
    """Which model to train: a built-in, or your own factory."""

    builtin: Literal["mlp-classifier", "linear-regression"] | None = Field(
        default=None, description="A built-in algorithm: mlp-classifier or linear-regression."
    )
    entrypoint: str | None = Field(
        default=None,
        description='"pkg.module:build": build(num_features, num_outputs, hyperparameters) returns '
        "(model, loss_fn) where loss_fn(outputs, labels) gives one loss per sample.",
    )
    task: Literal["classification", "regression"] = Field(
        default="classification",
        description="For an entrypoint: whether labels are classes or numbers (built-ins imply it).",
    )

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str | None) -> str | None:
        if v is not None and not _ENTRYPOINT_RE.match(v):
            raise ValueError(f"{v!r} is not of the form 'package.module:function'")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> Algorithm:
        if (self.builtin is None) == (self.entrypoint is None):
            raise ValueError("set exactly one of 'builtin' (mlp-classifier, linear-regression) or 'entrypoint'")
        if self.builtin == "linear-regression":
            object.__setattr__(self, "task", "regression")
        elif self.builtin == "mlp-classifier":
            object.__setattr__(self, "task", "classification")
        return self


class Hyperparameters(BaseModel):
    """Training settings. Unknown keys are kept and passed to an entrypoint algorithm."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)

    epochs: int = Field(default=10, ge=1, le=100_000, description="Passes over the training channel.")
    batch_size: int = Field(default=256, ge=1, description="Samples per optimizer step, over all replica groups.")
    learning_rate: float = Field(default=1e-3, gt=0, le=10, description="Optimizer step size.")
    optimizer: Literal["adam", "sgd"] = Field(default="adam", description="adam or sgd (with momentum).")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="Momentum, for sgd only.")
    weight_decay: float = Field(default=0.0, ge=0, description="L2 penalty (decoupled for adam: AdamW).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        default="constant", description="Learning-rate decay over the epochs: constant, cosine or linear."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Steps of linear learning-rate warm-up from zero.")
    min_lr_fraction: float = Field(
        default=0.0, ge=0, le=1, description="Where cosine or linear decay ends, as a fraction of learning_rate."
    )
    hidden_sizes: list[int] = Field(default=[128, 128], description="Hidden layer widths of mlp-classifier.")
    seed: int = Field(default=0, ge=0, description="Seed for initialisation and shuffling.")

    @field_validator("hidden_sizes")
    @classmethod
    def _positive_widths(cls, v: list[int]) -> list[int]:
        return _check_widths(v)


class Channel(_Model):
    """One input channel: where its objects are and how to read them."""

    s3_uri: str = Field(
        description='"s3://bucket/prefix/" (every object under it), "s3://bucket/key", '
        "or a manifest (see s3_data_type)."
    )
    s3_data_type: Literal["prefix", "manifest"] = Field(
        default="prefix",
        description="prefix: s3_uri names the objects; manifest: s3_uri is a JSON or JSONL list of s3:// URIs "
        '(or SageMaker\'s [{"prefix": "s3://b/p/"}, "key", ...]).',
    )
    format: Literal["parquet", "csv", "jsonl", "raw"] = Field(
        default="parquet", description="parquet, csv or jsonl; raw: files handed to an entrypoint unread."
    )
    label: str | None = Field(default=None, description="The label column (required for built-in algorithms).")
    features: list[str] | None = Field(
        default=None, description="Feature columns; default: every numeric column but the label."
    )
    classes: list[int | str | bool] | None = Field(
        default=None,
        description="A classifier's label values, in output order (default: every value the label takes in the "
        "train channel; in stream mode, giving them saves reading the label column before training).",
    )
    mode: Literal["file", "stream"] = Field(
        default="file",
        description="file: download and verify before training; stream (train, parquet): replica groups read "
        "row groups straight from S3 as they train.",
    )
    distribution: Literal["replicated", "sharded"] = Field(
        default="replicated",
        description="replicated: every group draws from the whole channel; sharded: each group trains on a "
        "disjoint share of its objects (or parquet row groups), reassigned when the number of groups changes.",
    )

    @field_validator("s3_uri")
    @classmethod
    def _s3_uri(cls, v: str) -> str:
        return _check_s3_uri(v)

    @field_validator("features")
    @classmethod
    def _some_features(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError(
                "an empty list names no feature; list the feature columns, or leave it out for every numeric one"
            )
        if v is not None and len(set(v)) < len(v):
            raise ValueError(f"{sorted({c for c in v if v.count(c) > 1})} listed more than once; list each column once")
        return v

    @field_validator("classes")
    @classmethod
    def _distinct_classes(cls, v: list | None) -> list | None:
        if v is not None and len(v) < 2:
            raise ValueError(
                "a classifier needs two or more classes; list them all, or leave it out to take the train channel's"
            )
        if v is not None and len({(type(c), c) for c in v}) < len(v):
            raise ValueError("a class is listed more than once; list each label value once, in output order")
        return v

    @model_validator(mode="after")
    def _manifest_is_an_object(self) -> Channel:
        if self.s3_data_type == "manifest" and (self.s3_uri.endswith("/") or "/" not in self.s3_uri[5:]):
            raise ValueError(
                "s3_data_type manifest reads one object, and s3_uri names a bucket or prefix; set s3_uri to the "
                f"manifest's key, e.g. {self.s3_uri.rstrip('/')}/manifest.json"
            )
        return self


class Inputs(BaseModel):
    """The input channels: ``train``, optional ``validation``, and any others an entrypoint reads.

    A channel other than these two is staged and handed to the replica groups as a local folder named
    by ``TRAINYARD_CHANNEL_<NAME>`` (SageMaker's ``SM_CHANNEL_<NAME>``).
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)
    __pydantic_extra__: dict[str, Channel]

    train: Channel = Field(description="The training channel.")
    validation: Channel | None = Field(default=None, description="Scored after every epoch; needed for val_* metrics.")

    @model_validator(mode="after")
    def _channel_names(self) -> Inputs:
        for name in self.__pydantic_extra__ or {}:
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", name):
                raise ValueError(f"channel name {name!r}: use lowercase letters, digits and underscores (up to 32)")
        return self


class Output(_Model):
    """Where the model and the job summary are written."""

    s3_uri: str = Field(description='"s3://bucket/prefix/"; the job writes under <prefix>/<job id>/.')

    @field_validator("s3_uri")
    @classmethod
    def _s3_uri(cls, v: str) -> str:
        v = _check_s3_uri(v)
        # S3 keeps "a/../b" as a key of its own, some endpoints refuse it (rclone), and a user reading the
        # outputs would look under b/: refused here, before the job trains, not at the upload after it.
        segments = v[len("s3://") :].rstrip("/").split("/")[1:]
        if any(part in ("", ".", "..") for part in segments):
            raise ValueError(f"{v!r} has an empty, '.' or '..' segment; write the prefix as the outputs should lie")
        return v


class Resources(_Model):
    """Replica groups and where they run."""

    replicas: int = Field(default=1, ge=1, le=64, description="Replica groups to start with.")
    min_replicas: int = Field(default=1, ge=1, description="Fewest live groups the job trains with.")
    max_replicas: int | None = Field(
        default=None,
        description="Most groups the job may grow to (`trainyard scale`; on a work pool, as the pool has room);"
        " default: replicas.",
    )
    work_pool: str = Field(
        default="local",
        description="Where the groups run: 'local' (processes beside the pipeline) or the name of a Prefect work "
        "pool, whose 'train-replica' deployment of the same name runs each group as a flow run.",
    )
    gpus_per_replica: int = Field(default=0, ge=0, description="GPUs each group asks for (0 on CPU machines).")
    job_variables: dict[str, Any] = Field(
        default_factory=dict,
        description="Work-pool job variables for each group's flow run: image, cpu, memory, node_selector, "
        "tolerations, shm_size, env (see infra/).",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Resources:
        if self.max_replicas is None:
            object.__setattr__(self, "max_replicas", self.replicas)
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(
                f"need min_replicas <= replicas <= max_replicas, got {self.min_replicas} <= "
                f"{self.replicas} <= {self.max_replicas}; raise max_replicas or lower min_replicas"
            )
        return self


class Prefilter(_Model):
    """The offline prefilter: before training, drop duplicates and rows a reference model finds
    already learnt or unlearnable (RHO-LOSS style)."""

    enabled: bool | None = Field(
        default=None,
        description="Prefilter the training set before training. Default: when sifting is enabled and uses "
        "it: the keep rule (beta above 0: exact duplicates out), a loss-based drop, or score reducible_loss.",
    )
    # Defaults from benchmarks/sifting.py: every loss-based drop tried cost accuracy at equal compute
    # (the reference model is weak); removing exact duplicates never did.
    drop_learnt_fraction: float = Field(
        default=0.0, ge=0, lt=1, description="Share of rows with the lowest held-out loss to drop (already learnt)."
    )
    drop_unlearnable_fraction: float = Field(
        default=0.0, ge=0, lt=1, description="Share of rows with the highest held-out loss to drop (likely noise)."
    )
    reference: Literal["holdout", "champion"] = Field(
        default="holdout",
        description="Where the losses come from: 'holdout' trains two small reference models, each scoring the "
        "half it did not see; 'champion' scores every row with the registry's current champion of this model "
        "name (no training; it may have seen these rows). Without a usable champion, holdout is used and the "
        "report says why.",
    )
    min_class_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Class balance guard of the loss-based drops: each class keeps at least this fraction of its "
        "share of the kept rows (rounded up); 0 turns it off.",
    )
    reference_epochs: int = Field(default=3, ge=1, description="Epochs the reference models train for.")
    reference_hidden_sizes: list[int] = Field(default=[64], description="Hidden layers of the reference model.")

    reference_learning_rate: float = Field(default=3e-3, gt=0, description="The reference models' learning rate.")
    seed: int = Field(default=0, description="Seed of the cross-fitting split and the reference models.")

    @field_validator("reference_hidden_sizes")
    @classmethod
    def _positive_widths(cls, v: list[int]) -> list[int]:
        return _check_widths(v)

    @model_validator(mode="after")
    def _leaves_rows(self) -> Prefilter:
        if self.drop_learnt_fraction + self.drop_unlearnable_fraction >= 1:
            raise ValueError(
                f"drop_learnt_fraction {self.drop_learnt_fraction} + drop_unlearnable_fraction "
                f"{self.drop_unlearnable_fraction} would drop every row; keep their sum under 1 (e.g. 0.2 and 0.05)"
            )
        return self


class Pruning(_Model):
    """Epoch-level pruning by each row's last known loss, in every replica group's training loop.

    InfoBatch's rule (Qin et al., ICLR 2024): a row whose last loss is below the mean of the known
    losses is left out of its step with probability ``learnt_fraction``, and the ones kept count
    ``1 / (1 - learnt_fraction)``, so a step's gradient stays an unbiased estimate of its whole batch's;
    from ``until`` of the epochs on, every such row trains again. With label noise, the rows whose
    loss stays highest once the network has fitted the clean labels (networks fit clean labels
    before noisy ones) are mostly mislabelled: ``hardest_fraction`` of them are left out from
    ``hardest_after`` of the epochs on, those above ``hardest_min_loss`` only (a classifier's: less likely
    than chance). The losses are the training forward pass's own (and any scoring pass's): pruning
    costs no extra FLOPs. ``batch_factor`` cuts the pruning epochs' steps as well as their rows.
    """

    learnt_fraction: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Probability that a row whose last loss is below the mean is left out of its step; the kept "
        "ones count 1 / (1 - this). 0 turns it off.",
    )
    hardest_fraction: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="Share of the rows with the highest last losses left out (likely mislabelled), from "
        "hardest_after on. 0 turns it off.",
    )
    hardest_min_loss: float | Literal["chance"] = Field(
        default="chance",
        description="A row is left out as among the hardest only if its last loss is also above this. 'chance': "
        "ln(number of classes) for a classification job, the cross-entropy of a uniform guess, so only rows whose "
        "label the model finds less likely than chance go (wrong labels, not a clean set's hard rows); no floor for "
        "regression. Give a number (0: none) for a classifier whose loss is not cross-entropy.",
    )
    hardest_after: float = Field(
        default=0.25,
        ge=0,
        le=1,
        description="Fraction of the epochs before the hardest rows are left out: earlier, they are mostly "
        "clean rows not learnt yet.",
    )
    until: float = Field(
        default=0.875,
        ge=0,
        le=1,
        description="Fraction of the epochs after which every row below the mean trains again (InfoBatch's "
        "annealing); the hardest rows stay out.",
    )

    batch_factor: float = Field(
        default=1.0,
        ge=1,
        le=8,
        description="Rows dealt a step in the epochs that prune learnt rows (the second epoch on, until `until`), as "
        "a multiple of batch_size (with beta > 0, of the keep rule's kept batch): about batch_size rows still train a "
        "step once pruning has left some out, and such an epoch has 1 / batch_factor of the steps, as InfoBatch's "
        "pruned epochs do (a step's fixed costs are paid less often). A step's loss is then divided by batch_size, "
        "not by the rows dealt, so an epoch's gradient adds up to a whole epoch's. 1: the steps of an unpruned job, "
        "each on fewer rows.",
    )

    @property
    def active(self) -> bool:
        """Whether any row can be left out."""
        return self.learnt_fraction > 0 or self.hardest_fraction > 0

    def prunes_learnt(self, epoch: int, epochs: int) -> bool:
        """Whether learnt rows are left out in ``epoch`` (0-based) of a job of ``epochs`` epochs."""
        return self.learnt_fraction > 0 and epoch / max(epochs, 1) < self.until

    def dealt_batch(self, batch_size: int, epoch: int | None = None, epochs: int = 1) -> int:
        """The rows dealt a step (kept by the keep rule, with beta > 0) for ``batch_size`` in ``epoch`` of
        ``epochs``; without ``epoch``, the most any epoch deals. The first epoch has no known losses to prune
        by, and the epochs that prune no learnt rows (from ``until`` on, or all with ``learnt_fraction`` 0)
        are dealt ``batch_size``."""
        if not self.learnt_fraction or (epoch is not None and (epoch == 0 or not self.prunes_learnt(epoch, epochs))):
            return batch_size
        return max(batch_size, round(batch_size * self.batch_factor))


# sifting.prune left unset with no keep rule, on a file-mode channel: benchmarks/sifting.py's pick (stops 28-33, 35)
DEFAULT_PRUNING = {"learnt_fraction": 0.7, "hardest_fraction": 0.1, "batch_factor": 3.0}


class Sifting(_Model):
    """Online sifting in every replica group's training loop (smart sifting's keep rule)."""

    enabled: bool = Field(default=False, description="Drop uninformative samples during training.")
    # smart sifting's own names (beta_value, sift_delay) are accepted too, for specs carried over from SageMaker
    # Left unset, beta and prune are the combination benchmarks/sifting.py found best (pruning alone, batch_factor 3:
    # stops 28 to 33 by the most targets met on four tuning seeds; stop 35 with the finalists on their own schedules
    # over eight; stop 34's one-round search had picked the keep rule with the hardest rows left out, which then met
    # 3 of 10 lines on the reported seeds: benchmarks/README);
    # resolved by the job, which knows whether its train channel streams (pruning needs every row's loss in memory).
    # README: Sifting.
    beta: float | None = Field(
        default=None,
        ge=0,
        validation_alias=AliasChoices("beta", "beta_value"),
        description="Keep probability = loss percentile ** beta (smart sifting's beta_value). 0 turns the keep rule "
        "off (nothing is scored; every row dealt trains), e.g. to use only sifting.prune. Default: 0 for a file-mode "
        "train channel (pruning alone, with sifting.prune's default: the best combination benchmarks/sifting.py "
        "found), 1 for a streamed one.",
    )
    loss_history_length: int = Field(default=500, ge=1, description="Losses kept to rank new ones against.")
    delay_steps: int = Field(
        default=10,
        ge=0,
        validation_alias=AliasChoices("delay_steps", "sift_delay"),
        description="Steps before sifting starts (smart sifting's sift_delay, whose default is 1000: longer than "
        "many small jobs). Nothing is scored meanwhile: each step still draws batch_size * (1 + beta) candidates and "
        "trains on the first batch_size of them, so the data is seen at the same pace as when sifting.",
    )
    score: Literal["loss", "reducible_loss"] = Field(
        default="loss",
        description="What ranks a candidate: 'loss' (smart sifting's rule) or 'reducible_loss' (RHO-LOSS: its loss "
        "minus the prefilter's reference loss for it, so noisy samples are skipped as well as learnt ones; needs a "
        "file-mode train channel).",
    )
    # Default from benchmarks/sifting.py: with the duplicates prefilter and beta 1, reusing losses one
    # epoch old was the best combination found (fewest FLOPs to the baseline's accuracy, two tuning seeds)
    # at stops 16-24; it stays the keep rule's default (beta set above 0, or a streamed channel).
    reuse_loss_epochs: int | None = Field(
        default=None,
        ge=0,
        description="Rank a candidate by its last known loss (from when it was last scored or trained on) if that is "
        "at most this many epochs old, instead of scoring it again: fewer scoring passes (Selective-Backprop's stale "
        "variant). 0 scores every candidate, as smart sifting does. Default: 1 for a file-mode train channel, 0 for "
        "a streamed one (its rows are not all in memory to remember their losses).",
    )
    prefilter: Prefilter = Field(default_factory=Prefilter, description="The offline prefilter, before training.")
    prune: Pruning | None = Field(
        default=None,
        description="Epoch-level pruning by each row's last loss (InfoBatch), and leaving out the hardest rows. "
        "Default: with beta 0 or unset on a file-mode train channel, learnt_fraction 0.7, hardest_fraction 0.1 "
        "(0 for regression), batch_factor 3 (the best combination benchmarks/sifting.py found); otherwise off.",
    )
    min_class_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Class balance guard of online sifting: each class keeps at least this fraction of its share "
        "of a batch (rounded up); the prefilter has its own (prefilter.min_class_fraction).",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_name_each(cls, data: Any) -> Any:
        for ours, theirs in (("beta", "beta_value"), ("delay_steps", "sift_delay")):
            if isinstance(data, dict) and ours in data and theirs in data:
                raise ValueError(f"{ours} and {theirs} are one setting (smart sifting's name for it); give one")
        return data

    def resolved(self, streamed: bool, regression: bool = False) -> Sifting:
        """This config with ``beta`` and ``prune`` as they apply to a train channel that is streamed or not:
        left unset, the best combination ``benchmarks/sifting.py`` found (``DEFAULT_PRUNING`` alone, no keep
        rule) on a file-mode channel, and smart sifting's keep rule (beta 1) on a streamed one, which cannot
        prune. ``prune`` left unset with the keep rule asked for (beta above 0) is off: the keep rule followed
        by that pruning missed the benchmark's targets (stop 27). A regression job's default leaves no rows
        out as the hardest: it has no chance-level loss to tell a wrong label from a hard row by (and the
        benchmark measured classifiers), so its pruning is InfoBatch's unbiased rule alone."""
        beta = self.beta if self.beta is not None else (1.0 if streamed else 0.0)
        prune = self.prune
        if prune is None:
            default = DEFAULT_PRUNING | ({"hardest_fraction": 0.0} if regression else {})
            prune = Pruning(**default) if beta == 0 and not streamed else Pruning()
        return self.model_copy(update={"beta": beta, "prune": prune})

    @property
    def prunes(self) -> bool:
        """Whether ``prune`` leaves rows out (a job resolves it when sifting is on; unset, it is off)."""
        return self.enabled and self.prune is not None and self.prune.active

    @property
    def prefilter_on(self) -> bool:
        """Whether the filtering stage prefilters: ``prefilter.enabled``; left unset, when sifting is on and
        something needs it: the keep rule (whose default removes exact duplicates first, the stop 16-24
        pick), loss-based drops, or reducible-loss scoring (its reference losses)."""
        if self.prefilter.enabled is not None:
            return self.prefilter.enabled
        pre = self.prefilter
        wanted = (self.beta or 0) > 0 or pre.drop_learnt_fraction or pre.drop_unlearnable_fraction
        return self.enabled and bool(wanted or self.score == "reducible_loss")

    def loss_reuse_epochs(self, streamed: bool) -> int:
        """``reuse_loss_epochs`` as it applies to a train channel that is streamed or not."""
        if self.reuse_loss_epochs is None:
            return 0 if streamed else 1
        return self.reuse_loss_epochs

    @property
    def by_reducible_loss(self) -> bool:
        """Whether the groups rank by reducible loss (RHO-LOSS): they need the prefilter's reference losses."""
        return self.enabled and self.score == "reducible_loss"


class FaultInjection(_Model):
    """A failure drill: what to do to which replica group at which step.

    A group may have several: each fires once, at the first step the group is at or past its own (the
    restart after one drill plays the next).
    """

    replica: int = Field(ge=0, description="Replica group index.")
    at_step: int = Field(ge=1, description="Step at which the fault fires.")
    kind: Literal["kill", "hang", "term"] = Field(default="kill", description="kill, hang or term.")


class Elastic(_Model):
    """Elastic training settings."""

    fault_injection: list[FaultInjection] = Field(default_factory=list, description="Failure drills.")
    checkpoint_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Write the training state to output.s3_uri every N committed steps: the fallback used only "
        "when every replica group is lost (groups otherwise heal from a live peer). Off by default.",
    )


class TargetMetric(_Model):
    """Stop as soon as a metric reaches a value."""

    name: str = Field(description="val_accuracy, val_loss, val_rmse or train_loss.")
    value: float = Field(description="The value to reach (>= for accuracy, <= for losses).")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return _known_metric(v)


class Stopping(_Model):
    """When training stops before its last epoch."""

    max_runtime_seconds: int = Field(default=86_400, ge=1, description="Wall-clock limit of the training stage.")
    target_metric: TargetMetric | None = Field(default=None, description="Stop once this metric reaches its value.")
    patience_epochs: int | None = Field(
        default=None, ge=1, description="Stop after this many epochs without improvement of the watched metric."
    )


class Carbon(_Model):
    """Carbon accounting settings (codecarbon's offline tracker)."""

    country_iso_code: str = Field(default="USA", description="ISO 3166-1 alpha-3 code of the grid, e.g. IRL.")
    region: str | None = Field(default=None, description="Grid region within the country, where codecarbon knows it.")
    pue: float = Field(default=1.0, ge=1.0, le=3.0, description="Data-centre power usage effectiveness.")
    budget_kg: float | None = Field(
        default=None, gt=0, description="Emissions budget of the job, kgCO2e: training stops (Stopped) past it."
    )
    measure_power_secs: float = Field(default=1.0, ge=0.1, le=60, description="Seconds between power readings.")
    supplier_g_per_kwh: float | None = Field(
        default=None, ge=0, description="Market-based Scope 2: the electricity supplier's emission factor, gCO2e/kWh."
    )
    renewable_share: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Market-based Scope 2: share of the energy covered by renewable contracts (used without a "
        "supplier factor).",
    )

    @field_validator("country_iso_code")
    @classmethod
    def _iso3(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z]{3}", v):
            raise ValueError(f"{v!r} is not a 3-letter ISO 3166-1 alpha-3 code such as IRL or USA")
        return v.upper()


class PromoteIf(_Model):
    """The promotion gate: when a new version becomes the champion."""

    metric: str | None = Field(
        default=None,
        description="Metric compared against the champion's: val_accuracy, val_loss, val_rmse or train_loss "
        "(default: val_accuracy for a classifier, val_rmse for regression).",
    )
    mode: Literal["max", "min"] | None = Field(
        default=None,
        description="max: bigger wins; min: smaller wins. Default: the metric's own direction (max for "
        "val_accuracy, min for the losses and val_rmse).",
    )
    min_gain: float = Field(default=0.0, ge=0, description="How much better than the champion it must be.")
    max_emissions_kg: float | None = Field(
        default=None,
        gt=0,
        description="Carbon ceiling: a version whose job emitted more kgCO2e never becomes the champion.",
    )

    @field_validator("metric")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        return v if v is None else _known_metric(v)

    @model_validator(mode="after")
    def _direction(self) -> PromoteIf:
        # A gate that calls a bigger loss better would crown every worse model.
        if self.metric is not None and self.mode is not None and self.mode != self.direction:
            natural = self.direction
            raise ValueError(
                f"mode {self.mode} would promote a worse model: {self.metric} is better "
                f"{'bigger' if natural == 'max' else 'smaller'}; use {natural}, or leave mode out"
            )
        return self

    @property
    def direction(self) -> Literal["max", "min"]:
        """``max`` or ``min``: the metric's own direction (``mode`` may only agree with it)."""
        return "max" if METRICS[self.metric or "val_accuracy"] else "min"


class Registry(_Model):
    """Where the model is registered."""

    model_name: str | None = Field(default=None, description="Registered model name (default: the job name).")
    promote_if: PromoteIf | None = Field(default=None, description="Gate for moving the champion alias.")


class Retries(_Model):
    """Retries of a failed replica group."""

    max_attempts: int = Field(default=3, ge=1, le=100, description="Attempts per replica group, the first included.")


class TrainingJob(_Model):
    """One training job: data in, a registered model out."""

    name: str = Field(description="Letters, digits and hyphens; 1-63 characters.")
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
        target = self.stopping.target_metric
        if target is not None:
            problems += self._metric_problems("stopping.target_metric.name", target.name)
        if self.gate is not None:
            problems += self._metric_problems("registry.promote_if.metric", self.gate.metric)
        if target is not None and target.name == "train_loss" and self.resources.max_replicas > 1:
            # Each group's train_loss is over its own share of the batches: the groups would reach the
            # target at different epochs and stop apart. Validation metrics are of the shared parameters.
            problems.append(
                "stopping.target_metric.name: train_loss is each replica group's own, so groups would stop at "
                "different epochs; use val_loss (with inputs.validation), or one replica group (max_replicas: 1)"
            )
        if self.stopping.patience_epochs is not None and self.inputs.validation is None:
            problems.append("stopping.patience_epochs: needs a validation channel; add inputs.validation")
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


def ignored_settings(job: TrainingJob) -> list[str]:
    """Settings the job gives that will not do what they seem to (ignored, or read as something else),
    each worded for a warning.

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
    sifting = job.sifting
    if not sifting.enabled:
        tuned = _tuned(sifting, {"enabled", "prefilter"})
        if tuned:
            ignored.append(
                f"sifting.{', sifting.'.join(tuned)}: online sifting is off; set sifting.enabled: true to use them"
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


def _tuned(model: BaseModel, leave_out: set[str]) -> list[str]:
    """The fields of ``model`` that differ from their defaults. Not ``model_fields_set``: a spec that went
    through ``model_dump`` (a job submitted to a deployment) has every field set."""
    return sorted(
        name
        for name, info in type(model).model_fields.items()
        if name not in leave_out and getattr(model, name) != info.get_default(call_default_factory=True)
    )


def _known_metric(v: str) -> str:
    if v not in METRICS:
        raise ValueError(f"unknown metric {v!r}; use one of {', '.join(METRICS)}")
    return v


def _check_widths(v: list[int]) -> list[int]:
    if any(w < 1 for w in v):
        raise ValueError("every hidden size must be a positive integer, e.g. [128, 128]")
    return v


def _check_s3_uri(v: str) -> str:
    if not v.startswith("s3://"):
        raise ValueError(f"{v!r} is not an S3 URI; write it as s3://bucket/prefix/")
    bucket = v[5:].split("/", 1)[0]
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise ValueError(f"{bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, dots, hyphens)")
    return v


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
