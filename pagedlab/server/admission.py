"""Admission control: a bounded queue in front of the engine.

The engine runs at most `slots` sequences at once (EngineConfig.max_num_seqs); the others wait in
its queue. A queue without a bound lets a burst of requests pile up until every one of them waits
longer than any client would -- the server is then busy answering requests nobody is still waiting
for. So the server admits at most `slots + max_waiting` streams at a time (a request with n samples
is n streams) and answers the next one at once with 503 and a Retry-After header: come back later,
or try another replica. A load balancer or a client with retries turns that into back-pressure.

The count is the server's own, changed on the event loop only (no lock needed, no race with the
engine thread): `admit` counts a request in before anything is queued, and its ticket's `release`
counts it out when its response is over, however it ended (done, error, client gone).

Several front-end processes (serve --api-servers N): each writes its own count into one slot of a
shared array and admits against the sum of all slots, so the bound is the server's, not N times it.
Two front ends admitting at the same instant may both see room for the last place: the bound can be
passed by a request or two, never by a front end's share. A front end that dies has its slot
cleared by the parent (frontends.py).
"""
from __future__ import annotations

from .protocol import OpenAIError

RETRY_AFTER_S = 1


class Ticket:
    """One admitted request's place; release() is idempotent (safe from several cleanup paths)."""

    def __init__(self, gate: "AdmissionGate", n: int):
        self.gate, self.n = gate, n

    def release(self) -> None:
        if self.n:
            self.gate.in_flight -= self.n
            self.n = 0


class AdmissionGate:
    def __init__(self, slots: int, max_waiting: int, shared=None, index: int = 0):
        """shared (several front ends): every front end's count, this one's at shared[index]."""
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.slots, self.max_waiting = slots, max_waiting
        self._shared, self._index = shared, index
        self._in_flight = 0                 # streams this front end admitted and not finished

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, n: int) -> None:
        self._in_flight = n
        if self._shared is not None:
            self._shared[self._index] = n

    def total(self) -> int:
        """Streams admitted and not finished, by every front end."""
        return self._in_flight if self._shared is None else sum(self._shared)

    @property
    def capacity(self) -> int:
        return self.slots + self.max_waiting

    @property
    def waiting(self) -> int:
        """Streams admitted beyond the slots: they wait in the engine's queue."""
        return max(0, self.total() - self.slots)

    def admit(self, n: int = 1, prompts: int = 1) -> Ticket:
        """A ticket for n streams (prompts x samples each), or OpenAIError 503 when the queue would
        hold more than max_waiting; a request that could never fit is a 400 naming what the request
        gave: its prompts (param "prompt") and/or its samples per prompt (param "n")."""
        if n > self.capacity:
            samples = n // max(1, prompts)
            most = f"the server runs at most {self.capacity} at once ({self.slots} slots + {self.max_waiting} waiting)"
            if samples == 1:          # n not given (or 1): the prompts alone are too many
                raise OpenAIError(f"this request has {prompts} prompts but {most}: send at most "
                                  f"{self.capacity} prompts per request", param="prompt")
            if prompts == 1:
                raise OpenAIError(f"this request asks for n={samples} samples but {most}", param="n")
            raise OpenAIError(f"this request needs {n} streams ({prompts} prompts x n={samples}) but {most}",
                              param="prompt" if prompts > self.capacity else "n")
        if self.total() + n > self.capacity:
            raise OpenAIError(f"the server is busy: {self.waiting} requests are waiting (at most "
                              f"{self.max_waiting}); retry after {RETRY_AFTER_S} s", status=503,
                              type="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += n
        return Ticket(self, n)
