"""How long a group may be silent before it is taken for hung, how long its restart waits, and how long its
peers wait for it in torchft's quorum.

The three are one budget. A survivor whose next step needs the failed group (fewer groups left than
``resources.min_replicas``) waits for the restart in the quorum, and must wait longer than the supervisor
takes to notice the failure (the silence limit, for a hung group) and to bring the group back (its backoff,
then a process or a pool's run starting). A fixed minute's wait, under the 120 s silence limit, failed the
survivor too, and with it the state the restart was to heal from: both began again at step 0. A restart
deferred for longer (its GPUs held by another job, its pool's API down: ``RESTART_DEFERRED_SECONDS`` at a
time) can still outlast the wait; the survivors then fail and are restarted as any failed group.
"""

from __future__ import annotations

from trainyard import env_settings
from trainyard.training.trainer import PG_TIMEOUT

# A group whose heartbeat is older than this is hung (its peers have dropped it): it is killed and
# restarted. Longer than any step and the process-group timeout; TRAINYARD_SILENT_GROUP_SECONDS overrides.
SILENT_GROUP_SECONDS = 120.0
SILENT_GROUP_SECONDS_ENV = "TRAINYARD_SILENT_GROUP_SECONDS"
# Seconds to wait between a group's crash and its restart, doubled per attempt (elastic retries), up to
# MOST_BACKOFF_SECONDS: retries.max_attempts goes to 100, and a 20th attempt's doubling would wait days.
RETRY_BACKOFF_SECONDS = 0.5
MOST_BACKOFF_SECONDS = 60.0
# How long a restarted group takes to reach its first quorum once started: a local process imports torch
# and starts its torchft manager; a pool's run waits for a worker, then for its container (ECS's template
# gives a task 600 s to start: a CUDA image's first pull on a fresh instance takes minutes).
LOCAL_START_SECONDS = 60.0
POOL_START_SECONDS = 600.0


def silent_seconds_limit() -> float:
    """How long a group may go without a heartbeat before it is taken for hung: TRAINYARD_SILENT_GROUP_SECONDS
    (120), never below the collectives' timeout (a group waiting on a dead peer is silent that long)."""
    return env_settings.seconds(SILENT_GROUP_SECONDS_ENV, SILENT_GROUP_SECONDS, PG_TIMEOUT.total_seconds() + 2)


def backoff_seconds(attempt: int, base: float = RETRY_BACKOFF_SECONDS) -> float:
    """The wait before restarting a group whose ``attempt`` failed: ``base`` doubled per attempt, up to
    ``MOST_BACKOFF_SECONDS`` (never under ``base`` itself)."""
    return max(base, min(base * 2**attempt, MOST_BACKOFF_SECONDS))


def quorum_timeout_seconds(silent_limit: float, work_pool: str) -> float:
    """How long a group waits in a quorum for the groups its step needs: over the longest a failed group can
    take to come back (found silent, its backoff, its start), so that a survivor outlasts a restart it is to
    heal. A group that cannot come back (its attempts spent) is the supervisor's to say, at once."""
    start = LOCAL_START_SECONDS if work_pool == "local" else POOL_START_SECONDS
    return silent_limit + MOST_BACKOFF_SECONDS + start
