"""The job spec's ``stopping`` section: when training stops before its last epoch, and how often it validates."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from trainyard.spec.base import METRICS, _known_metric, _Model, constrained


class TargetMetric(_Model):
    """Stop as soon as a metric reaches a value."""

    name: str = Field(
        description="val_accuracy, val_loss, val_rmse or train_loss.",
        json_schema_extra=constrained("string", enum=list(METRICS)),  # a choice in the form
    )
    value: float = Field(description="The value to reach (>= for accuracy, <= for losses).")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return _known_metric(v)

    @model_validator(mode="after")
    def _reachable(self) -> TargetMetric:
        if self.name == "val_accuracy" and not 0 < self.value <= 1:
            fix = f"write {self.value / 100:g} for {self.value:g}%" if 1 < self.value <= 100 else "give one in (0, 1]"
            raise ValueError(f"value {self.value:g}: val_accuracy is a fraction of the validation rows; {fix}")
        if self.name != "val_accuracy" and self.value < 0:
            raise ValueError(f"value {self.value:g}: {self.name} is never below 0; give the value to reach, >= 0")
        return self


class Stopping(_Model):
    """When training stops before its last epoch."""

    max_runtime_seconds: int = Field(default=86_400, ge=1, description="Wall-clock limit of the training stage.")
    target_metric: TargetMetric | None = Field(default=None, description="Stop once this metric reaches its value.")
    patience_epochs: int | None = Field(
        default=None, ge=1, description="Stop after this many epochs without improvement of the watched metric."
    )
    validate_every_epochs: int = Field(
        default=1,
        ge=1,
        description="Validate at every this many epochs' end (and always at the last): for epochs so short that "
        "validating each costs a share of the training (a small channel, or sifting's epochs, which train "
        "1 / (1 + beta) of their rows). The target and patience are checked at validated epochs (a train_loss target "
        "and patience on it at every epoch; an epoch it stops at or keeps as the best validates too); patience "
        "still counts epochs. With several groups, a loss that is no longer a number is found at a validation.",
    )
    restore_best: bool | None = Field(
        default=None,
        description="Keep the parameters of the epoch whose watched metric (target_metric's, else val_loss) was "
        "best, not the last epoch's: the model uploaded and registered. Default: on with patience_epochs.",
    )

    @property
    def restores_best(self) -> bool:
        """Whether the job's model is its best epoch's (``restore_best``, on by default with patience)."""
        return self.restore_best if self.restore_best is not None else self.patience_epochs is not None

    @property
    def watched_metric(self) -> str:
        """The metric patience and the best epoch are judged on: the target metric's, else ``val_loss``."""
        return self.target_metric.name if self.target_metric is not None else "val_loss"
