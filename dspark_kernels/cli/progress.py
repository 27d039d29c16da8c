"""Layer progress of ``dspark prefill`` on stderr: a tqdm bar on a terminal, plain lines in logs, or nothing."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

#: Off a terminal, a prefill call prints progress lines only once it has run this long (quick runs stay quiet).
PROGRESS_DELAY_S = 2.0
#: Off a terminal, at most this many progress lines per call (one per layer for models of up to 10 layers).
PROGRESS_LINES = 10


class LayerProgress:
    """``on_layer(done, total)`` of one prefill call, on stderr.

    mode 'bar': a tqdm bar (a terminal, or ``--progress``); 'lines': plain lines without carriage returns (one
    per layer, at most :data:`PROGRESS_LINES` per call) once the call has run :data:`PROGRESS_DELAY_S`, so logs
    of long runs show progress; 'off': nothing. Use as a context manager (the bar is closed however the call
    ends); it pickles without its bar, so a rank process can report its layers too.
    """

    def __init__(self, label: str, mode: str, total: int):
        self.label, self.mode, self.total = label, mode, total
        self.t0 = time.perf_counter()
        self._bar: Any = None
        self._printed = 0

    def __enter__(self) -> LayerProgress:
        self.t0 = time.perf_counter()
        if self.mode == "bar":
            self._open_bar()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_bar": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.t0 = time.perf_counter()

    def _open_bar(self) -> None:
        # follow the terminal's size; 80 x 24 where it reports 0 x 0 (a bare pty), which tqdm would draw as blanks
        sized = _terminal_has_size()
        self._bar = tqdm(total=self.total, desc=self.label, unit="layer", file=sys.stderr, leave=True,
                         dynamic_ncols=sized, ncols=None if sized else 80, nrows=None if sized else 24)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.mode == "bar":
            if self._bar is None:
                self._open_bar()
            self._bar.total = total
            self._bar.update(done - self._bar.n)
            if done >= total:
                self.close()
        elif self.mode == "lines":
            elapsed = time.perf_counter() - self.t0
            step = PROGRESS_LINES * done // total
            if elapsed < PROGRESS_DELAY_S or (step <= self._printed and done < total):
                return
            self._printed = step
            print(tqdm.format_meter(done, total, elapsed, prefix=self.label,
                                    bar_format="{desc}: layer {n_fmt}/{total_fmt} ({percentage:.0f}%) "
                                               "[{elapsed}<{remaining}]"), file=sys.stderr, flush=True)


def _terminal_has_size() -> bool:
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # not a real terminal (io.UnsupportedOperation is an OSError)
        return False
    return size.columns > 0 and size.lines > 0


def progress_mode(args: argparse.Namespace) -> str:
    if args.progress is False:
        return "off"
    return "bar" if args.progress or sys.stderr.isatty() else "lines"


class ContextProgress:
    """The context fill of a run, every chunk of every request in order, as one progress display: one bar (or one
    stream of lines) over all chunks, so the bar runs on from chunk to chunk with one overall ETA instead of
    restarting for every chunk. A chunk's share is its tokens x layers (the cost grows with both).

    ``chunks``: (request id, tokens) of every context call in order; ``chunk(i)`` is the ``on_layer`` of call i.
    Modes as :class:`LayerProgress`; off a terminal at most ``max(PROGRESS_LINES, chunks)`` lines, once the fill
    has run :data:`PROGRESS_DELAY_S`.
    """

    def __init__(self, mode: str, chunks: list[tuple[int, int]], layers: int):
        self.mode, self.chunks, self.layers = mode, chunks, layers
        self.before = [0]
        for _, tokens in chunks:
            self.before.append(self.before[-1] + max(tokens, 1) * layers)
        self.total = self.before[-1]
        self.per_request = {rid: sum(r == rid for r, _ in chunks) for rid, _ in chunks}
        self.t0 = time.perf_counter()
        self._bar: Any = None
        self._printed = 0

    def __enter__(self) -> ContextProgress:
        self.t0 = time.perf_counter()
        if self.mode == "bar" and self.total:
            sized = _terminal_has_size()
            self._bar = tqdm(total=self.total, desc="context", file=sys.stderr, leave=True, dynamic_ncols=sized,
                             ncols=None if sized else 80, nrows=None if sized else 24,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def label(self, i: int) -> str:
        """'context rR' or, for a request filled in several chunks, 'context rR chunk k/K'."""
        rid = self.chunks[i][0]
        if self.per_request[rid] == 1:
            return f"context r{rid}"
        k = sum(r == rid for r, _ in self.chunks[:i]) + 1
        return f"context r{rid} chunk {k}/{self.per_request[rid]}"

    def chunk(self, i: int) -> Callable[[int, int], None]:
        """``on_layer(done, total)`` of context call ``i``."""
        tokens = max(self.chunks[i][1], 1)

        def on_layer(done: int, total: int) -> None:
            units = self.before[i] + tokens * self.layers * done // max(total, 1)
            if self.mode == "bar" and self._bar is not None:
                self._bar.set_description_str(f"{self.label(i)} layer {done}/{total}", refresh=False)
                self._bar.update(units - self._bar.n)
            elif self.mode == "lines":
                elapsed = time.perf_counter() - self.t0
                lines = max(PROGRESS_LINES, len(self.chunks))
                step = lines * units // self.total
                if elapsed < PROGRESS_DELAY_S or (step <= self._printed and units < self.total):
                    return
                self._printed = step
                meter = tqdm.format_meter(units, self.total, elapsed, bar_format="overall {percentage:.0f}% "
                                          "[{elapsed}<{remaining}]")
                print(f"{self.label(i)}: layer {done}/{total}, {meter}", file=sys.stderr, flush=True)

        return on_layer
