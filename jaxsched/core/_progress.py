"""Progress that suits where it goes: a live bar on a terminal, a few plain lines in a log.

Why: a tqdm bar redraws with carriage returns; sent to a file or a CI log, a 300-step run
left 80 KB of redraws. When stderr is not a TTY, `progress` prints one line every
``every`` items (default: about ten lines per run) and a last line when done.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> for _ in progress(range(4), "demo", stream=out, every=2):
    ...     pass
    >>> print(out.getvalue(), end="")
    demo: 2/4
    demo: 4/4 done
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator, TextIO

__all__ = ["LineProgress", "note", "progress"]


class LineProgress:
    """A tqdm-like iterable that prints ``desc: i/total [postfix]`` every ``every`` items."""

    def __init__(self, iterable: Iterable, desc: str, total: int | None, every: int, stream: TextIO, unit: str = "it"):
        self.iterable, self.desc, self.total, self.every = iterable, desc, total, max(1, every)
        self.stream, self.unit = stream, unit
        self.postfix = ""
        self.count = 0
        self.started = time.perf_counter()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def _line(self, done: bool = False) -> str:
        total = f"/{self.total}" if self.total is not None else ""
        extra = f" [{self.postfix}]" if self.postfix else ""
        return f"{self.desc}: {self.count}{total}{' done' if done else ''}{extra}"

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.count += 1
            if self.count % self.every == 0 and self.count != self.total:
                print(self._line(), file=self.stream, flush=True)
        print(self._line(done=True), file=self.stream, flush=True)

    def close(self) -> None:
        """Nothing to clean up; present so callers can treat it like a tqdm bar."""


def progress(
    iterable: Iterable,
    desc: str,
    *,
    enabled: bool = True,
    total: int | None = None,
    every: int | None = None,
    stream: TextIO | None = None,
    unit: str = "it",
    leave: bool = True,
) -> Any:
    """A tqdm bar on a terminal; on anything else one line per ``every`` items; nothing
    at all when ``enabled`` is false."""
    stream = sys.stderr if stream is None else stream
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if not enabled:
        return _Silent(iterable)
    if hasattr(stream, "isatty") and stream.isatty():
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, file=stream)
    if every is None:
        every = max(1, (total or 100) // 10)
    return LineProgress(iterable, desc, total, every, stream, unit)


class _Silent:
    """Iterates and ignores progress calls."""

    def __init__(self, iterable: Iterable):
        self.iterable = iterable

    def __iter__(self) -> Iterator:
        return iter(self.iterable)

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def note(message: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
    """One line saying what starts now, for work that runs long before its first item ends
    (a compile for a TPU pod can take minutes)."""
    if enabled:
        print(message, file=sys.stderr if stream is None else stream, flush=True)
