"""The private IPv4 address of the ECS task this process runs in (``TRAINYARD_HOST=ecs-task``).

A task's address is known only once it runs (ECS gives an ``awsvpc`` task its own network interface at start), so
no template can write it down as Kubernetes' downward API does for a pod. ECS's container agent answers every
container of a task at ``$ECS_CONTAINER_METADATA_URI_V4`` (task metadata endpoint v4, agent 1.39.0 or later, and
Fargate 1.4.0): the container's own document names its network, ``{"Networks": [{"NetworkMode": "awsvpc",
"IPv4Addresses": ["10.0.2.100"], ...}]}``, whose address is the task's interface's, which other hosts in the VPC
reach. In ``bridge`` mode (EC2's default) the address is one on a Docker bridge that only the task's own
instance reaches: refused, as a host other machines cannot reach. Read once a process (``servers.advertised_host``
asks at every server it starts). Prefect-free; no AWS call (the endpoint is local to the task, unsigned).
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import json
import os
import time
import urllib.error
import urllib.request

from trainyard.errors import TrainingError

METADATA_ENV = "ECS_CONTAINER_METADATA_URI_V4"  # set by ECS's container agent in each container it starts
# The endpoint is the agent on this task's own instance: it answers in milliseconds, or it is not there. A few
# short tries ride out an agent busy starting the task; a process outside ECS is told at once (no variable).
TIMEOUT_SECONDS = 2.0
ATTEMPTS = 3
RETRY_PAUSE_SECONDS = 0.5
# No proxy: the endpoint is the agent on this instance's link-local address, which a proxy (an HTTP_PROXY set for
# the image's downloads, say) cannot reach, or would answer for with its own error.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def task_address(setting: str) -> str:
    """This ECS task's private IPv4 address, read from its container's metadata the first time (then kept);
    ``setting``: what asked for it (``TRAINYARD_HOST='ecs-task'``), which each ``TrainingError`` names."""
    uri = os.environ.get(METADATA_ENV, "").strip()
    if not uri:
        raise TrainingError(
            f"{setting}: {METADATA_ENV} is unset, so this process does not run in an ECS task (or its container "
            "agent is older than 1.39.0); use ecs-task only in an ECS task's environment (infra/ecs-gpu-pool.json "
            "sets it there), and set this machine's own address elsewhere"
        )
    return _resolved(uri, setting)


def forget() -> None:
    """Drop the address kept: the next ``task_address`` reads the endpoint again (tests serve several)."""
    _resolved.cache_clear()


@functools.cache  # an error is not kept: a later call (a restarted stage) asks again
def _resolved(uri: str, setting: str) -> str:
    return _address(_document(uri, setting), uri, setting)


def _document(uri: str, setting: str) -> dict:
    """The container's metadata document: tried ``ATTEMPTS`` times, each within ``TIMEOUT_SECONDS``."""
    problem = ""
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(RETRY_PAUSE_SECONDS)
        try:
            with _DIRECT.open(uri, timeout=TIMEOUT_SECONDS) as answer:
                document = json.load(answer)
        except urllib.error.HTTPError as exc:  # (before OSError: it is one) the agent answered, refusing
            problem = f"answered HTTP {exc.code}"
        except (OSError, http.client.HTTPException) as exc:  # refused, timed out, cut off
            problem = f"did not answer ({exc})"
        except ValueError as exc:  # not JSON (or not a URL at all: said as it is)
            problem = f"answered with no JSON document ({exc})"
        else:
            if isinstance(document, dict):
                return document
            problem = "answered with no JSON object"
    raise TrainingError(
        f"{setting}: ECS's task metadata endpoint ({METADATA_ENV}={uri}) {problem}, {ATTEMPTS} tries; it is the "
        "container agent of this task's instance, which answers every task it runs: check the task's agent, or "
        "set this machine's own address instead of ecs-task"
    )


def _address(document: dict, uri: str, setting: str) -> str:
    """The task's address, from the container document's first network: an awsvpc one's first IPv4 address."""
    networks = document.get("Networks")
    network = networks[0] if isinstance(networks, list) and networks and isinstance(networks[0], dict) else {}
    mode = str(network.get("NetworkMode") or "").lower()
    if mode != "awsvpc":
        # bridge: an address on the instance's Docker bridge, which no other instance reaches (the groups then
        # waited out the lighthouse's minute, or dialled nothing to heal); host/none: no address of the task's own
        said = f"network mode {mode!r}" if mode else "no network mode"
        raise TrainingError(
            f"{setting}: this ECS task's metadata ({uri}) names {said}, where the task has no address other hosts "
            "reach; set networkMode awsvpc in its task definition (infra/ecs-gpu-pool.json does), or set this "
            "machine's own address instead of ecs-task"
        )
    for address in network.get("IPv4Addresses") or []:
        try:
            return str(ipaddress.IPv4Address(str(address).strip()))
        except ValueError:
            continue  # ("" where the agent has none yet)
    raise TrainingError(
        f"{setting}: this ECS task's metadata ({uri}) names no IPv4 address for its awsvpc network; its network "
        "interface has none (an IPv6-only subnet?): run it in a subnet with IPv4 addresses, or set this machine's "
        "own IPv4 address instead of ecs-task"
    )
