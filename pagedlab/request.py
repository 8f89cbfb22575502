"""A request's life: WAITING in the queue -> RUNNING in a slot -> FINISHED (or PREEMPTED back to
the front of the queue, to be recomputed later). Only the scheduler changes a request's state."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"     # waiting again, its blocks given back; its tokens are kept
    FINISHED = "finished"


@dataclass(eq=False)      # a request is itself: compared by identity (list.remove, `in`)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)   # the tokens read back, only those
    num_in_flight: int = 0                    # output tokens launched, not read back yet (overlap loop)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None          # "stop" (EOS / stop token), "length", "abort", "error"
    stop_token_id: int | None = None          # the token that stopped it (finish_reason "stop")
    error: str | None = None                  # what went wrong (finish_reason "error")
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)   # physical blocks, in logical order
    num_computed: int = 0                     # tokens whose K/V are in the cache
    num_scheduled: int = 0                    # tokens this step computes (a prefill chunk, or 1)
    num_preemptions: int = 0
    num_cached_tokens: int = 0                # prompt tokens found in the prefix cache, not computed
    block_keys: list = field(default_factory=list)    # prefix-cache keys of its full blocks (prefix_cache.py)
    num_registered_blocks: int = 0            # its blocks[:n] were named in the prefix cache
    logprobs: list = field(default_factory=list)   # params.logprobs: a TokenLogprob per output token
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # speculative decoding (spec/): this step's guesses, totals, and what drives its k
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_proposed: int = 0                # guesses verified
    num_spec_accepted: int = 0                # of those, kept (emitted)
    spec_rate: float = 0.8                    # running acceptance rate (spec/accept.py AdaptiveK)
    spec_pause: int = 0                       # steps left without proposals
    spec_gain: float = 3.0                    # running tokens per verify step (1 + kept)
    spec_streak: int = 0                      # pauses after short runs, in a row (each one twice as long)
    spec_run: int = 0                         # verify steps since it last started guessing again
    spec_misses: int = 0                      # proposals in a row that found no guess

    @property
    def num_tokens(self) -> int:
        """Its sequence's length, tokens in flight included (their positions are taken)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_in_flight

    @property
    def num_known_tokens(self) -> int:
        """The tokens whose ids the host knows: all but those in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The known tokens (prompt + output read back)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The last known token (with a token in flight, the runner takes that one on the device)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
