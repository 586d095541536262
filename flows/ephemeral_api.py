"""The ephemeral Prefect API a ``trainyard run`` process started for itself, stopped on the way out of a
signal (``trainyard/cli.py``): exiting on SIGTERM or Ctrl-C skips the hook that would stop it, and it would
outlive the job."""

from __future__ import annotations

import contextlib
import os
import signal
import time

_FLUSH_SECONDS = 10.0


def stop_ephemeral_api() -> None:
    """Stop the Prefect API this process started for itself, if it started one."""
    if os.environ.get("PREFECT_API_URL"):
        return
    # On the way out already: a second SIGTERM or Ctrl-C must not cut this short and leave the API running.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    try:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        # Send the job's last logs and events while the API still answers: left for the exit hook, they
        # would be retried against the stopped API for over a minute before the process could end.
        deadline = time.monotonic() + _FLUSH_SECONDS
        for service in (APILogWorker, EventsWorker):
            service.drain_all(timeout=max(0.0, deadline - time.monotonic()))
    except Exception:  # noqa: BLE001 - the signal is what to report; the API is stopped below regardless
        pass
    finally:
        with contextlib.suppress(Exception):
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().stop()  # the ephemeral API is the instance without a fixed port
