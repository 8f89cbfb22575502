"""Ctrl-C that waits for the bookkeeping: sections a KeyboardInterrupt cannot cut in half.

Why: Python raises a pending KeyboardInterrupt at the next check after the signal arrives -- right
after any call returns (C methods such as `deque.popleft` included) and at every backward jump of
a loop. So no run of plain statements is atomic: an interrupt between `free_blocks.popleft()` and
`ref_count[b] = 1` loses a block for good, one between counting a token in flight and
recording its step loses a request's next token. A learner presses "interrupt the kernel" at any moment.

How: the engine's bookkeeping (allocate / free with reference counts, schedule, advance, settle,
finish / preempt, the trace record) runs inside `deferred()`. The outermost deferred section puts
in a SIGINT handler that only records the signal and, when the section ends, puts the previous
handler back and hands it the signal -- so a KeyboardInterrupt is raised as usual, just at the
section's end, with every count and list whole. The device work stays interruptible: inside a
deferred section, `interruptible()` opens a hole where a signal goes straight to the previous
handler, and a signal recorded before the hole is delivered on the way in.

    with deferred():                  # one handler swap (two signal.signal calls) per step
        batch = scheduler.schedule()  # a Ctrl-C here waits ...
        with interruptible():         # ... and is raised here, before the device work starts;
            tokens = runner.run(batch)    # a Ctrl-C here is raised at once
        scheduler.accept(batch, tokens)   # waits again, raised at the end of the block

    @atomic                           # the method is one deferred section (nested: no cost
    def free(self, blocks): ...       # beyond a flag test)

Cost: the outermost section swaps the handler twice (two system calls); nested sections and
holes only flip flags. So the engine opens one section per step, and the decorated methods inside
it cost a flag test each. Measured (a shared 2-core Xeon, under load): 1.4-2.1 us per outermost
section, 0.6-1.2 us per hole, 0.2-0.3 us per nested decorated call; an engine step whose device
work is nothing (only bookkeeping left to time) takes 4-9 us more than with no sections at all.

Limits, on purpose:
  * only the main thread: SIGINT is only ever raised there (other threads are never interrupted by
    it, and signal handlers can only be set from it). Elsewhere every section is a no-op.
  * a SIGINT handler that is not a Python function (ignored, the default action, or set from C) is
    left alone: there is no KeyboardInterrupt to defer.
  * a second Ctrl-C while the first one waits is delivered at once: the way out of a section that
    never ends (a learner's plugin stuck in a loop). That one may leave the bookkeeping half done.
  * the value a function returns is not covered once its section has ended: a Ctrl-C between
    `finished = engine.step()` returning and the assignment loses the list (Engine.step(into=...)
    appends to the caller's list inside the section instead).
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading

try:        # the C functions: signal.signal / getsignal wrap them in enum conversions that cost
    from _signal import getsignal as _getsignal, signal as _setsignal    # ~20x more (measured)
except ImportError:                                                      # not CPython
    _getsignal, _setsignal = signal.getsignal, signal.signal
_SIGINT = int(signal.SIGINT)


class _MainThreadSections:
    """The main thread's open sections: how many (`depth`), whether a SIGINT now waits
    (`deferring`: in a deferred section and not in a hole), the handler to hand signals to
    (`previous`), and whether a signal waits (`pending`).

    Every field is changed by plain assignments only, so an interrupt cannot land between two
    halves of an update; a section restores `depth` and `deferring` to what it found on entry,
    so an outer section's end repairs whatever an inner one left."""

    def __init__(self):
        self.depth = 0
        self.deferring = False
        self.previous = None
        self.pending = False


_state = _MainThreadSections()


def _on_sigint(signum, frame):
    """The handler while a section is open: record the first signal of a deferred part, deliver
    anything else (a signal in a hole, a second signal) to the previous handler at once."""
    s = _state
    if s.deferring and not s.pending:
        s.pending = True
        return
    s.pending = False
    if s.previous is not None:
        s.previous(signum, frame)
    else:
        raise KeyboardInterrupt


_main_ident = threading.main_thread().ident


def _forked() -> None:
    """A child forked from another thread has that thread as its main thread."""
    global _main_ident
    _main_ident = threading.get_ident()
    _state.__init__()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _install() -> None:
    """Put _on_sigint in place (the outermost section's entry), keeping the handler it replaces."""
    current = _getsignal(_SIGINT)
    if current is _on_sigint or not callable(current):
        return               # already ours (left by an interrupted exit), or nothing to defer
    _state.previous = current
    _setsignal(_SIGINT, _on_sigint)


def _uninstall() -> None:
    """Give the handler back (the outermost section's exit). A signal arriving meanwhile is
    recorded: `deferring` is still set."""
    if _getsignal(_SIGINT) is _on_sigint and _state.previous is not None:
        _setsignal(_SIGINT, _state.previous)


def _deliver() -> None:
    """The recorded signal, to the previous handler (Python's default raises KeyboardInterrupt)."""
    handler = _state.previous
    if handler is None:
        raise KeyboardInterrupt
    handler(_SIGINT, None)


class _Section:
    """One `with` block: deferring (deferred()) or not (interruptible()). Remembers the depth and
    the mode it found, and puts them back on exit."""
    __slots__ = ("defer", "depth", "was_deferring")

    def __init__(self, defer: bool):
        self.defer = defer
        self.depth = -1

    def __enter__(self):
        s = _state
        if not (self.defer or s.deferring) or threading.get_ident() != _main_ident:
            return self                             # depth -1: a no-op section
        depth, was = s.depth, s.deferring
        if was and not self.defer and s.pending:
            s.pending = False
            _deliver()                              # entering a hole: the waiting Ctrl-C, now
        if depth == 0:
            try:
                s.depth, s.deferring, s.pending = 1, True, False
                _install()
            except BaseException:                   # interrupted before the handler changed
                s.depth, s.deferring = depth, was
                raise
        else:
            s.depth, s.deferring = depth + 1, self.defer
        self.depth, self.was_deferring = depth, was
        return self

    def __exit__(self, exc_type, exc, tb):
        depth = self.depth
        if depth < 0:
            return False
        s = _state
        self.depth = -1
        deliver = False
        try:
            if depth == 0:
                _uninstall()
        finally:                                    # (plain assignments: nothing to interrupt)
            s.depth, s.deferring = depth, self.was_deferring
            if not s.deferring:                     # leaving for a hole or for outside
                deliver, s.pending = s.pending, False
        if deliver and (exc_type is None or not issubclass(exc_type, KeyboardInterrupt)):
            _deliver()                              # (else an interrupt is already on its way out)
        return False


def deferred() -> _Section:
    """A block that a Ctrl-C does not cut: a SIGINT arriving inside is raised at its end."""
    return _Section(True)


def interruptible() -> _Section:
    """A hole in the deferred block around it: a SIGINT is raised at once (one that waited is
    raised on the way in). Outside any deferred block it changes nothing."""
    return _Section(False)


def atomic(fn):
    """Decorator: every call of `fn` is a deferred section. Inside an open deferred part (the
    engine's step) it is a flag test; off the main thread it changes nothing."""
    @functools.wraps(fn)
    def section(*args, **kwargs):
        if _state.deferring:
            return fn(*args, **kwargs)
        with _Section(True):
            return fn(*args, **kwargs)
    return section


@contextlib.contextmanager
def sigint_ignored():
    """Start child processes in this block: they begin with SIGINT ignored. A Ctrl-C in a terminal
    reaches the whole process group, and a spawned child takes a second or more to import torch
    and pagedlab before core_main can ignore it, so a Ctrl-C then printed a KeyboardInterrupt
    traceback from the child's imports (Ctrl-C is the parent's to handle: it stops the child). An
    ignored signal stays ignored across the exec of a spawned child, and Python leaves it so."""
    if threading.current_thread() is not threading.main_thread():
        yield                           # (signal handlers are set from the main thread only)
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
