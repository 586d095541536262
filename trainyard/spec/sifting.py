"""The ``sifting`` section: the offline prefilter, online sifting's keep rule and its proxy; pruning (InfoBatch)
is ``pruning.py``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from trainyard.spec.base import POSITIVE_WIDTHS, SEED_MAX, _check_widths, _Model, titled
from trainyard.spec.pruning import PRUNING_OFF, Pruning


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
    reference_hidden_sizes: list[int] = Field(
        default=[64], description="Hidden layers of the reference model.", json_schema_extra=POSITIVE_WIDTHS
    )

    reference_learning_rate: float = Field(default=3e-3, gt=0, description="The reference models' learning rate.")
    seed: int = Field(
        default=0, ge=0, le=SEED_MAX, description="Seed of the cross-fitting split and the reference models."
    )

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


class Proxy(_Model):
    """The proxy model of ``sifting.score: proxy``: a small classifier (a linear regression for a regression
    job) on the job's features, trained alongside on the rows each step trains on (selection via proxy)."""

    hidden_sizes: list[int] = Field(
        default=[32],
        description="Hidden layers of the proxy model (a classifier's).",
        json_schema_extra=POSITIVE_WIDTHS,
    )
    # benchmarks/sifting_bound.py (stop 47): 0.003 to 0.03 ranked about alike on digits
    learning_rate: float = Field(default=0.01, gt=0, description="The proxy's AdamW learning rate, constant.")

    @field_validator("hidden_sizes")
    @classmethod
    def _positive_widths(cls, v: list[int]) -> list[int]:
        return _check_widths(v)


# sifting.enabled's default since stop 52 (benchmarks/sifting.py's pick): the labels pick the rule
DEFAULT_NOISY_SHARE = 0.1

# sifting.noisy_share's pick for a clean train channel (Sifting.adapted): the proxy's top quarter, from its first step
# (delay_steps unset: Sifting.default_delay). sifting_arms.py on digits over 31 seeds, filling the baseline's budget
# (stop 51): 0.58x the baseline's FLOPs to its accuracy, where the top third read 0.69x and, with the keep rule's
# 10-step delay, 0.78x (stops 47-50: the top third with the delay); sifting.py's pruning x3 read 1.01x on seeds 0-6.
CLEAN_CHANNEL: dict[str, Any] = {"beta": 3.0, "score": "proxy", "selection": "top"}
DELAY_STEPS = 10  # delay_steps left unset, but for the proxy's top selection (Sifting.default_delay)


def _smart_sifting_names(schema: dict[str, Any]) -> None:
    """Smart sifting's names in the JSON schema too: a deployment's parameters are checked against it (no
    other properties allowed) before the flow's own validation, which takes them (``AliasChoices``), runs,
    so a REST submission with ``beta_value`` was refused while ``trainyard`` took it. As pattern properties,
    which the API checks and the UI's form does not draw: as properties, the form showed each setting twice."""
    titled(schema)  # (this replaces _Model's json_schema_extra)
    properties, patterns = schema.get("properties", {}), schema.setdefault("patternProperties", {})
    for theirs, ours in (("beta_value", "beta"), ("sift_delay", "delay_steps")):
        patterns[f"^{theirs}$"] = {**properties.get(ours, {}), "description": f"smart sifting's name for {ours}"}
        for key in ("title", "default"):  # no default: it is not sent beside ours
            patterns[f"^{theirs}$"].pop(key, None)


class Sifting(_Model):
    """Online sifting in every replica group's training loop (smart sifting's keep rule)."""

    model_config = ConfigDict(json_schema_extra=_smart_sifting_names)  # merged with _Model's
    _adaptive: bool = PrivateAttr(default=False)  # set by resolved: see adaptive

    enabled: bool = Field(default=False, description="Drop uninformative samples during training.")
    # smart sifting's own names (beta_value, sift_delay) are accepted too, for specs carried over from SageMaker
    # With noisy_share set and these left unset, a classifier's file-mode channel gets what its labels call for
    # (label_noise.py; stop 48): pruning if noisy, the proxy's top quarter if clean (CLEAN_CHANNEL).
    # Left unset, beta and prune are the combination benchmarks/sifting.py found best (pruning alone, batch_factor 3:
    # stops 28 to 33 by the most targets met on four tuning seeds; stops 35-36 with the finalists on their own schedules
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
        "train channel (pruning alone, with sifting.prune's default: the best combination Trainyard's benchmark "
        "found), 1 for a streamed one; with noisy_share set, a classifier's file-mode channel whose labels the "
        "filtering stage finds clean gets 3 with score proxy and selection top instead.",
    )
    loss_history_length: int = Field(default=500, ge=1, description="Losses kept to rank new ones against.")
    delay_steps: int | None = Field(
        default=None,
        ge=0,
        validation_alias=AliasChoices("delay_steps", "sift_delay"),
        description="Steps before sifting starts (smart sifting's sift_delay, whose default is 1000: longer than "
        "many small jobs). Nothing is scored meanwhile: each step still draws batch_size * (1 + beta) candidates and "
        "trains on the first batch_size of them, so the data is seen at the same pace as when sifting. Default: 10; "
        "0 with score proxy and selection top (the delay lets the keep rule gather a history of losses to rank "
        "against, the trained rows' training losses; the proxy's top selection ranks each step's candidates among "
        "themselves, from its first step).",
    )
    score: Literal["loss", "reducible_loss", "proxy"] = Field(
        default="loss",
        description="What ranks a candidate: 'loss' (smart sifting's rule), 'reducible_loss' (RHO-LOSS: its loss "
        "minus the prefilter's reference loss for it, so noisy samples are skipped as well as learnt ones; needs a "
        "file-mode train channel) or 'proxy' (the loss of a small model trained alongside, sifting.proxy: a fresh "
        "ranking at a fraction of a forward pass's cost; it takes label noise for hard rows).",
    )
    selection: Literal["keep_rule", "top"] = Field(
        default="keep_rule",
        description="How the kept candidates are picked: 'keep_rule' (smart sifting's: each kept with probability "
        "percentile ** beta) or 'top' (the 1 / (1 + beta) highest-scored, RHO-LOSS's and selection via proxy's).",
    )
    proxy: Proxy = Field(default_factory=Proxy, description="The proxy model of score 'proxy'.")
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
        "Left out: with beta 0 or unset on a file-mode train channel, learnt_fraction 0.7, hardest_fraction 0.1 "
        "(0 for regression), batch_factor 3 (the best combination Trainyard's benchmark found); otherwise off. "
        "Given, the settings it leaves out take those values.",
    )
    # On by default since stop 52: benchmarks/sifting.py's search picked the labels' pick over pruning x3 (4 of 6 tuning
    # targets against 3, its finalists run one at a time), and it met 8 of the 10 lines on the reported seeds (digits
    # 0.66x FLOPs, 1.45x wall, +0.4 points; tabular as pruning x3, which it picks there): benchmarks/README. Stop 53's
    # run tied the two (4 of 6 each) and broke the tie to pruning x3 by digits' one-run walls; kept. Stop 54's, the
    # finalists' walls medians of three, picked it alone (4 of 6, the rest 3), 8 of 10 lines again (benchmarks/README).
    # Stops 56 and 57 (idle) picked pruning x3 (7 of 10 lines at 57; the labels' pick missed its finals by digits' wall)
    noisy_share: float | None = Field(
        default=DEFAULT_NOISY_SHARE,
        ge=0,
        le=1,
        description="Let the labels pick online sifting's rule (with beta, score, selection, prune and "
        "reuse_loss_epochs unset, a classifier on a file-mode train channel): the filtering stage trains two small "
        "reference models (sifting.prefilter's reference settings), each scoring the half of the rows it did not see, "
        "and if more than this share of the rows get a loss above chance (a label the reference finds less likely "
        "than a uniform guess: label noise, or rows too hard to learn) the channel is noisy and sifting prunes "
        "(sifting.prune's defaults); otherwise it keeps the top quarter of each step's candidates by a proxy model's "
        "loss (beta 3, score proxy, selection top, from the first step; pruning still where the proxy's forward costs "
        "more than a tenth of the model's), which gains when the job runs more epochs "
        "than it would unfiltered. Default 0.1 (the benchmark's pick); null: no measuring, the rule is pruning (a "
        "classifier's default until stop 52). The summary's filtering report says what was measured and chosen.",
    )
    min_class_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Class balance guard of online sifting: each class keeps at least this fraction of its share "
        "of a batch (rounded up), and of its rows from pruning's hardest rule; the prefilter has its own "
        "(prefilter.min_class_fraction).",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_name_each(cls, data: Any) -> Any:
        for ours, theirs in (("beta", "beta_value"), ("delay_steps", "sift_delay")):
            if isinstance(data, dict) and theirs in data and data[theirs] is None:
                data = {k: v for k, v in data.items() if k != theirs}  # an empty form field: not given
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
            prune = Pruning(**(PRUNING_OFF if beta > 0 or streamed else {}))
        if regression and "hardest_fraction" not in prune.model_fields_set:
            prune = Pruning(**prune.model_dump(exclude_unset=True), hardest_fraction=0.0)
        resolved = self.model_copy(update={"beta": beta, "prune": prune})
        unset = self.beta is None and self.prune is None and self.reuse_loss_epochs is None
        resolved._adaptive = unset and self.score == "loss" and self.selection == "keep_rule"
        resolved._adaptive &= not streamed and not regression and self.noisy_share is not None
        # resolved again (TrainingJob's validators run again on an assignment, validate_assignment): still adaptive
        resolved._adaptive |= self._adaptive
        if resolved.delay_steps is None and not resolved._adaptive:  # (an adaptive one's waits for the rule: adapted)
            object.__setattr__(resolved, "delay_steps", resolved.default_delay())
        # still the fields the user set: a spec sent as written (flows.client.submit) leaves these defaults to
        # the code that runs it, and the warnings about settings given (``ignored_settings``) see the user's
        object.__setattr__(resolved, "__pydantic_fields_set__", set(self.model_fields_set))
        return resolved

    @property
    def adaptive(self) -> bool:
        """Whether the filtering stage picks the online rule from the labels: ``noisy_share`` set, in a config
        that ``resolved`` returned for a classifier on a file-mode channel (a streamed one is not read whole
        before training; a regression job's labels have no chance level to tell noise by), sifting on with beta,
        prune and reuse_loss_epochs unset and score and selection at their defaults (a form sends those)."""
        return self.enabled and self._adaptive

    def adapted(self, noisy: bool) -> Sifting:
        """This config (``resolved``, with ``adaptive`` true) for a train channel found noisy or clean: as it
        is (pruning) for a noisy one, the proxy's top quarter (``CLEAN_CHANNEL``) for a clean one."""
        clean = CLEAN_CHANNEL | {"prune": Pruning(**PRUNING_OFF)}
        chosen = self.model_copy() if noisy else self.model_copy(update=clean)
        object.__setattr__(chosen, "delay_steps", chosen.delay)  # left unset: the picked rule's default
        chosen._adaptive = False  # picked: not to be measured again
        return chosen

    def default_delay(self) -> int:
        """``delay_steps`` left unset: 0 for the proxy's top selection, else ``DELAY_STEPS``. The delay lets the keep
        rule's percentiles gather losses to rank against; a top selection ranks each step's candidates among
        themselves, and with the proxy ranking costs a small share of a forward pass. On digits the delay's uniform
        steps cost the proxy's top quarter about a third more FLOPs to the baseline's accuracy
        (``benchmarks/README.md``, stop 51: 0.58x without, 0.78x with, over 31 seeds). Only the proxy's was
        measured, so a top selection by the job's own loss keeps the delay (its scoring passes are whole forwards)."""
        return 0 if self.score == "proxy" and self.selection == "top" else DELAY_STEPS

    @property
    def delay(self) -> int:
        """The steps before sifting starts: ``delay_steps``, or its default where unset (a config not resolved)."""
        return self.default_delay() if self.delay_steps is None else self.delay_steps

    def settled(self) -> tuple[float, Pruning]:
        """``(beta, prune)`` of a config that ``resolved`` returned (a job's, with sifting on), where neither
        is unset any more."""
        assert self.beta is not None and self.prune is not None, "sifting used before Sifting.resolved"
        return self.beta, self.prune

    @property
    def prunes(self) -> bool:
        """Whether ``prune`` leaves rows out (a job resolves it when sifting is on; unset, it is off)."""
        return self.enabled and self.prune is not None and self.prune.active

    @property
    def prefilter_on(self) -> bool:
        """Whether the filtering stage prefilters: ``prefilter.enabled``; left unset, when sifting is on and
        something needs it: the keep rule (whose default removes exact duplicates first, the stop 16-24
        pick), loss-based drops, or reducible-loss scoring (its reference losses; not where no keep rule
        ranks by it, and ``score`` is ignored with a warning)."""
        if self.prefilter.enabled is not None:
            return self.prefilter.enabled
        pre = self.prefilter
        wanted = (self.beta or 0) > 0 or pre.drop_learnt_fraction or pre.drop_unlearnable_fraction
        return self.enabled and bool(wanted or self.by_reducible_loss)

    def loss_reuse_epochs(self, streamed: bool) -> int:
        """``reuse_loss_epochs`` as it applies to a train channel that is streamed or not (and not to the
        proxy's losses, which are fresh for a fraction of a forward pass's cost)."""
        if self.score == "proxy":
            return 0
        if self.reuse_loss_epochs is None:
            return 0 if streamed else 1
        return self.reuse_loss_epochs

    def ignored_proxy_settings(self, builtin: str | None, regression: bool) -> list[str]:
        """Proxy settings (``score: proxy``) that do not do what they seem to, worded as warnings (the job's
        ``ignored_settings``); none with sifting or the keep rule off (said there)."""
        if not self.enabled or not self.beta:
            return []
        if self.score != "proxy":
            # (given: not its default. Not model_fields_set, which a spec dumped whole, as the UI's form sends it, has)
            given = self.proxy != Proxy()
            return (
                [f"sifting.proxy: the proxy model of sifting.score proxy; the score is {self.score}"] if given else []
            )
        said = []
        if self.reuse_loss_epochs:
            said.append("sifting.reuse_loss_epochs: the proxy scores every candidate afresh (score proxy)")
        if regression and self.proxy.hidden_sizes != Proxy().hidden_sizes:
            said.append(
                "sifting.proxy.hidden_sizes: a regression job's proxy is a linear regression (no hidden layers)"
            )
        if builtin == "linear-regression":
            said.append(
                "sifting.score: proxy: the job's model is a linear regression, as its proxy would be: ranking by the "
                "proxy costs more than by the job's own loss and ranks no better; use score loss"
            )
        return said

    @property
    def by_reducible_loss(self) -> bool:
        """Whether the groups rank by reducible loss (RHO-LOSS): they need the prefilter's reference losses.
        Not with the keep rule off (beta 0), which ranks nothing: no reference model is trained for it."""
        return self.enabled and self.score == "reducible_loss" and self.beta != 0
