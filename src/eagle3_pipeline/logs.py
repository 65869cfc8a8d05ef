"""Logging for rule scripts: everything (including warnings and tracebacks) lands in the rule's log."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

_job_handlers: list[logging.Handler] = []  # what setup() gave the root logger: reattach() restores them
_replaced_streams: list = []  # kept, never closed: their descriptors may belong to someone else by now


class ClearError(Exception):
    """An expected failure whose message names the cause and the fix: logged as one line, no traceback."""


def setup(log_path: str | Path | None, name: str = "eagle3", append: bool = False,
          history: Path | None = None) -> logging.Logger:
    """Log to the Snakemake `log:` file and to stderr; route Python warnings there too.
    `append` is for worker processes writing into their parent's log. `history` is a second file, appended
    to across attempts: Snakemake deletes the log of a job it reruns, so a job that resumes after a kill
    keeps the killed attempt's lines only there (next to the state it resumes from)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        handlers.append(logging.FileHandler(log_path, mode="a" if append else "w", encoding="utf-8"))
    if history:
        history.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(history, mode="a", encoding="utf-8"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    _job_handlers[:] = handlers
    logging.captureWarnings(True)
    logger = logging.getLogger(name)
    if not append and (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        logger.info("GPUs visible to this job: CUDA_VISIBLE_DEVICES=%s", visible)  # e.g. gpu_claims' choice

    def log_uncaught(kind, value, traceback):  # the traceback belongs in the job's log, not only on the console
        if issubclass(kind, ClearError):  # its message names the cause and the fix; a traceback adds noise
            logger.critical("%s", value)
            return
        logger.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, traceback))

    sys.excepthook = log_uncaught
    return logger


def reattach() -> None:
    """Give the root logger back the handlers setup() gave it, its files reopened for appending. A library that
    takes over logging or file descriptors while it starts (vLLM's engine: a regenerate job's log file kept only
    its first line on an H100) would otherwise leave the rule's `log:` without the rest of the job."""
    root = logging.getLogger()
    for handler in _job_handlers:
        if isinstance(handler, logging.FileHandler):
            handler.acquire()
            try:  # a fresh stream: the old one's descriptor may have been closed or reused (closing it could
                # close someone else's file)
                _replaced_streams.append(handler.stream)
                handler.mode = "a"
                handler.stream = handler._open()
            finally:
                handler.release()
        if handler not in root.handlers:
            root.addHandler(handler)


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Periodic 'done/total, tokens/s, ETA' lines for long loops; cheap to call every iteration."""

    def __init__(self, log: logging.Logger, what: str, total_items: int, total_tokens: int | None = None,
                 every_seconds: float = 10.0):
        self.log, self.what = log, what
        self.total_items, self.total_tokens = total_items, total_tokens
        self.every = every_seconds
        self.items = self.tokens = 0
        self.start = self.last = time.perf_counter()

    def update(self, items: int, tokens: int = 0, force: bool = False) -> None:
        self.items += items
        self.tokens += tokens
        now = time.perf_counter()
        if force or now - self.last >= self.every:
            self.last = now
            self.log.info(self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.perf_counter()) - self.start, 1e-9)
        rate = self.tokens / elapsed
        if self.total_tokens and self.tokens:
            fraction = self.tokens / self.total_tokens
        else:
            fraction = self.items / max(self.total_items, 1)
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("nan")
        eta_text = format_seconds(eta) if eta == eta else "?"
        return (f"{self.what}: {self.items}/{self.total_items} ({100 * fraction:.1f}%), "
                f"{self.tokens} tokens, {rate:,.0f} tokens/s, elapsed {format_seconds(elapsed)}, ETA {eta_text}")

    def finish(self) -> float:
        elapsed = time.perf_counter() - self.start
        self.log.info(self.line() + " - done")
        return elapsed
