"""The demo's data: a realistic churn-like tabular dataset, and the job spec that trains on it.

Features are correlated numeric columns (tenure, charges, usage, support calls...), the label
depends on them non-linearly, a few percent of labels are flipped (noise), and some rows repeat
(redundancy), as in real customer tables.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainyard import s3

DEMO_BUCKET = "trainyard-demo"


def churn_table(rows: int, seed: int = 0, label_noise: float = 0.03, duplicate_fraction: float = 0.1) -> pa.Table:
    """A churn dataset of ``rows`` rows with label ``churned`` (0/1)."""
    rng = np.random.default_rng(seed)
    n = rows
    tenure = rng.gamma(2.0, 12.0, n).clip(0, 72)
    monthly = rng.normal(65, 25, n).clip(15, 150)
    total = tenure * monthly * rng.normal(1.0, 0.05, n)
    calls = rng.poisson(1.5 + (monthly > 90) * 1.5, n)
    usage = rng.lognormal(3, 0.6, n)
    contract = rng.choice([0, 1, 2], n, p=[0.55, 0.25, 0.2])
    late = rng.binomial(6, 0.1 + 0.2 * (calls > 3), n)
    logit = (
        -1.2
        - 0.06 * tenure
        + 0.025 * monthly
        + 0.45 * calls
        - 0.9 * contract
        + 0.35 * late
        - 0.004 * usage
        + 0.8 * np.sin(tenure / 6.0)
    )
    churned = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    flip = rng.random(n) < label_noise
    churned[flip] = 1 - churned[flip]
    cols = {
        "tenure_months": tenure,
        "monthly_charges": monthly,
        "total_charges": total,
        "support_calls": calls.astype(np.float64),
        "usage_gb": usage,
        "contract_type": contract.astype(np.float64),
        "late_payments": late.astype(np.float64),
        "churned": churned,
    }
    dup = rng.random(n) < duplicate_fraction
    source = rng.integers(0, n, n)
    for values in cols.values():
        values[dup] = values[source[dup]]
    return pa.table(cols)


def upload_demo_data(rows: int, seed: int = 0, shards: int = 4, bucket: str = DEMO_BUCKET) -> dict[str, str]:
    """Write train (``shards`` parquet objects) and validation channels to S3; return their URIs."""
    client = s3.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    table = churn_table(rows, seed)
    n_val = rows // 5
    parts = {"validation/part-0.parquet": table.slice(0, n_val)}
    train = table.slice(n_val)
    step = -(-train.num_rows // shards)
    for i in range(shards):
        parts[f"train/part-{i}.parquet"] = train.slice(i * step, step)
    for key, part in parts.items():
        buf = io.BytesIO()
        pq.write_table(part, buf)
        client.put_object(Bucket=bucket, Key=f"churn/{key}", Body=buf.getvalue())
    base = f"s3://{bucket}/churn"
    return {"train": f"{base}/train/", "validation": f"{base}/validation/", "output": f"{base}/output/"}


def demo_job(uris: dict[str, str], epochs: int = 8, replicas: int = 2) -> dict:
    """The demo's job spec."""
    return {
        "name": "churn-demo",
        "algorithm": {"builtin": "mlp-classifier"},
        "hyperparameters": {"epochs": epochs, "batch_size": 256, "learning_rate": 0.003, "hidden_sizes": [64, 64]},
        "inputs": {
            "train": {"s3_uri": uris["train"], "format": "parquet", "label": "churned"},
            "validation": {"s3_uri": uris["validation"], "format": "parquet", "label": "churned"},
        },
        "output": {"s3_uri": uris["output"]},
        "resources": {"replicas": replicas, "min_replicas": 1, "max_replicas": replicas},
        "stopping": {"max_runtime_seconds": 1800, "patience_epochs": 3},
        "carbon": {"country_iso_code": "IRL", "pue": 1.2},
        "registry": {"model_name": "churn-demo", "promote_if": {"metric": "val_accuracy", "mode": "max"}},
    }
