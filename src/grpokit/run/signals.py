"""Graceful stop on SIGINT/SIGTERM: the first signal asks the loop to finish its step and
save; a second one abandons the step at once (the last saved checkpoint stays intact)."""

from __future__ import annotations

import signal
import sys
import threading


class GracefulStop:
    """Context manager; `requested` turns True after the first SIGINT or SIGTERM."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, what: str = "the current step"):
        self.what = what
        self.requested = False
        self._previous: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            print(f"\ngrpokit: second {name}: abandoning {self.what}; the last saved checkpoint is intact",
                  file=sys.stderr, flush=True)
            raise KeyboardInterrupt
        self.requested = True
        print(f"\ngrpokit: {name} received: finishing {self.what}, then saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
