"""Does guessing pay for the whole batch? The speculator's switch between verify steps and plain ones.

AdaptiveK (accept.py) decides per request, but what a verify step costs is paid by the whole
batch: a step where anyone guesses cannot run a step ahead (engine.py's overlap loop: the host
waits for it), and it carries k + 1 rows per guessing sequence. With 16 requests of free-running
text, some request is nearly always trying its luck, so the batch nearly never overlaps, while
the guesses kept add a few percent of tokens. The gate weighs the two for the batch:

    gain  = tokens a verify step emits per sequence in it  (1 + kept guesses / sequences; a running mean)
    cost  = seconds of a verify step / seconds of a plain step run ahead, at that batch size
            (Speculator.batch_cost: measured on the fly, from plan to plan, per batch size)

While gain >= cost the gate stays open (each request's AdaptiveK still chooses its k). When the
gain falls below the cost (after at least `min_steps` verify steps) it closes: the next `wait`
steps are plain ones -- no proposals, no verify rows, nobody to wait for, so the overlap loop runs
ahead as without speculation. Then it opens again for a probe. A probe that ends in fewer than
`paid_run` verify steps doubles the next wait (up to `max_pause`: text where guessing does not pay
stops paying for the probes too); after a long paying run the waits start short again. A step
that prefills someone (a new request may be one to copy) brings the next probe within `pause`
steps; a step with nobody decoding (the engine ran dry) starts afresh, open. Where the cost at a
batch size is not known yet (no plain step run ahead near it), the gate closes for
`calibrate_steps` steps to measure it; at a size where only other sizes were measured, the ratio
measured at the nearest one stands in.

What a switch costs (session 14, measured on the H200: docs/speculative.md). Each open phase costs
more than its verify steps: the plain step before it is read before anyone can guess (a proposal
starts from the last token) and the step after it starts with nothing in flight. So the phases
are kept short where they do not pay:
- a batch's first phase starts at `cost + start_margin` (not the optimistic `start_gain`, which one
  stream keeps: a copy often starts after a few words of its own), so that text without copies
  closes after `min_steps` verify steps rather than after the optimistic start has worn off;
- a probe is judged after `probe_steps` verify steps (its own measure, not a running mean); one
  that pays stays open and is judged by the running mean from then on.
`gain` itself is what the step emits per sequence -- of the sequences the batch waits for: when
no request waits for a slot (nothing would take a finished one's place), the batch lasts as long
as its longest request, and guesses kept by requests that will finish early anyway do not shorten
it; Speculator.settle then passes the kept guesses of the share `laggards` of the batch with the
most tokens still to go (0 or 1: every sequence, session 13's rule).

With a shadow (shadow.py, session 15: n-gram lookup, whose fate the plain steps' tokens tell) the
gate needs no probes and no first phase to learn: `shadow_step` opens it when the gain the
replayed lookups found (the same sequences' share) reaches cost + `open_margin`, and closes it when
that gain falls below the cost. A fresh batch starts closed: guessing starts where the tokens show
it pays, not on hope.
"""
from __future__ import annotations


class BatchGate:
    def __init__(self, min_steps: int = 3, pause: int = 16, max_pause: int = 256, paid_run: int = 8,
                 weight: float = 0.3, calibrate_steps: int = 4, start_gain: float = 3.0,
                 start_margin: float = 0.5, probe_steps: int = 1, laggards: float = 0.75,
                 open_margin: float = 0.3, default_cost: float = 1.7):
        self.min_steps, self.pause, self.max_pause, self.paid_run = min_steps, pause, max_pause, paid_run
        self.weight, self.calibrate_steps, self.start_gain = weight, calibrate_steps, start_gain
        self.start_margin, self.probe_steps, self.laggards = start_margin, probe_steps, laggards
        self.open_margin, self.default_cost = open_margin, default_cost     # (with a shadow)
        self.num_opens = 0
        self.num_closes = self.num_plain_steps = self.num_probes = 0     # what it did (bench, tests)
        self.reset()

    def reset(self) -> None:
        """Open, no history (the engine ran dry: whatever comes next is new). The gain starts
        optimistic, as each request's does (a copy often starts after a few words of its own)."""
        self.open = True
        self.wait = 0             # closed: plain steps left before the next probe
        self.gain = self.start_gain   # running tokens per sequence of this open phase's verify steps
                                      # (None in a probe: judged by what it measures alone)
        self.run = 0              # verify steps in this open phase
        self.streak = 0           # closes after short probes, in a row (each wait twice as long)
        self.fresh = True         # no verify step since the engine ran dry (the start gain stands)
        self.probing = False      # this open phase is a probe (judged after probe_steps)

    def closed_next(self) -> bool:
        """Will the next step be a plain one (nothing asked of the proposer)?"""
        return not self.open and self.wait > 0

    def step(self, num_decode: int, prefill: bool) -> bool:
        """A step is being planned: may its decodes guess? (Counts a closed step down.)"""
        if num_decode == 0:
            self.reset()
            return True
        if not self.open and prefill:
            self.wait = min(self.wait, self.pause)
        if not self.closed_next():
            return True
        self.wait -= 1
        self.num_plain_steps += 1
        if self.wait == 0:                  # the next step probes
            self.open, self.gain, self.run, self.probing = True, None, 0, True
            self.num_probes += 1
        return False

    def verified(self, num_seqs: int, kept: int, cost: float | None, batch: int | None = None) -> None:
        """A verify step: `num_seqs` decoding sequences (those the gain is read over) kept `kept`
        guesses in all; `cost`: what such a step costs against a plain one run ahead (None: not
        known yet); `batch`: how many sequences decoded in that step (default num_seqs)."""
        if not self.open or num_seqs <= 0:
            return
        if self.fresh:            # a batch's first phase starts just above the cost, not optimistic
            self.fresh = False
            if (batch or num_seqs) > 1 and cost is not None and self.gain is not None:
                self.gain = min(self.gain, cost + self.start_margin)
        g = 1 + kept / num_seqs
        self.gain = g if self.gain is None else self.gain + self.weight * (g - self.gain)
        self.run += 1
        if self.run < (self.probe_steps if self.probing else self.min_steps):
            return
        if cost is None:                    # measure a plain step at this size first
            self.open, self.wait = False, self.calibrate_steps
        elif self.gain < cost:
            if self.run >= self.paid_run:   # it paid for a while: start short again
                self.streak = 0
            self.open, self.wait = False, min(self.pause << min(self.streak, 16), self.max_pause)
            self.streak += 1
            self.num_closes += 1
        self.probing = self.probing and not self.open

    # -- with a shadow (shadow.py): the gain is known without guessing ---------------------------
    def decide(self, estimate: float, cost: float | None) -> bool:
        """Would the gate be open for a step whose sequences' replayed gain is `estimate`? (Open:
        it stays open while estimate >= cost; closed: it opens at cost + open_margin.)"""
        c = self.default_cost if cost is None else cost
        return estimate >= (c if self.open else c + self.open_margin)

    def shadow_step(self, num_decode: int, estimate: float, cost: float | None) -> bool:
        """A step is being planned (with a shadow): may its decodes guess? A step with nobody
        decoding closes it (the next batch starts where the tokens say)."""
        if num_decode == 0:
            self.open, self.wait = False, 0
            return False
        now = self.decide(estimate, cost)
        if now != self.open:
            self.num_opens += now
            self.num_closes += not now
        self.open, self.wait = now, 0
        if not now:
            self.num_plain_steps += 1
        return now
