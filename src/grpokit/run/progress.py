"""Progress of long work: a tqdm bar on a terminal; in a log file (stderr not a terminal), where
a bar would repeat itself on every refresh, one plain line every tenth of the work or every
minute, whichever comes first, and one at the end."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from tqdm.auto import tqdm

LOG_FRACTION = 0.1  # a line per tenth of the work...
LOG_SECONDS = 60.0  # ...or per minute, so a slow step still shows the run is alive


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             initial: int = 0, enabled: bool = True, stream=None):
    """A tqdm-like progress reporter (update, set_postfix, close, iteration, `with`)."""
    stream = stream or sys.stderr
    total = len(iterable) if total is None and iterable is not None and hasattr(iterable, "__len__") else total
    if not enabled or not _is_terminal(stream):
        return LogLines(iterable, total=total, desc=desc, unit=unit, initial=initial, enabled=enabled, stream=stream)
    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True, file=stream)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or wrapped stream
        return False


class LogLines:
    """Progress as occasional whole lines, for logs; silent when not `enabled`."""

    def __init__(self, iterable=None, *, total: int | None, desc: str, unit: str, initial: int = 0,
                 enabled: bool = True, stream=None):
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n, self.start, self.enabled, self.stream = initial, initial, enabled, stream or sys.stderr
        self.every = max(1, round((total or 0) * LOG_FRACTION))
        self.next_mark = initial + self.every
        self.started = self.last_line = time.monotonic()
        self.postfix = ""
        self.closed = False
        self.last_line_n: int | None = None

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.n >= self.next_mark or now - self.last_line >= LOG_SECONDS:
            self._line(now)
            while self.next_mark <= self.n:
                self.next_mark += self.every

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def close(self) -> None:
        if not self.closed and self.n > self.start and self.last_line_n != self.n:
            self._line(time.monotonic())
        self.closed = True

    def _line(self, now: float) -> None:
        self.last_line, self.last_line_n = now, self.n
        if not self.enabled:
            return
        elapsed = now - self.started
        done = self.n - self.start
        count = f"{self.n}/{self.total}" if self.total else str(self.n)
        units = self.unit + ("es" if self.unit.endswith(("s", "x", "ch", "sh")) else "s")
        parts = [f"{self.desc}: {count} {units}" if self.desc else f"{count} {units}"]
        if self.total:
            parts[0] += f" ({self.n / self.total:.0%})"
        parts.append(f"{elapsed:.0f}s elapsed")
        if self.total and 0 < done and self.n < self.total:
            parts.append(f"~{elapsed / done * (self.total - self.n):.0f}s left")
        if self.postfix:
            parts.append(self.postfix)
        print(", ".join(parts), file=self.stream, flush=True)
