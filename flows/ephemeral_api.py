"""The ephemeral Prefect API a ``trainyard run`` process starts for itself (``trainyard/cli.py``), and its
stopping: on the way out of a signal (exiting on SIGTERM or Ctrl-C skips the hook that would stop it, and it
would outlive the job), and by a watchdog when the process is killed outright (SIGKILL, the OOM killer)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

_FLUSH_SECONDS = 10.0

# The watchdog: told by the kernel when the process that started it dies (PR_SET_PDEATHSIG), it stops the
# API server, if the process under that pid is still Prefect's server (not a pid reused since).
_WATCHDOG = """
import os, signal, sys, time
pid = int(sys.argv[1])
def stop(*_):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"prefect.server.api.server" in f.read():
                os.kill(pid, signal.SIGTERM)
    except OSError:
        pass
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(3600)
"""


def start_ephemeral_api() -> None:
    """Start this process's ephemeral Prefect API now (the flow then uses it), with a watchdog that stops it
    should this process be killed without stopping it: a SIGKILLed ``trainyard run`` left it running, a
    fifth of a core busy, for good. Linux only (elsewhere the API starts when the flow needs it, as before)."""
    if os.environ.get("PREFECT_API_URL") or not sys.platform.startswith("linux"):
        return
    from prefect.server.api.server import SubprocessASGIServer

    from trainyard.servers import die_with_parent

    server = SubprocessASGIServer()
    server.start()
    if server.server_process is not None:
        subprocess.Popen(  # noqa: S603 - this interpreter, our own script
            [sys.executable, "-c", _WATCHDOG, str(server.server_process.pid)],
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - only prctl, before exec
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the terminal is the job's to handle, not the watchdog's
        )


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
