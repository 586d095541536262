"""The job spec: a pydantic ``TrainingJob`` mirroring SageMaker's CreateTrainingJob.

It is the one parameter of the ``training-pipeline`` flow, so the Prefect UI renders it as a
form; every field carries a description. A bad spec is rejected here, before anything starts,
with one line per problem naming the field and the fix (``load_job`` raises ``SpecError``).

The sections live in modules of their own: ``data`` (channels and outputs), ``sifting`` (its ``prune`` in
``pruning``), ``stopping``, ``sections`` (the rest), ``job`` (the whole spec and its checks across sections),
``ignored`` (the settings it would ignore: warnings) and ``parsing`` (YAML, ``--set`` overrides and the error lines);
``base`` holds what they share. Import from ``trainyard.spec``.
"""

from trainyard.spec.base import BUILTIN_ALGORITHMS, METRICS
from trainyard.spec.data import Channel, Inputs, Output
from trainyard.spec.ignored import ignored_settings
from trainyard.spec.job import TrainingJob
from trainyard.spec.parsing import apply_overrides, load_job, parse_job, problems_of
from trainyard.spec.pruning import DEFAULT_PRUNING, Pruning
from trainyard.spec.sections import (
    Algorithm,
    Carbon,
    Elastic,
    FaultInjection,
    Hyperparameters,
    PromoteIf,
    Registry,
    Resources,
    Retries,
)
from trainyard.spec.sifting import Prefilter, Proxy, Sifting
from trainyard.spec.stopping import Stopping, TargetMetric

__all__ = [
    "BUILTIN_ALGORITHMS",
    "DEFAULT_PRUNING",
    "METRICS",
    "Algorithm",
    "Carbon",
    "Channel",
    "Elastic",
    "FaultInjection",
    "Hyperparameters",
    "Inputs",
    "Output",
    "Prefilter",
    "PromoteIf",
    "Proxy",
    "Pruning",
    "Registry",
    "Resources",
    "Retries",
    "Sifting",
    "Stopping",
    "TargetMetric",
    "TrainingJob",
    "apply_overrides",
    "ignored_settings",
    "load_job",
    "parse_job",
    "problems_of",
]
