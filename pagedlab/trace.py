"""The trace: what happened at every engine step (the last 10,000 by default), as plain data the
notebooks can draw."""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    step: int
    start_s: float                          # seconds since the trace began
    duration_s: float
    slot_request: list                      # per slot: request id or None
    slot_phase: list                        # per slot: "prefill", "decode" or None (idle)
    block_table: list                       # per slot: list of physical blocks
    pool_used: int
    pool_total: int
    queue: list                             # waiting request ids, front first
    emitted: dict                           # request id -> token id produced this step
    num_tokens: int                         # tokens the model processed this step
    finished: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    # prefix caching (prefix_cache.py)
    block_refs: dict = field(default_factory=dict)    # physical block -> holders, for blocks held by > 1
    cached_tokens: list = field(default_factory=list)  # per slot: prompt tokens its request found cached
    pool_cached: int = 0                    # blocks nobody holds that keep a cached prefix
    prefix_hits: int = 0                    # tokens found in the prefix cache so far (all admissions)
    prefix_queries: int = 0                 # tokens looked up so far
    # speculative decoding (spec/): request id -> (its guesses this step, how many were kept)
    spec: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits / lookups, in tokens, over every admission up to this step."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class Trace:
    """The engine's steps as StepRecords, oldest first -- a ring of the last `max_steps` steps.

    A step record takes a few KB, so an engine that runs for days would otherwise grow without
    bound: by default only the last 10,000 steps are kept (max_steps=None keeps every step). When
    the ring is full each new step pushes the oldest out; `num_dropped` counts them, and
    `next_step` is the absolute number of the next step (every step ever appended), which is what
    StepRecord.step should be -- so step numbers keep counting across the drops, and
    trace[0].step == trace.num_dropped when every record was numbered by next_step.

    `steps` is a list (a fresh copy, oldest first), `trace[i]` takes an int or a slice, `len(trace)`
    is the number of steps kept, and iterating goes oldest first. utilization(), timeline() and
    to_dicts() describe the kept steps only.
    """
    DEFAULT_MAX_STEPS = 10_000

    def __init__(self, num_slots: int, block_size: int, num_blocks: int,
                 max_steps: int | None = DEFAULT_MAX_STEPS):
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                      or max_steps < 1):
            raise ValueError(f"Trace: max_steps must be an integer >= 1 or None (unbounded), got {max_steps!r}")
        self.num_slots, self.block_size, self.num_blocks = num_slots, block_size, num_blocks
        self.max_steps = max_steps
        self._steps: deque[StepRecord] = deque(maxlen=max_steps)
        self._appended = 0

    def append(self, record: StepRecord) -> None:
        self._steps.append(record)
        self._appended += 1

    @property
    def steps(self) -> list[StepRecord]:
        """The kept steps, oldest first (a new list: appending to it does not touch the trace)."""
        return list(self._steps)

    @property
    def next_step(self) -> int:
        """How many steps were ever appended: the absolute number of the next step."""
        return self._appended

    @property
    def num_dropped(self) -> int:
        """How many old steps fell off the ring."""
        return self._appended - len(self._steps)

    def __len__(self):
        return len(self._steps)

    def __iter__(self):
        return iter(self._steps)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self._steps)[i]
        return self._steps[i]

    def to_dicts(self) -> list[dict]:
        return [asdict(s) for s in self._steps]

    def utilization(self) -> float:
        """Fraction of slot-steps that did work (prefill or decode)."""
        busy = sum(p is not None for s in self._steps for p in s.slot_phase)
        return busy / max(1, len(self._steps) * self.num_slots)

    def timeline(self, width: int | None = None) -> str:
        """A compact text picture: one row per slot, one column per step; a letter per request
        (upper case at its prefill), '.' when the slot is idle."""
        def mark(rid, phase):
            if rid is None:
                return "."
            ch = "abcdefghijklmnopqrstuvwxyz"[rid % 26]
            return ch.upper() if phase == "prefill" else ch
        steps = list(self._steps) if width is None else list(self._steps)[:width]
        rows = []
        for slot in range(self.num_slots):
            rows.append(f"slot {slot:2d} |" + "".join(mark(s.slot_request[slot], s.slot_phase[slot])
                                                       for s in steps) + "|")
        return "\n".join(rows)
