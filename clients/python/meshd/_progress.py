"""Progress of bulk transfers: a tqdm bar on a terminal, or a callback.

Every call that moves tensor bytes (`meshd.tensor`, `fetch_shard`/`inspect`, URL
loads) takes `progress=`:

  None      (default) a tqdm bar on stderr when the transfer is at least THRESHOLD
            bytes, stderr is a terminal and tqdm (Debian python3-tqdm) is installed;
            otherwise nothing.
  False     never anything.
  True      a tqdm bar whatever the size and even when stderr is not a terminal
            (a warning, once, when tqdm is missing).
  callable  progress(done_bytes, total_bytes), whatever the size, for GUIs and
            notebooks: done grows and never repeats, calls are at least
            CALLBACK_INTERVAL seconds apart, and exactly one last call has done ==
            total, after the transfer succeeded (none after a failure). It runs on
            the thread that moves the bytes (a fetch's is not the caller's), one call
            at a time, and must not call meshd (an upload holds the session's
            lock). An exception it raises aborts the transfer and is raised
            where the transfer's failure would be (the call, or the Future's result).

For code that moves bytes (tensor.py, load.py):

    with _progress.tracker(total_bytes, progress, "upload") as tr:
        for chunk in ...:
            send(chunk)
            tr.update(len(chunk))   # bytes moved since the last update
    # (or tr.set(done): bytes moved so far, e.g. polled from the agents of a load;
    #  tr.note(text): a remark after the bar, "" clears it, a callback is not told;
    #  tr.again(): the transfer starts over (a retry, the proxy after a direct
    #  attempt): counted from 0 again, shown on the same bar once past its mark)

Leaving the block normally completes it (bar to total, the callback's done == total);
leaving it by an exception closes the bar where it stood and calls nothing more.
`tr.close(ok)` does the same outside a `with`; it is idempotent. check(progress)
raises TypeError for anything else than the four kinds above: call it before
starting the transfer."""

import sys
import time
import warnings
from collections.abc import Callable
from typing import Union

try:
    import tqdm as _tqdm
except ImportError:  # the automatic bar is then off; callbacks still work
    _tqdm = None

# What progress= takes (module doc): None, a bool, or a callable(done_bytes, total_bytes).
Progress = Union[bool, Callable[[int, int], object], None]

THRESHOLD = 64 << 20  # bytes: smaller transfers show no automatic bar
CALLBACK_INTERVAL = 0.1  # seconds between two calls of a progress callback
_warned = False


def check(progress: Progress) -> Progress:
    """progress= itself if it is None, a bool or a callable; TypeError otherwise."""
    if progress is None or isinstance(progress, bool) or callable(progress):
        return progress
    raise TypeError("meshd: progress= takes None, True, False or a callable(done_bytes, "
                    f"total_bytes), got {type(progress).__name__}")


def _stderr_is_tty():
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _bar(total, desc):
    global _warned
    if _tqdm is None:
        if not _warned:
            _warned = True
            warnings.warn("meshd: progress=True needs tqdm (Debian python3-tqdm); no bar shown",
                          stacklevel=4)
        return None
    return _tqdm.tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                      file=sys.stderr, leave=True, dynamic_ncols=True)


class _Tracker:
    """One transfer's progress; see the module docstring."""

    def __init__(self, total, progress, desc):
        self.total, self.done = int(total), 0
        self._moved = 0  # update()'s bytes in this attempt (again())
        self._cb = progress if callable(progress) and not isinstance(progress, bool) else None
        self._bar = None
        self._closed = False
        self._last_cb = time.monotonic()
        self._cb_done = 0  # done at the callback's last call
        self._note = ""
        if progress is True or (progress is None and _tqdm is not None
                                and self.total >= THRESHOLD and _stderr_is_tty()):
            self._bar = _bar(self.total, desc)

    @property
    def active(self):
        """Whether anything shows this transfer (a bar or a callback)."""
        return self._bar is not None or self._cb is not None

    def update(self, n):
        """n more bytes moved (in this attempt: see again())."""
        self._moved += n
        self.set(self._moved)

    def again(self):
        """The transfer starts over (an upload planned again, a direct transfer the
        proxy takes over): what it moves from now on counts from 0 (update(), or set()
        with this attempt's bytes) and shows only once past what was shown already, on
        the same bar: the bar and the callback never go back, nor start a second time."""
        self._moved = 0

    def set(self, done):
        """done bytes moved so far (clamped to [previous, total])."""
        if self._closed:
            return
        done = min(max(int(done), self.done), self.total)
        if self._bar is not None and done > self.done:
            self._bar.update(done - self.done)
        self.done = done
        if self._cb is not None and self._cb_done < done < self.total:
            now = time.monotonic()
            if now - self._last_cb >= CALLBACK_INTERVAL:
                self._last_cb, self._cb_done = now, done
                self._cb(done, self.total)

    def note(self, text):
        """A short remark shown after the bar (e.g. which ranks did not answer), or "" to
        clear it; a callback is not told."""
        text = str(text)
        if self._closed or text == self._note:
            return
        self._note = text
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def close(self, ok=False):
        """Ends the transfer: ok completes it (bar and callback at total); otherwise the
        bar stops where it is and the callback is not called again."""
        if self._closed:
            return
        self._closed = True
        try:
            if ok:
                if self._bar is not None and self._note:
                    self._bar.set_postfix_str("")  # complete: nothing is missing any more
                if self._bar is not None and self.done < self.total:
                    self._bar.update(self.total - self.done)
                self.done = self.total
                if self._cb is not None:
                    self._cb(self.total, self.total)
        finally:
            if self._bar is not None:
                self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(ok=exc_type is None)
        return False


def tracker(total_bytes, progress=None, desc=None):
    """A _Tracker for a transfer of total_bytes; progress as in the module docstring
    (checked: TypeError). A context manager."""
    return _Tracker(total_bytes, check(progress), desc)
