"""The job's sections other than its data, its sifting and its stopping: the algorithm and its hyperparameters,
resources, elastic training, carbon accounting, registration and retries."""

from __future__ import annotations

import difflib
import posixpath
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from trainyard import env_settings, grid_data
from trainyard.errors import TrainyardError
from trainyard.spec import job_variables
from trainyard.spec.base import (
    _ENTRYPOINT_RE,
    METRICS,
    POSITIVE_WIDTHS,
    SEED_MAX,
    _check_widths,
    _known_metric,
    _Model,
    constrained,
)


class Algorithm(_Model):
    """Which model to train: a built-in, or your own factory."""

    builtin: Literal["mlp-classifier", "linear-regression"] | None = Field(
        default=None, description="A built-in algorithm: mlp-classifier or linear-regression."
    )
    entrypoint: str | None = Field(
        default=None,
        description='"pkg.module:build": build(num_features, num_outputs, hyperparameters) returns '
        "(model, loss_fn) where loss_fn(outputs, labels) gives one loss per sample.",
        json_schema_extra=constrained("string", pattern=_ENTRYPOINT_RE.pattern),
    )
    task: Literal["classification", "regression"] = Field(
        default="classification",
        description="For an entrypoint: whether labels are classes or numbers (built-ins imply it).",
    )

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str | None) -> str | None:
        if v is not None and not _ENTRYPOINT_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not of the form 'package.module:function'")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> Algorithm:
        if (self.builtin is None) == (self.entrypoint is None):
            raise ValueError("set exactly one of 'builtin' (mlp-classifier, linear-regression) or 'entrypoint'")
        if self.builtin == "mlp-classifier" and self.task == "regression":  # (not the default: the user's)
            raise ValueError(
                "task: regression, but the built-in mlp-classifier is a classifier; use builtin linear-regression, "
                "or leave task out (a built-in implies it)"
            )
        if self.builtin == "linear-regression":
            object.__setattr__(self, "task", "regression")
        elif self.builtin == "mlp-classifier":
            object.__setattr__(self, "task", "classification")
        return self


class Hyperparameters(_Model):
    """Training settings. Unknown keys are kept and passed to an entrypoint algorithm (a job with a built-in,
    which reads none, refuses them)."""

    model_config = ConfigDict(extra="allow")  # _Model's other settings (and checks) stay

    epochs: int = Field(default=10, ge=1, le=100_000, description="Passes over the training channel.")
    batch_size: int = Field(default=256, ge=1, description="Samples per optimizer step, over all replica groups.")
    learning_rate: float = Field(default=1e-3, gt=0, le=10, description="Optimizer step size.")
    optimizer: Literal["adam", "sgd"] = Field(default="adam", description="adam or sgd (with momentum).")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="Momentum, for sgd only.")
    weight_decay: float = Field(default=0.0, ge=0, description="L2 penalty (decoupled for adam: AdamW).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        default="constant", description="Learning-rate decay over the epochs: constant, cosine or linear."
    )
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Steps of linear learning-rate warm-up from zero; lr_schedule's decay runs after them.",
    )
    min_lr_fraction: float = Field(
        default=0.0, ge=0, le=1, description="Where cosine or linear decay ends, as a fraction of learning_rate."
    )
    hidden_sizes: list[int] = Field(
        default=[128, 128], description="Hidden layer widths of mlp-classifier.", json_schema_extra=POSITIVE_WIDTHS
    )
    seed: int = Field(default=0, ge=0, le=SEED_MAX, description="Seed for initialisation and shuffling.")

    @field_validator("hidden_sizes")
    @classmethod
    def _positive_widths(cls, v: list[int]) -> list[int]:
        return _check_widths(v)

    @model_validator(mode="after")
    def _mlflow_param_names(self) -> Hyperparameters:
        """An entrypoint's own keys become MLflow params (``hp.<key>``): one MLflow refuses failed the job at
        registration, after all its training."""
        for key in self.model_extra or {}:
            name = f"hp.{key}"
            if not _PARAM_NAME.fullmatch(name) or len(name) > 250 or posixpath.normpath(name) != name:
                fixed = re.sub(r"\.\.+", ".", re.sub(r"[^\w.\- :]", "_", key))[:200]  # (no slash: no path)
                raise ValueError(
                    f"{key!r}: MLflow records hyperparameters as params (hp.{key}), whose names may hold only "
                    "letters, digits, _ . - : / and spaces, no '..', '//' or trailing '/', 250 characters at most; "
                    f"rename it (e.g. {fixed!r})"
                )
        return self


_PARAM_NAME = re.compile(r"^[/\w.\- :]*$")  # MLflow's rule (mlflow.utils.validation), colons but on Windows


# The work-pool job variables every Trainyard pool template declares (infra/apply.py builds the templates
# from this list): a job may set these, and no others, for its groups' flow runs.
LAUNCHER_JOB_VARIABLES = (
    "env",
    "gpus",
    "image",
    "cpu",
    "memory",
    "node_selector",
    "tolerations",
    "shm_size",
    "shared_memory_mib",
)
MOST_REPLICAS = 64


class Resources(_Model):
    """Replica groups and where they run."""

    replicas: int = Field(default=1, ge=1, le=MOST_REPLICAS, description="Replica groups to start with.")
    min_replicas: int = Field(default=1, ge=1, le=MOST_REPLICAS, description="Fewest live groups the job trains with.")
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=MOST_REPLICAS,
        description="Most groups the job may grow to (`trainyard scale`; on a work pool, as the pool has room);"
        " default: replicas.",
    )
    work_pool: str = Field(
        default="local",
        description="Where the groups run: 'local' (processes beside the pipeline) or the name of a Prefect work "
        "pool, whose 'train-replica' deployment of the same name runs each group as a flow run.",
    )
    gpus_per_replica: int = Field(
        default=0,
        ge=0,
        description="GPUs each group asks for (0 on CPU machines). A group trains on one GPU (more a group is not "
        "built yet): give 1 and raise replicas to use more.",
    )
    job_variables: dict[str, Any] = Field(
        default_factory=dict,
        # the default said in the schema too: without one, the API's check took null for it (the form's empty field)
        json_schema_extra={"default": {}, "propertyNames": {"enum": list(LAUNCHER_JOB_VARIABLES)}},
        description="Work-pool job variables for each group's flow run: image, cpu, memory, node_selector, "
        "tolerations, shm_size (shared_memory_mib on ECS), env (see infra/).",
    )

    @field_validator("job_variables")
    @classmethod
    def _launcher_variables(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(LAUNCHER_JOB_VARIABLES))
        if unknown:
            close = difflib.get_close_matches(unknown[0], LAUNCHER_JOB_VARIABLES, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(
                f"{', '.join(unknown)}: not a variable of Trainyard's pool templates; {hint}"
                f"use {', '.join(LAUNCHER_JOB_VARIABLES)}"
            )
        for name, value in v.items():
            wrong = job_variables.problem(name, value)
            if wrong is not None:
                raise ValueError(wrong)
        env = v.get("env")
        if env and env.get(env_settings.THREADS_ENV) is not None:
            try:  # read by each group as it starts: refused here, not as every group failing three times
                env_settings.count(env_settings.THREADS_ENV, 1, env[env_settings.THREADS_ENV])
            except TrainyardError as exc:
                raise ValueError(f"env: {exc}") from None
        return v

    @model_validator(mode="after")
    def _ordered(self) -> Resources:
        most = self.replicas if self.max_replicas is None else self.max_replicas
        object.__setattr__(self, "max_replicas", most)
        if not self.min_replicas <= self.replicas <= most:
            fix = "lower min_replicas or raise replicas" if self.min_replicas > self.replicas else "raise max_replicas"
            raise ValueError(
                f"need min_replicas <= replicas <= max_replicas, got {self.min_replicas} <= "
                f"{self.replicas} <= {self.max_replicas}; {fix}"
            )
        return self


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

    fault_injection: list[FaultInjection] = Field(
        default_factory=list, description="Failure drills.", json_schema_extra={"default": []}
    )
    checkpoint_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Write the training state to output.s3_uri every N committed steps: the fallback used only "
        "when every replica group is lost (groups otherwise heal from a live peer). Off by default.",
    )


class Carbon(_Model):
    """Carbon accounting settings (codecarbon's offline tracker)."""

    country_iso_code: str = Field(
        default="USA",
        description="ISO 3166-1 alpha-3 code of the grid, e.g. IRL.",
        json_schema_extra=constrained("string", pattern="^[A-Za-z]{3}$"),
    )
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
        known = grid_data.countries()
        if known is not None and v.upper() not in known:
            # codecarbon would price it at the world average while the report named this grid
            raise ValueError(
                f"{v!r}: codecarbon has no grid figures for it; give an ISO 3166-1 alpha-3 code such as DEU "
                "(Germany), GBR (the UK) or IRL"
            )
        return v.upper()

    @model_validator(mode="after")
    def _known_region(self) -> Carbon:
        if self.region is None:
            return self
        known = grid_data.regions(self.country_iso_code)
        if known is None:
            return self  # ignored_settings says so: codecarbon has no regional figures for this country
        key = grid_data.region_key(self.country_iso_code, self.region)
        if key not in known:
            # codecarbon would fall back to the national average, with a traceback in every stage's log
            close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = f"did you mean {known[close[0]]!r}? " if close else ""
            shown = sorted(set(known.values()))
            listed = ", ".join(shown[:12]) + (", ..." if len(shown) > 12 else "")
            raise ValueError(
                f"region {self.region!r}: not a {self.country_iso_code} region codecarbon has figures for; "
                f"{hint}use one of {listed}, or leave region out for the national figure"
            )
        object.__setattr__(self, "region", key if self.country_iso_code in ("USA", "CAN") else self.region)
        return self


class PromoteIf(_Model):
    """The promotion gate: when a new version becomes the champion."""

    metric: str | None = Field(
        default=None,
        description="Metric compared against the champion's: val_accuracy, val_loss, val_rmse or train_loss "
        "(default: val_accuracy for a classifier, val_rmse for regression).",
        json_schema_extra=constrained("string", enum=list(METRICS)),
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


MODEL_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$"


class Registry(_Model):
    """Where the model is registered."""

    model_name: str | None = Field(
        default=None,
        description="Registered model name: letters, digits, '.', '_' and '-' (default: the job name).",
        json_schema_extra=constrained("string", pattern=MODEL_NAME_PATTERN),
    )
    promote_if: PromoteIf | None = Field(default=None, description="Gate for moving the champion alias.")

    @field_validator("model_name")
    @classmethod
    def _registrable(cls, v: str | None) -> str | None:
        # MLflow refuses '/' and ':' in a name, and quotes would break the registry's searches; refused here,
        # before the job trains, not at registration after it
        if v is not None and not re.fullmatch(MODEL_NAME_PATTERN, v):
            raise ValueError(
                f"{v!r}: use letters, digits, '.', '_' and '-' (starting with a letter or digit, up to 255)"
            )
        return v


class Retries(_Model):
    """Retries of a failed replica group."""

    max_attempts: int = Field(default=3, ge=1, le=100, description="Attempts per replica group, the first included.")
