"""The trace: what happened at every engine step, as plain data the notebooks can draw."""
from __future__ import annotations

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


class Trace:
    def __init__(self, num_slots: int, block_size: int, num_blocks: int):
        self.num_slots, self.block_size, self.num_blocks = num_slots, block_size, num_blocks
        self.steps: list[StepRecord] = []

    def append(self, record: StepRecord) -> None:
        self.steps.append(record)

    def __len__(self):
        return len(self.steps)

    def __getitem__(self, i):
        return self.steps[i]

    def to_dicts(self) -> list[dict]:
        return [asdict(s) for s in self.steps]

    def utilization(self) -> float:
        """Fraction of slot-steps that did work (prefill or decode)."""
        busy = sum(p is not None for s in self.steps for p in s.slot_phase)
        return busy / max(1, len(self.steps) * self.num_slots)

    def timeline(self, width: int | None = None) -> str:
        """A compact text picture: one row per slot, one column per step; a letter per request
        (upper case at its prefill), '.' when the slot is idle."""
        def mark(rid, phase):
            if rid is None:
                return "."
            ch = "abcdefghijklmnopqrstuvwxyz"[rid % 26]
            return ch.upper() if phase == "prefill" else ch
        steps = self.steps if width is None else self.steps[:width]
        rows = []
        for slot in range(self.num_slots):
            rows.append(f"slot {slot:2d} |" + "".join(mark(s.slot_request[slot], s.slot_phase[slot])
                                                       for s in steps) + "|")
        return "\n".join(rows)
