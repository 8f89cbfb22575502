"""Choosing the next token: penalties, greedy, temperature, top-k, top-p, min-p -- batched on the device.

Every row of the logits may have its own settings. Randomness is counter-based: the noise for
(request seed, position, token) is a hash of those three numbers, so a request with a seed gives the
same tokens whatever else shares its batch, its slot, or the step it runs in -- and no Python loop
over sequences is needed. Only the chosen token ids leave the device.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field, replace

import torch

from .kernels.counter_noise import counter_bits, counter_uniform, gumbel_noise  # noqa: F401 -- (re-exported)
from .validation import (INT32_MAX, SEED_LIMIT, ValidationError, check_bool, check_int, check_real,
                         check_seed, is_int, typed)

_MAX_TEMPERATURE = 1e4
DEFAULT_MAX_TOKENS = 64
MAX_N = 128                               # samples per prompt
MAX_LOGPROBS = 20                         # alternatives per token (OpenAI's limit)
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256                     # characters per stop string
MAX_REPETITION_PENALTY = 10.0
_OWNER = "SamplingParams"


def _bad(field_name: str, expected: str, found, hint: str = "", shown: str | None = None):
    raise ValidationError(field_name, expected, found, hint, owner=_OWNER, shown=shown)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Immutable (derive a variant with dataclasses.replace) and
    checked when built, so that a bad value fails here, in the caller's hands, and never later
    inside a running engine step. Every error is a ValueError that starts with "SamplingParams:"
    and names the field and the value.

    max_new_tokens  integer, 1 .. 2**31-1 (default 64). `max_tokens` is the same number under the
                    OpenAI / vLLM name: SamplingParams(max_tokens=16) sets it, `.max_tokens` reads
                    it; if both names are given they must agree.
    temperature     finite number, 0 .. 1e4 (0 = greedy); stored as a float.
    top_k           integer, 0 .. 2**31-1 (0 = off).
    top_p           finite number in (0, 1] (1 = off); stored as a float.
    seed            None (drawn from the engine's seed) or an integer, 0 .. 2**63-1 (it travels in
                    an int64 tensor).
    stop_token_ids  a list, tuple, set or frozenset of integer token ids, 0 .. 2**31-1; stored as
                    a tuple (a set's ids sorted).
    ignore_eos      a bool.
    min_p           finite number in [0, 1] (0 = off): drop tokens whose probability is below
                    min_p times the most likely token's.
    presence_penalty, frequency_penalty
                    finite numbers in [-2, 2] (OpenAI's): subtracted from the logit of every token
                    already in the output, once (presence) or once per occurrence (frequency).
    repetition_penalty
                    finite number in (0, 10] (1 = off; transformers' / vLLM's): the logit of every
                    token in the prompt or the output is divided by it if positive, multiplied if not.
    stop            a string or a list/tuple of up to 16 non-empty strings: the request stops when its
                    text contains one; the returned text ends before it. Stored as a tuple.
    n               integer, 1 .. 128: samples per prompt. LLM.generate and the server expand it into
                    n requests (seeds seed, seed+1, ... when a seed is given); the engine takes n = 1.
                    n > 1 needs temperature > 0: greedy samples would all be the same answer.
    logprobs        None (off) or an integer 0 .. 20: return the chosen token's log-probability and
                    that many most likely alternatives, for every output token (of the model's raw
                    distribution, before temperature and penalties).
    Booleans are refused wherever a number is expected.
    """
    max_new_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0          # 0 -> greedy
    top_k: int = 0                    # 0 -> off
    top_p: float = 1.0                # 1 -> off
    seed: int | None = None           # None -> drawn from the engine's seed
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0                # 0 -> off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # 1 -> off
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: int | None = None       # None -> off

    @property
    def max_tokens(self) -> int:
        """max_new_tokens under its OpenAI / vLLM name."""
        return self.max_new_tokens

    def __post_init__(self):
        put = object.__setattr__             # frozen: normalized values are stored this way
        o = _OWNER
        put(self, "max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, 1, INT32_MAX, owner=o))
        put(self, "temperature", check_real("temperature", self.temperature, 0.0, _MAX_TEMPERATURE,
                                            note=" (0 = greedy)", owner=o))
        put(self, "top_k", check_int("top_k", self.top_k, 0, INT32_MAX, note=" (0 = off)", owner=o))
        put(self, "top_p", check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True, note=" (1 = off)", owner=o))
        put(self, "seed", check_seed("seed", self.seed, optional=True, owner=o))
        put(self, "stop_token_ids", _check_stop_ids(self.stop_token_ids))
        check_bool("ignore_eos", self.ignore_eos, owner=o)
        put(self, "min_p", check_real("min_p", self.min_p, 0.0, 1.0, note=" (0 = off)", owner=o))
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, check_real(name, getattr(self, name), -2.0, 2.0, owner=o))
        put(self, "repetition_penalty", check_real("repetition_penalty", self.repetition_penalty, 0.0,
                                                   MAX_REPETITION_PENALTY, lo_open=True, note=" (1 = off)", owner=o))
        put(self, "stop", _check_stop_strings(self.stop))
        put(self, "n", check_int("n", self.n, 1, MAX_N, owner=o))
        if self.n > 1 and self.temperature == 0:
            _bad("n", "1 with temperature=0 (greedy, the default here: every sample would be the same "
                 "answer)", self.n, ": set temperature > 0 (vLLM's default is 1.0) to sample different ones")
        put(self, "logprobs", check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True, owner=o))
        # the three questions the scheduler and the runner ask of every request in every step, answered
        # once (the fields are frozen): (has_penalties, plain_greedy, chosen_on_device)
        penalties = bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)
        put(self, "_asked", (penalties, self.temperature == 0 and not penalties and self.logprobs is None,
                             not penalties and self.logprobs is None))

    def samples(self) -> list["SamplingParams"]:
        """The n samples of a prompt as n requests' params: n = 1 each, and with a seed, seeds seed,
        seed + 1, ... (mod 2**63: each sample its own random stream, all reproducible). The one
        n-expansion: LLM.generate and the server both use it."""
        if self.n == 1:
            return [self]
        one = replace(self, n=1)
        return [one if self.seed is None or j == 0 else replace(one, seed=(self.seed + j) % SEED_LIMIT)
                for j in range(self.n)]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self._asked[0]

    @property
    def plain_greedy(self) -> bool:
        """The next token is the argmax of the raw logits and nothing else is read from them (no
        penalties, no logprobs): what a CUDA graph can choose on its own and the overlap loop can
        run ahead of."""
        return self._asked[1]

    @property
    def chosen_on_device(self) -> bool:
        """The next token depends on this step's logits, the request's seed and its position and
        nothing else (no penalties, which read the output so far on the host; no logprobs, which
        are read back with the token): greedy or sampled, the device can choose it alone, so the
        overlap loop may run ahead of it (runner.ModelRunner.RUN_AHEAD_SAMPLED)."""
        return self._asked[2]



def _accept_max_tokens(init):
    """SamplingParams(max_tokens=N): the OpenAI / vLLM name of max_new_tokens, resolved before the
    dataclass's own __init__ runs (so dataclasses.replace, which passes every field, never sees it)."""
    @functools.wraps(init)
    def __init__(self, *args, max_tokens=None, **kwargs):
        if max_tokens is not None:
            m = check_int("max_tokens", max_tokens, 1, INT32_MAX, owner=_OWNER)
            given = args[0] if args else kwargs.get("max_new_tokens")
            if given is not None:
                n = check_int("max_new_tokens", given, 1, INT32_MAX, owner=_OWNER)
                if m != n:
                    _bad("max_tokens", f"max_new_tokens ({n}) when both are given (max_tokens is an alias "
                         "of max_new_tokens: give one of them)", m,
                         "; dataclasses.replace passes every field, max_new_tokens too: derive with "
                         f"replace(params, max_new_tokens={m})" if len(kwargs) >= len(sig.parameters) - 1 else "")
            elif not args:
                kwargs["max_new_tokens"] = m
        init(self, *args, **kwargs)
    sig = inspect.signature(init)
    __init__.__signature__ = sig.replace(parameters=[*sig.parameters.values(), inspect.Parameter(
        "max_tokens", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None")])
    return __init__


SamplingParams.__init__ = _accept_max_tokens(SamplingParams.__init__)

def _check_stop_strings(stop) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        _bad("stop", "a string or a list of strings", stop, shown=typed(stop))
    if len(stop) > MAX_STOP_STRINGS:
        _bad("stop", f"at most {MAX_STOP_STRINGS} strings", stop, shown=f"{len(stop)} strings")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            _bad(f"stop[{i}]", "a non-empty string", s, shown=None if isinstance(s, str) else typed(s))
        if len(s) > MAX_STOP_LENGTH:
            _bad(f"stop[{i}]", f"at most {MAX_STOP_LENGTH} characters", s, shown=f"{len(s)} characters")
    return tuple(stop)


def _check_stop_ids(ids) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple, set, frozenset)):
        _bad("stop_token_ids", "a list, tuple or set of integer token ids", ids, shown=typed(ids))
    seq = sorted(ids, key=_sort_key) if isinstance(ids, (set, frozenset)) else list(ids)
    return tuple(check_int(f"stop_token_ids[{i}]", t, 0, INT32_MAX, owner=_OWNER,
                           kind="an integer token id") for i, t in enumerate(seq))


def _sort_key(t):
    """Orders a set's members for a reproducible tuple (any junk among them is refused later)."""
    return (0, int(t), "") if is_int(t) else (1, 0, repr(type(t)))


@dataclass
class TokenLogprob:
    """One output token's log-probability and the most likely alternatives at its position
    (SamplingParams.logprobs), under the model's raw distribution (before temperature/penalties)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token id, logprob), most likely first


def token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[B, V] float32: how often each token occurs in each row's list. All rows' ids reach the
    device in one copy and are counted by one scatter-add (no loop over rows on the device)."""
    rows = [i for i, ids in enumerate(token_lists) for _ in range(len(ids))]
    flat = torch.tensor([rows, [t for ids in token_lists for t in ids]], dtype=torch.int64)
    flat = flat.to(device, non_blocking=True)
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    return counts.index_put_((flat[0], flat[1]), torch.ones_like(flat[0], dtype=torch.float32),
                             accumulate=True)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """OpenAI's presence / frequency penalties (over the output) and the repetition penalty of
    transformers and vLLM (over prompt and output), per row. logits [B, V] fp32; output_counts [B, V]
    occurrences in the output; seen [B, V] bool: the token is in the prompt or the output."""
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0).float()


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, all_greedy: bool = False,
           any_top_filter: bool = True, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] (int64, on the device). Rows with temperature 0 are greedy.
    all_greedy / any_top_filter are host-side facts the caller knows (they skip work without a sync);
    min_p (None: off for every row) drops tokens less likely than min_p x the most likely one."""
    greedy = logits.argmax(dim=-1)
    if all_greedy:
        return greedy
    b, v = logits.shape
    t = temperature.clamp(min=1e-5)[:, None]
    scaled = logits / t
    if min_p is not None:
        # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p)  (no softmax needed)
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p.clamp(min=1e-30))[:, None]
        scaled = scaled.masked_fill((scaled < floor) & (min_p > 0)[:, None], float("-inf"))
    if any_top_filter:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(v, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, v)[:, None]
        drop = rank >= k
        probs = sorted_logits.softmax(dim=-1)
        # keep the smallest set reaching p -- only on rows that asked for it: in float32 the cumsum
        # can pass 1.0 before the last tokens, and a row with top_p = 1 must not lose that tail
        # (it must draw the token it would draw alone, whatever its batch-mates use)
        drop |= ((probs.cumsum(dim=-1) - probs) > top_p[:, None]) & (top_p < 1)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    gumbel = gumbel_noise(seeds, positions, v)
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
