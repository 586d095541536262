# The Trainyard worker image: a Prefect worker (process, Kubernetes or ECS) and the flow runs it starts
# (training-pipeline, train-replica), on CUDA PyTorch. Build it from the repository root:
#
#   docker build -f infra/worker.Dockerfile -t REGISTRY/trainyard-worker:TAG .
#
# then give it to the GPU pool: trainyard infra apply --kind kubernetes --image REGISTRY/trainyard-worker:TAG
#
# The code lives in /opt/trainyard. Deployments record the folder `prefect deploy` ran in and flow runs
# start there (prefect.yaml has no pull step), so deploy from /opt/trainyard, for example
# `docker run --rm -e PREFECT_API_URL=... IMAGE prefect --no-prompt deploy --all`.

# The PyTorch image's CUDA torch satisfies the project's torch>=2.7, so pip does not fetch another.
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 \
    TRAINYARD_HOME=/var/lib/trainyard

WORKDIR /opt/trainyard

# Only what runs: no virtual environment, tests or local state in the image.
COPY pyproject.toml README.md prefect.yaml ./
COPY trainyard ./trainyard
COPY tasks ./tasks
COPY flows ./flows
COPY blocks ./blocks
COPY infra ./infra

# prefect-kubernetes for a Kubernetes worker (prefect-aws, for ECS, is a project dependency).
RUN pip install . "prefect-kubernetes>=0.5" \
    && useradd --create-home --uid 1000 trainyard \
    && mkdir -p "$TRAINYARD_HOME" \
    && chown -R trainyard "$TRAINYARD_HOME"

USER trainyard

# A worker by default; the worker runs each flow run in a container of this same image.
CMD ["prefect", "worker", "start", "--pool", "trainyard-gpu"]
