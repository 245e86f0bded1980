"""The driver's view of a running job: a progress board rank 0 posts to, the driver's poll of it, and the signals
that ask the run to checkpoint and stop."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Callable


def progress_board():
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the driver's node, like Ray Train's controller: losing another node must not take the board with it.
    @ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False))
    class ProgressBoard:
        """Rank 0 posts each step here without waiting; the driver polls it for the progress bar. The latest
        start row is kept apart from the latest row, so a short run's (re)start is not lost between polls."""

        def __init__(self):
            self.start: dict[str, Any] = {}
            self.latest: dict[str, Any] = {}
            self.summary: dict[str, Any] = {}
            self.stop_reason: str | None = None

        def request_stop(self, reason: str) -> None:
            self.stop_reason = reason

        def stop_requested(self) -> str | None:
            return self.stop_reason

        def update(self, row: dict[str, Any]) -> None:
            if row.get("event") == "start":
                self.start = row
            self.latest = row

        def finish(self, summary: dict[str, Any]) -> None:
            self.summary = summary

        def get(self) -> list[dict[str, Any]]:
            """The latest start row, then the latest row if a step followed it."""
            rows = [self.start] if self.start else []
            if self.latest and self.latest is not self.start:
                rows.append(self.latest)
            return rows

        def get_summary(self) -> dict[str, Any]:
            return self.summary

    return ProgressBoard.remote()


@contextlib.contextmanager
def following(board, on_update: Callable[[dict], None] | None):
    """Hand the board's rows to `on_update` every half second while the block runs, and once more at its end so
    the last rows (the final step, a stop) are not lost between polls."""
    stop = threading.Event()
    poller = threading.Thread(target=poll, args=(board, on_update or (lambda _: None), stop), daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join(timeout=2)
    if on_update is not None:
        import ray

        for row in ray.get(board.get.remote()):
            on_update(row)


def poll(board, on_update: Callable[[dict], None], stop: threading.Event) -> None:
    import ray

    while not stop.wait(0.5):
        try:
            for row in ray.get(board.get.remote(), timeout=5):
                on_update(row)
        except Exception:  # noqa: BLE001 - progress is best effort; the run's outcome comes from fit()
            pass


@contextlib.contextmanager
def stop_on_signals(board):
    """First SIGTERM/SIGINT: checkpoint at the next step boundary and stop. A second one: stop now."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[str] = []

    def handler(signum, _frame):
        if received:
            raise KeyboardInterrupt
        received.append(signal.Signals(signum).name)
        board.request_stop.remote(received[0])
        print(f"{received[0]}: saving a checkpoint at the next step boundary, then stopping "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old_handler in previous.items():
            signal.signal(sig, old_handler)
