"""What lq shows while a long step runs: calibration batches, ``auto``'s search, the export's stages, the speed
check and the fallback's tries, so a user can tell a slow step from a hang.

Steps report to the current :class:`Reporter` (a context variable: nested calls and threads each see their own).
Plain use draws a transient ``rich`` display on stderr when stderr is a terminal, and nothing when it is not,
when the environment says ``LQ_PROGRESS=0``, inside ``with lq.progress.off():`` or for a call given
``progress=False``. The callback reports through Lightning's progress bar instead (:func:`lightning_reporter`).
Every step's seconds are measured whatever is drawn (:class:`Step`; ``ExportResult.stage_seconds``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from typing import Any, Iterator

__all__ = ["Reporter", "Recorder", "Step", "step", "off", "using", "reporter", "lightning_reporter"]


class Reporter:
    """Receives steps; this base draws nothing (what ``off()`` uses)."""

    def open(self, description: str, total: int | None) -> Any:
        """A step begins; returns a handle for :meth:`advance` and :meth:`close`."""
        return None

    def advance(self, handle: Any, n: int = 1, description: str | None = None) -> None:
        """``n`` more units of the step are done (``description``: what it does now)."""

    def close(self, handle: Any) -> None:
        """The step ended (done or not)."""


class Recorder(Reporter):
    """Keeps every event as ``(kind, description, value)``: for tests, and for a caller that draws its own."""

    def __init__(self):
        self.events: list[tuple[str, str, Any]] = []

    def open(self, description, total):
        self.events.append(("open", description, total))
        return description

    def advance(self, handle, n=1, description=None):
        self.events.append(("advance", description or handle, n))

    def close(self, handle):
        self.events.append(("close", handle, None))

    def opened(self) -> list[str]:
        return [d for kind, d, _ in self.events if kind == "open"]


class RichReporter(Reporter):
    """A transient rich display on stderr, live while at least one step is open."""

    def __init__(self):
        self._lock = threading.Lock()
        self._progress = None
        self._open = 0

    def open(self, description, total):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
            TimeElapsedColumn

        with self._lock:
            if self._progress is None:
                self._progress = Progress(SpinnerColumn(), TextColumn("[progress.description]{task.description}"),
                                          BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                          console=Console(stderr=True), transient=True)
                self._progress.start()
            self._open += 1
            return self._progress.add_task(description, total=total)

    def advance(self, handle, n=1, description=None):
        if self._progress is not None:
            self._progress.update(handle, advance=n, **({"description": description} if description else {}))

    def close(self, handle):
        with self._lock:
            if self._progress is None:
                return
            self._open -= 1
            if self._open == 0:  # the last one is drawn once more as it ends, then the display goes
                self._progress.stop()
                self._progress = None
            else:
                self._progress.remove_task(handle)


class _TqdmReporter(Reporter):
    """Lightning's tqdm bar class, a bar per step that goes when it ends (``leave=False``)."""

    def open(self, description, total):
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

        return Tqdm(total=total, desc=description, leave=False, dynamic_ncols=True)

    def advance(self, handle, n=1, description=None):
        if description:
            handle.set_description(description, refresh=False)
        handle.update(n)

    def close(self, handle):
        handle.close()


_SILENT = Reporter()
_current: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("lq_progress", default=None)
_default: list[RichReporter] = []


def _wanted() -> bool:
    if os.environ.get("LQ_PROGRESS", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    stream = sys.stderr
    return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())


def reporter() -> Reporter:
    """The reporter steps go to now: the one set by :func:`using`, else rich on a terminal, else none."""
    r = _current.get()
    if r is not None:
        return r
    if not _wanted():
        return _SILENT
    if not _default:
        _default.append(RichReporter())
    return _default[0]


@contextlib.contextmanager
def using(r: Reporter) -> Iterator[Reporter]:
    """Steps inside go to ``r`` (restored on the way out, also on an error)."""
    token = _current.set(r)
    try:
        yield r
    finally:
        _current.reset(token)


def off():
    """Nothing is drawn for the steps inside."""
    return using(_SILENT)


def choose(progress) -> contextlib.AbstractContextManager:
    """The context for a call's ``progress`` argument: None leaves the current reporter, False turns it off, a
    :class:`Reporter` is used."""
    if progress is None or progress is True:
        return contextlib.nullcontext()
    if progress is False:
        return off()
    if isinstance(progress, Reporter):
        return using(progress)
    raise TypeError(f"progress must be None, True, False or an lq.progress.Reporter, got {type(progress).__name__}")


class Step:
    """One step: :meth:`advance` as it goes; ``seconds`` once it ended."""

    def __init__(self, r: Reporter, description: str, total: int | None):
        self._r = r
        self._t0 = time.perf_counter()
        self.seconds = 0.0
        self._handle = r.open(description, total)

    def advance(self, n: int = 1, description: str | None = None) -> None:
        self._r.advance(self._handle, n, description)

    def _close(self) -> None:
        self.seconds = time.perf_counter() - self._t0
        self._r.close(self._handle)


@contextlib.contextmanager
def step(description: str, total: int | None = None) -> Iterator[Step]:
    """A step of ``total`` units (None: unknown) shown while the block runs; closed also on an error."""
    s = Step(reporter(), description, total)
    try:
        yield s
    finally:
        s._close()


def lightning_reporter(trainer) -> Reporter | None:
    """The reporter that draws like ``trainer``'s progress bar (rich or tqdm), on rank zero; None when the trainer
    shows no bar."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is None or not trainer.is_global_zero or getattr(bar, "is_disabled", False):
        return None
    from lightning.pytorch.callbacks import RichProgressBar

    return RichReporter() if isinstance(bar, RichProgressBar) else _TqdmReporter()
