"""The job home's shared file helpers (``trainyard.home``)."""

from __future__ import annotations

import json
import threading

from trainyard.home import write_json_atomic


def test_json_written_from_several_threads_at_once_is_always_whole(tmp_path):
    # stop.json: the supervisor (max runtime), the carbon watch (the budget) and the stop tag's watcher can write it
    # at the same moment in one process; one temporary name per process made a writer's rename fail
    path, errors = tmp_path / "stop.json", []

    def writer(n: int) -> None:
        try:
            for i in range(300):
                write_json_atomic(path, {"writer": n, "i": i, "pad": "x" * (n * 500)})
        except OSError as exc:  # (FileNotFoundError: another thread's rename took the shared temporary file)
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    last = json.loads(path.read_text())
    assert last["pad"] == "x" * (last["writer"] * 500)
    assert [p.name for p in tmp_path.iterdir()] == ["stop.json"]  # no temporary file left behind
