"""codecarbon's hardware probe, done once a machine instead of once a process.

The first tracker to start in a process probes the hardware: py-cpuinfo in a subprocess and a fuzzy
TDP lookup, about 1.4 s of CPU. Every replica group is a new process, so each group would pay it on
the cores its training needs. What the probe finds depends only on the machine, so the first process
on a machine (for local groups, the orchestrating stage's meter) saves it under ``TRAINYARD_HOME``,
keyed by boot, GPU visibility and codecarbon version, and later processes seed codecarbon's
per-process cache from it.

That cache is ``codecarbon.core.hardware_cache``, an internal module (codecarbon >= 3.3). If it is
missing or changes shape, or the file is unreadable, every step here does nothing and codecarbon
probes as it always did: slower, never wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
from pathlib import Path

from trainyard import env_settings
from trainyard.home import home, write_json_atomic

log = logging.getLogger(__name__)


FORCED_KEY = "trainyard_forced_cpu_load"  # in a saved plan: its tracker asked for the CPU load model


def seed(tracker) -> bool:
    """Before ``tracker.start()``: give codecarbon this machine's saved probe. True if it was seeded."""
    try:
        from codecarbon.core import hardware_cache

        key = hardware_cache.make_key(tracker)
        if key in hardware_cache._plans:
            return False  # this process probed already
        path = _path(key)
        if not path.is_file():
            return False
        saved = json.loads(path.read_text())
        # A group's meter asks for the CPU load model (carbon.meter: RAPL reads the whole package): a plan saved
        # without asking serves it only where the load model is what the probe found anyway; and a stage's meter,
        # which does not ask, never takes a plan that asked (the machine may have RAPL).
        forced = bool(saved.pop(FORCED_KEY, False))
        cpu_modes = {spec.get("mode") for spec in saved["hardware_specs"] if spec.get("kind") == "cpu"}
        if forced != key.force_mode_cpu_load and not (key.force_mode_cpu_load and cpu_modes == {"cpu_load"}):
            return False
        # The plan was saved from a tracker of either mode; only the specs' mode differs.
        specs = [
            {**spec, "tracking_mode": key.tracking_mode} if "tracking_mode" in spec else spec
            for spec in saved["hardware_specs"]
        ]
        if tracker._gpu_ids == []:
            # This process sees no GPU (a CPU group) and tracks none; the machine's probe lists its GPUs,
            # which codecarbon would rebuild from the plan and count.
            specs = [spec for spec in specs if spec.get("kind") != "gpu"]
        plan = hardware_cache._HardwarePlan(**{**saved, "hardware_specs": specs})
        with hardware_cache._cache_lock:
            hardware_cache._plans.setdefault(key, plan)
        return True
    except Exception:  # noqa: BLE001 - a stale or foreign file only costs the probe
        log.debug("codecarbon hardware probe not seeded", exc_info=True)
        return False


def save(tracker) -> None:
    """After ``tracker.start()``: keep this process's probe for the next processes on this machine."""
    try:
        from codecarbon.core import hardware_cache

        key = hardware_cache.make_key(tracker)
        plan = hardware_cache._plans.get(key)
        lists_gpus = plan is not None and any(spec.get("kind") == "gpu" for spec in plan.hardware_specs)
        if tracker._gpu_ids == [] and lists_gpus:
            return  # a CPU group on a GPU machine: its probe leaves out GPUs that the machine's must list
        path = _path(key)
        if plan is not None and not path.is_file():
            write_json_atomic(path, dataclasses.asdict(plan) | {FORCED_KEY: key.force_mode_cpu_load})
    except Exception:  # noqa: BLE001 - metering goes on without the shortcut
        log.debug("codecarbon hardware probe not saved", exc_info=True)


def sees_no_gpu() -> bool:
    """Whether this process was given no GPU: ``CUDA_VISIBLE_DEVICES`` set and naming none, as the
    launch stage sets it for a CPU group."""
    return env_settings.cuda_visible_devices() == []


def _path(key) -> Path:
    """The file for this machine and tracker settings, whatever the tracking mode and whether the CPU load model
    was asked for (``seed`` tells those apart)."""
    from codecarbon import __version__

    fields = {k: v for k, v in dataclasses.asdict(key).items() if k not in ("tracking_mode", "force_mode_cpu_load")}
    identity = {
        "machine": machine_id(),
        "codecarbon": __version__,
        # A process that sees no GPU shares the machine's probe (seed() drops its GPUs).
        "visible_gpus": None if sees_no_gpu() else os.environ.get("CUDA_VISIBLE_DEVICES"),
        "settings": fields,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return home() / "hardware" / f"codecarbon-{digest}.json"


def machine_id() -> str:
    """This boot of this machine (a container's is its node's): hardware can change across a reboot (a
    resized VM), not within one; and a machine-wide meter here measures every process that shares it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()
