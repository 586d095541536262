"""Trainyard: managed ML training as Prefect pipelines, from open parts.

The ``trainyard`` package is the engine: plain Python, torch, boto3, pyarrow, mlflow and
codecarbon. It never imports Prefect; the ``tasks`` and ``flows`` packages wrap it.
"""

__version__ = "0.1.0"

STAGES = ("staging", "launch", "filtering", "training", "carbon", "registry")
"""The six pipeline stages, in order. Each name is shared by the engine module, the task
module, the tests and the summary's ``timings`` / ``carbon.by_stage`` keys (where the model's
``uploading``, between training and carbon, is timed and metered too)."""
