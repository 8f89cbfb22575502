"""The course's checks: each runs a learner's function on random and edge cases against pagedlab's
own implementation and says what is wrong (which input, expected vs got, a hint).

A failing check raises `CheckFailed`. In Jupyter (IPython) its traceback is replaced by its
message (`_render_traceback_`), so Run All stops at the first unfinished piece with a short,
friendly message instead of a stack. A stub that still raises NotImplementedError fails the same way.

With PAGEDLAB_SOLUTIONS=1 (CI, or a learner who wants to move on) a check runs the solution from
notebooks/solutions/pieces.py instead of the learner's function. Every check returns the function
that passed, so the notebook continues with it: `schedule_step = course.check_schedule_step(schedule_step)`.

The toy engine state of notebooks 08 and 10 (`Seq`, `EngineState`) is plain Python over pagedlab's
own `BlockAllocator`: the same queue -> slot -> blocks -> tokens -> stop -> free cycle as
pagedlab's `Scheduler`, without chunked prefill, token budgets or sampling.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..kv_cache import BlockAllocator, blocks_needed
from .chapter import Chapter, CheckFailed

KERNELS_FILE = "pieces_kernels.py"          # the Triton kernels' solutions (they need Triton)
chapter = Chapter("pieces.py", KERNELS_FILE, module="course")
solution, show_solution = chapter.solution, chapter.show_solution


# -- notebook 07: the block allocator and where token n lives ----------------------------------

def check_allocator(cls, trials: int = 40, seed: int = 0):
    """`cls(num_blocks)` with `.free_list` (a deque), `.owner` (block -> who), `.allocate(who, n)`
    and `.free(blocks)`, against pagedlab's BlockAllocator on random sequences of operations:
    the same blocks handed out, the same free list in the same order, the same owners; asking
    for more blocks than are free, and freeing a block not in use, must raise and change nothing."""
    cls = chapter.pick(cls, "Allocator")
    probe = chapter.call(cls, "Allocator", 4)                  # allocate first: the method the text starts with
    chapter.call(probe.allocate, "Allocator.allocate", "probe", 1)
    rng = random.Random(seed)
    for trial in range(trials):
        n = rng.choice([1, 2, 5, 12])
        ours, ref = chapter.call(cls, "Allocator", n), BlockAllocator(n)
        held: dict[str, list[int]] = {}
        log = [f"Allocator({n})"]
        for _ in range(rng.randint(3, 25)):
            free_now = len(ref.free_blocks)
            if held and rng.random() < 0.4:
                who = rng.choice(sorted(held))
                blocks = held.pop(who)
                if len(blocks) > 1 and rng.random() < 0.3:       # free part of them
                    k = rng.randint(1, len(blocks) - 1)
                    blocks, held[who] = blocks[:k], blocks[k:]
                log.append(f"free({blocks})")
                ref.free(blocks)
                chapter.call(ours.free, "Allocator.free", blocks)
            elif rng.random() < 0.15:
                bad = rng.choice([b for b in range(n) if b not in ref.owner] or [n + 3])
                log.append(f"free([{bad}])   # not in use: must raise")
                _expect_raise(ours, lambda: ours.free([bad]), log,
                              "freeing a block that is not in use must raise (a double free would hand it out twice)",
                              "Allocator.free")
            else:
                who = f"s{rng.randrange(6)}"
                k = rng.randint(1, 3) if rng.random() < 0.85 else free_now + rng.randint(1, 2)
                log.append(f"allocate({who!r}, {k})" + ("   # too many: must raise" if k > free_now else ""))
                if k > free_now:
                    _expect_raise(ours, lambda: ours.allocate(who, k), log,
                                  f"only {free_now} blocks are free: allocate(.., {k}) must raise and take none",
                                  "Allocator.allocate")
                else:
                    want = ref.allocate(who, k)
                    got = chapter.call(ours.allocate, "Allocator.allocate", who, k)
                    if list(got or []) != want:
                        raise CheckFailed(_story(log) + f"allocate returned {got}, expected {want}.\n"
                                          "Hint: take blocks from the FRONT of the free list (popleft).")
                    held.setdefault(who, []).extend(want)
            _compare_allocator(ours, ref, log)
    chapter.passed("Allocator", f"{trials} random runs match pagedlab's BlockAllocator (blocks, free-list order, owners, errors)")
    return cls


def _expect_raise(ours, op, log, why, name="Allocator"):
    before = (list(ours.free_list), dict(ours.owner))
    try:
        op()
    except NotImplementedError as e:
        raise CheckFailed(chapter.not_written(name, e)) from None
    except Exception:
        if (list(ours.free_list), dict(ours.owner)) != before:
            raise CheckFailed(_story(log) + "it raised, but changed the free list or the owners first.\n"
                              "Hint: check before you take or give back anything.") from None
        return
    raise CheckFailed(_story(log) + f"no error was raised: {why}.")


def _compare_allocator(ours, ref, log):
    if list(ours.free_list) != list(ref.free_blocks):
        raise CheckFailed(_story(log) + f"free list {list(ours.free_list)}, expected {list(ref.free_blocks)}.\n"
                          "Hint: allocate pops from the front, free appends to the back, in the order given.")
    if dict(ours.owner) != ref.owner:
        raise CheckFailed(_story(log) + f"owners {dict(ours.owner)}, expected {ref.owner}.\n"
                          "Hint: allocate records who owns each block; free forgets it.")


def _story(log, last=12):
    shown = log if len(log) <= last else [log[0], "..."] + log[-last:]
    return "after\n    " + "\n    ".join(shown) + "\n"


def check_token_slot(fn, trials: int = 200, seed: int = 0):
    """`fn(row, n, block_size)`: the flat cache slot of token n of a sequence whose block-table
    row is `row` (its physical blocks in logical order), against pagedlab's `gather_pages`."""
    import torch
    from ..kernels.paged import gather_pages
    fn = chapter.pick(fn, "token_slot")
    rng = random.Random(seed)
    for t in range(trials):
        bs = rng.choice([1, 2, 4, 16])
        num_blocks = rng.randint(1, 9)
        length = rng.randint(1, num_blocks * bs) if t else num_blocks * bs      # first: a full row
        row = rng.sample(range(num_blocks + 3), blocks_needed(length, bs))
        pool = torch.arange((num_blocks + 3) * bs).reshape(num_blocks + 3, bs, 1, 1)   # the slot numbers
        want = gather_pages(pool, torch.tensor([row], dtype=torch.int32))[0, :length].flatten().tolist()
        for n in sorted({0, length - 1, rng.randrange(length), min(bs, length - 1)}):
            got = chapter.call(fn, "token_slot", list(row), n, bs)
            if got != want[n]:
                block, off = row[n // bs], n % bs
                likely = {block * bs: f"the offset inside the block is missing: add n % block_size (= {off})",
                          n: "that is the token's LOGICAL slot: look its block up in the table, row[n // block_size]",
                          block + off: f"the block's first slot is block * block_size (= {block * bs}), not the block id",
                          (n // bs) * bs + block: "the physical block goes first: row[n // block_size] * block_size"}
                why = likely.get(got, f"token {n} is in logical block {n // bs} (physical {block}), row {off} inside it")
                raise CheckFailed(f"token_slot(row={row}, n={n}, block_size={bs}) = {got}, expected {want[n]}.\n"
                                  f"Hint: {why}.")
    chapter.passed("token_slot", f"{trials} random block tables agree with pagedlab's gather_pages")
    return fn


# -- notebooks 08 and 10: one scheduler step over plain Python objects -------------------------

@dataclass(eq=False)
class Seq:
    """A request, reduced to what the scheduler needs. `generated` tokens so far; `blocks` are
    its physical KV blocks in logical order."""
    rid: int
    prompt_len: int
    max_new_tokens: int
    generated: int = 0
    blocks: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:         # tokens whose K/V the cache holds once this step has run
        return self.prompt_len + self.generated

    def __repr__(self):
        return f"Seq(rid={self.rid}, prompt_len={self.prompt_len}, generated={self.generated}/{self.max_new_tokens})"


@dataclass
class EngineState:
    """Everything a step reads and changes. `queue`: waiting Seqs, front first; `slots`: the Seq in
    each slot or None; `running`: the Seqs in slots in the order they got their slot (oldest
    first); `allocator`: pagedlab's BlockAllocator; `finished` and `preempted`: request ids, in
    order (preempted: this step's victims, reset by the step's caller)."""
    queue: deque
    slots: list
    running: list
    allocator: BlockAllocator
    block_size: int = 16
    finished: list = field(default_factory=list)
    preempted: list = field(default_factory=list)

    @classmethod
    def new(cls, workload, num_slots: int, num_blocks: int, block_size: int = 16) -> "EngineState":
        """workload: a list of (prompt_len, max_new_tokens); request ids are the positions."""
        return cls(deque(Seq(i, p, m) for i, (p, m) in enumerate(workload)), [None] * num_slots, [],
                   BlockAllocator(num_blocks), block_size)

    def has_work(self) -> bool:
        return bool(self.queue) or any(s is not None for s in self.slots)


def reference_step(state: EngineState, make_room=None) -> list:
    """One step as pagedlab's Scheduler takes it (no chunking, no budget): room for each running
    request's next token (oldest first; `make_room` preempts when the pool is out), then free slots
    filled from the queue (lowest slot first, while the front request's blocks fit), then every
    request in a slot makes one token; those that are done stop and free their blocks.
    Returns the request id in each slot as the step ran (None: idle)."""
    make_room = make_room or make_room_preempting
    for seq in list(state.running):
        if seq in state.running:
            make_room(state, seq)
    while state.queue and None in state.slots:
        seq = state.queue[0]
        if blocks_needed(seq.num_tokens, state.block_size) > state.allocator.num_free:
            break
        state.queue.popleft()
        seq.blocks = state.allocator.allocate(seq.rid, blocks_needed(seq.num_tokens, state.block_size))
        state.slots[state.slots.index(None)] = seq
        state.running.append(seq)
    ran = [s.rid if s is not None else None for s in state.slots]
    for seq in list(state.running):
        seq.generated += 1
    for seq in list(state.running):
        if seq.generated >= seq.max_new_tokens:
            state.allocator.free(seq.blocks)
            seq.blocks = []
            state.slots[state.slots.index(seq)] = None
            state.running.remove(seq)
            state.finished.append(seq.rid)
    return ran


def make_room_preempting(state, seq, which: int = -1) -> bool:
    """The course's make_room: room for `seq`'s next token, preempting state.running[which] while
    the pool is short (-1: the newest, pagedlab's rule; 0: the oldest, notebook 10's exercise 2).
    True if `seq` keeps its slot."""
    need = blocks_needed(seq.num_tokens, state.block_size) - len(seq.blocks)
    while need > state.allocator.num_free:
        victim = state.running[which]
        state.allocator.free(victim.blocks)
        victim.blocks = []
        state.slots[state.slots.index(victim)] = None
        state.running.remove(victim)
        state.queue.appendleft(victim)
        state.preempted.append(victim.rid)
        if victim is seq:
            return False
    if need > 0:
        seq.blocks += state.allocator.allocate(seq.rid, need)
    return True


def pagedlab_schedule(workload, num_slots: int, num_blocks: int, block_size: int = 16):
    """pagedlab's own Scheduler on the workload, driven with dummy tokens (no model): per step,
    what ran and the state after it (see _snapshot)."""
    from ..request import Request
    from ..sampling import SamplingParams
    from ..scheduler import Scheduler
    sched = Scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=num_slots,
                      max_model_len=10**6, max_num_batched_tokens=10**6, record_views=True)
    for i, (p, m) in enumerate(workload):
        sched.add(Request(request_id=i, prompt_token_ids=[5] * p,
                          params=SamplingParams(max_new_tokens=m, ignore_eos=True), seed=0))
    steps, finished = [], []
    while sched.has_work():
        batch = sched.schedule()
        sched.accept(batch, [7] * len(batch.sampled))
        finished += [r.request_id for r in sched.take_finished()]
        steps.append(dict(ran=batch.view["slot_request"], preempted=batch.view["preempted"],
                          **_snapshot_pagedlab(sched, finished)))
        if len(steps) > 100_000:
            raise RuntimeError("pagedlab's scheduler did not finish")
    return steps


def _snapshot_pagedlab(sched, finished):
    return dict(queue=[r.request_id for r in sched.waiting],
                slots=[r.request_id if r else None for r in sched.slots],
                rows=[len(r.blocks) if r else 0 for r in sched.slots],
                ids=[list(r.blocks) if r else [] for r in sched.slots],
                generated={r.request_id: len(r.output_token_ids) for r in sched.slots if r},
                pool_used=sched.allocator.num_used, finished=sorted(finished))


def _snapshot_toy(state):
    return dict(queue=[s.rid for s in state.queue],
                slots=[s.rid if s else None for s in state.slots],
                rows=[len(s.blocks) if s else 0 for s in state.slots],
                ids=[list(s.blocks) if s else [] for s in state.slots],
                generated={s.rid: s.generated for s in state.slots if s},
                pool_used=state.allocator.num_used, finished=sorted(state.finished))


_WHAT = {"ran": "requests in the slots as the step ran", "preempted": "requests preempted in the step",
         "queue": "queue after the step", "rows": "blocks held per slot after the step",
         "ids": "block ids held per slot after the step",
         "generated": "tokens generated per running request after the step",
         "pool_used": "blocks in use after the step", "finished": "finished requests after the step"}


def run_toy(workload, num_slots, num_blocks, step_fn, block_size=16, name="step", make_room=None):
    """Run `step_fn(state)` (or reference_step with `make_room`) until the work is done and
    compare every step with pagedlab's Scheduler on the same workload. Returns the steps
    (what ran in each). Raises CheckFailed at the first difference."""
    want = pagedlab_schedule(workload, num_slots, num_blocks, block_size)
    state = EngineState.new(workload, num_slots, num_blocks, block_size)
    setup = (f"workload (prompt_len, max_new_tokens) = {list(workload)}, {num_slots} slots, "
             f"{num_blocks} blocks of {block_size} tokens")
    ran_steps = []
    for t, w in enumerate(want):
        if not state.has_work():
            raise CheckFailed(f"{setup}:\nyour run ended after {t} steps; pagedlab's takes {len(want)}.\n"
                              "Hint: a request stops when it has made max_new_tokens tokens, not before.")
        state.preempted = []
        try:
            if make_room is None:
                ran = chapter.call(step_fn, name, state)
            else:
                ran = chapter.call(reference_step, name, state, _wrap_room(make_room, name))
        except CheckFailed as e:
            if "not written yet" in str(e):
                raise
            raise CheckFailed(f"{setup}:\nat step {t}, {e}") from None
        got = dict(ran=list(ran) if ran is not None else None, preempted=state.preempted, **_snapshot_toy(state))
        for key in ("preempted", "queue", "ran", "generated", "rows", "ids", "pool_used", "finished"):
            if got[key] != w[key]:
                raise CheckFailed(f"{setup}:\nat step {t}, {_WHAT[key]}: got {got[key]}, expected {w[key]}."
                                  f"\n{_diagnose(key, got, w, state)}")
        ran_steps.append(got["ran"])
    if state.has_work():
        raise CheckFailed(f"{setup}:\npagedlab's run ends after {len(want)} steps, yours still has work "
                          f"(queue {[s.rid for s in state.queue]}, slots {[s and s.rid for s in state.slots]}).")
    return ran_steps


def _wrap_room(make_room, name):
    def room(state, seq):
        return chapter.call(make_room, name, state, seq)
    return room


def _diagnose(key, got, want, state) -> str:
    """The hint for the likely bug behind a difference: read from the whole step (what finished,
    who holds blocks, how the counts differ), not only from the first field that differs."""
    holding = [s.rid for s in state.queue if s.blocks]
    if holding:
        return (f"Hint: {', '.join(f'req {r}' for r in holding)} is back in the queue but still holds blocks. "
                "When make_room preempts `seq` itself it must return False at once: `seq` has no slot to grow "
                "in, so nothing is allocated for it.")
    if got["slots"] != want["slots"] and sorted(got["slots"], key=str) == sorted(want["slots"], key=str):
        return (f"Hint: the same requests run, in other slots (yours {got['slots']}, pagedlab's "
                f"{want['slots']}): a new request takes the LOWEST free slot, state.slots.index(None), and "
                "keeps it until it stops or is preempted.")
    late = [r for r in want["finished"] if r not in got["finished"]]
    early = [r for r in got["finished"] if r not in want["finished"]]
    if late:
        r = late[0]
        n = got["generated"].get(r)
        return (f"Hint: req {r} should have stopped in this step{f' (it has made {n} tokens)' if n is not None else ''}. "
                "A request stops in the step that makes its max_new_tokens-th token: add the step's token, "
                "then stop it when generated == max_new_tokens.")
    if early:
        return (f"Hint: req {early[0]} stopped one step early. It stops only when generated == max_new_tokens, "
                "counting this step's token (the prefill step makes the first).")
    if key == "generated":
        reset = [r for r, n in got["generated"].items() if r in want["generated"] and n < want["generated"][r] - 1]
        if reset:
            r = reset[0]
            return (f"Hint: req {r} has made {got['generated'][r]} tokens, pagedlab's {want['generated'][r]}: its "
                    "count started again. A preempted request keeps its generated tokens (they are recomputed "
                    "with the prompt when it returns): never reset seq.generated.")
    if key == "preempted":
        g, w = got["preempted"], want["preempted"]
        if len(g) > len(w) and g[:len(w)] == w:
            return (f"Hint: {', '.join(f'req {r}' for r in g[len(w):])} preempted although the pool then had "
                    "room: preempt only while the blocks needed > allocator.num_free, and stop (return False) "
                    "when the request itself was preempted.")
        if len(g) < len(w) and w[:len(g)] == g:
            return (f"Hint: the pool ran out and req {w[len(g)]} had to be preempted: keep preempting the newest "
                    "running request while the blocks needed > allocator.num_free.")
    if key == "ids" and got["rows"] == want["rows"]:
        return ("Hint: the same number of blocks, different block ids: blocks are taken in a different order. "
                "First make room for every running request's next token (oldest first), then admit from the "
                "queue: a new request takes the blocks that are left.")
    return _hint(key)


def _hint(key):
    return {"ran": "Hint: first make room for the running requests, then fill free slots from the front of "
                   "the queue, lowest slot first; return the request id in each slot (None if idle).",
            "preempted": "Hint: when the pool has too few free blocks, preempt state.running[-1] (the newest) "
                         "and record its rid in state.preempted; stop when the request itself was preempted.",
            "generated": "Hint: every request in a slot makes exactly one token per step, its prefill step included.",
            "rows": "Hint: a request holds blocks_needed(seq.num_tokens, block_size) blocks: its prompt's at "
                    "admission, one more when a new token crosses into the next block.",
            "ids": "Hint: blocks come from state.allocator in the step's order: growth of the running "
                   "requests (oldest first), then admissions (front of the queue first).",
            "pool_used": "Hint: allocate through state.allocator, and free a request's blocks when it stops "
                         "(or is preempted).",
            "queue": "Hint: take requests from the front (popleft); a preempted request goes back to the "
                     "FRONT (appendleft) and keeps its generated tokens.",
            "finished": "Hint: a request stops when generated == max_new_tokens: free its blocks, empty its slot, "
                        "remove it from state.running and append its rid to state.finished."}[key]


def _workloads(rng, n, tight=False):
    out = []
    for _ in range(n):
        k = rng.randint(1, 9)
        out.append([(rng.choice([1, 15, 16, 17, rng.randint(2, 40)]), rng.randint(1, 12 if not tight else 40))
                    for _ in range(k)])
    return out


def check_schedule_step(fn, trials: int = 30, seed: int = 0):
    """`fn(state)`: one engine step with blocks to spare (notebook 08), against pagedlab's
    Scheduler on edge cases (one request, more slots than requests, prompts at block boundaries,
    max_new_tokens=1) and random workloads."""
    fn = chapter.pick(fn, "schedule_step")
    rng = random.Random(seed)
    cases = [([(5, 3)], 1), ([(16, 2), (17, 1), (1, 4)], 4), ([(3, 5), (3, 1), (3, 2), (3, 6), (3, 1)], 2)]
    cases += [(w, rng.randint(1, 4)) for w in _workloads(rng, trials)]
    for workload, slots in cases:
        run_toy(workload, slots, 4096, fn, name="schedule_step")
    chapter.passed("schedule_step", f"{len(cases)} workloads step for step equal to pagedlab's Scheduler")
    return fn


def check_make_room(fn, trials: int = 40, seed: int = 0):
    """`fn(state, seq)`: make room in the pool for running `seq`'s next token, preempting the newest
    running request as often as needed (notebook 10); True if `seq` keeps its slot. Plugged into
    reference_step and compared with pagedlab's Scheduler on pools too small for the workload."""
    fn = chapter.pick(fn, "make_room")
    rng = random.Random(seed)
    cases = [([(14, 6), (14, 6)], 2, 2), ([(20, 30), (20, 30), (5, 40)], 3, 5)]
    for w in _workloads(rng, trials, tight=True):
        biggest = max(blocks_needed(p + m, 16) for p, m in w)
        cases.append((w, rng.randint(1, 4), biggest + rng.randint(0, 3)))
    preemptions = 0
    for workload, slots, blocks in cases:
        run_toy(workload, slots, blocks, None, name="make_room", make_room=fn)
        preemptions += sum(len(s["preempted"]) for s in pagedlab_schedule(workload, slots, blocks))
    chapter.passed("make_room", f"{len(cases)} tight pools ({preemptions} preemptions) step for step equal to pagedlab's Scheduler")
    return fn


# -- notebook 05: the decode loop over a KV cache ------------------------------------------------

def check_kv_generate(fn, llm, cases=None, seed: int = 0):
    """`fn(prompt, n)` -> (n greedy token ids, token-positions computed), driving `llm.model` by
    hand over a KV cache: the same tokens as pagedlab's engine, and the model fed exactly
    len(prompt) + n - 1 positions (the prompt once, then one token per step) -- counted by
    wrapping llm.model.forward, so a loop that recomputes the sequence fails."""
    from ..sampling import SamplingParams
    fn = chapter.pick(fn, "generate_with_cache")
    rng = random.Random(seed)
    cases = cases or [(1, 1), (15, 3), (16, 2), (17, 4), (rng.randint(2, 30), rng.randint(1, 6))]
    model = llm.model
    real_forward = model.forward
    fed, calls = [], []                # token-positions per call; (ids, positions) per call

    def counting_forward(input_ids, positions, *args, **kwargs):
        fed.append(int(input_ids.numel()))
        calls.append((input_ids.tolist(), positions.tolist()))
        return real_forward(input_ids, positions, *args, **kwargs)

    for plen, n in cases:
        prompt = [rng.randrange(3, min(500, llm.config.vocab_size)) for _ in range(plen)]
        want = llm.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids
        fed.clear()
        calls.clear()
        model.forward = counting_forward
        try:
            got = chapter.call(fn, "generate_with_cache", list(prompt), n)
        finally:
            model.forward = real_forward
        where = f"generate_with_cache(prompt of {plen} tokens, n={n})"
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed(f"{where} returned {got!r}: return (tokens, work).")
        toks, work = got
        if list(toks) != want:
            raise CheckFailed(f"{where}: tokens {list(toks)}, pagedlab's engine gives {want}.\n"
                              f"Hint: {_kv_generate_hint(calls, prompt, list(toks))}")
        if sum(fed) != plen + n - 1:
            raise CheckFailed(f"{where}: the model was fed {sum(fed)} token-positions in {len(fed)} calls "
                              f"({fed}); with a cache it needs {plen + n - 1}: the prompt once, then one "
                              "token per step.\nHint: make one cache before the loop and keep it.")
        if work != sum(fed):
            raise CheckFailed(f"{where}: you counted {work} token-positions, the model was fed {sum(fed)}.")
    chapter.passed("generate_with_cache", f"{len(cases)} prompts: the engine's tokens, the prompt computed once "
            "and one position per step")
    return fn


def _kv_generate_hint(calls, prompt, toks) -> str:
    """The likely bug behind wrong tokens, read from what reached model.forward: the positions and
    the tokens fed, call by call, against the prompt once at 0..P-1, then each new token at P + i - 1."""
    P = len(prompt)
    if calls and calls[0][0] != list(prompt):
        return (f"the first call fed {calls[0][0][:8]}{'...' if len(calls[0][0]) > 8 else ''}: the prefill "
                "feeds the whole prompt, and its last position's logits give the first new token.")
    if calls and calls[0][1] != list(range(P)):
        return f"the prefill fed positions {calls[0][1][:8]}...: the prompt sits at positions 0..{P - 1}."
    for i, (ids, pos) in enumerate(calls[1:], start=1):
        if len(ids) != 1:
            break                                            # recomputing: the count check says so
        if pos != [P + i - 1]:
            return (f"decode step {i} fed position {pos[0]}, expected {P + i - 1}: the token made in step i "
                    f"goes in at position P + i - 1 (P = {P}), one further each step -- the cache is read up "
                    "to it, and RoPE turns it by it.")
        if i - 1 < len(toks) and ids[0] != toks[i - 1]:
            return (f"decode step {i} fed token {ids[0]}, but the token made before it was {toks[i - 1]}: "
                    "feed the token the previous step chose (out[-1]).")
    return ("the positions and tokens fed look right: take each next token from the last position's logits "
            "(argmax), and keep ONE cache and block table for the whole loop.")


# -- notebook 06: the decode kernel's loop, in plain torch ---------------------------------------

def check_decode_one(fn, trials: int = 12, seed: int = 0):
    """`fn(q, k, v, row, length, kv_head, scale)`: decode attention of ONE query head of one
    sequence (q [D]) over its `length` cached keys, read through its block-table `row` from the
    paged pools k, v [num_blocks, block_size, kv_heads, D] -- the loop of the naive kernel, one key
    at a time with an online softmax. Against pagedlab's decode_attention_torch on scattered pages,
    ragged lengths (1, a block boundary, random) and every KV head."""
    import torch
    from ..kernels.decode_attention import decode_attention_torch
    fn = chapter.pick(fn, "decode_one")
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for t in range(trials):
        bs, hkv, group, d = rng.choice([4, 16]), rng.choice([1, 2, 3]), rng.choice([1, 3]), rng.choice([8, 16])
        hq = hkv * group
        lens = [1, bs, bs + 1, rng.randint(2, 5 * bs)] if t == 0 else [rng.randint(1, 5 * bs) for _ in range(2)]
        nb = max(blocks_needed(n, bs) for n in lens)
        pool_blocks = nb * len(lens) + 2
        k = torch.randn(pool_blocks, bs, hkv, d, generator=g)
        v = torch.randn(pool_blocks, bs, hkv, d, generator=g)
        table = torch.randperm(pool_blocks, generator=g)[:nb * len(lens)].view(len(lens), nb).to(torch.int32)
        q = torch.randn(len(lens), hq, d, generator=g) * rng.choice([1.0, 4.0])   # x4: peaked softmax
        scale = d ** -0.5
        ref = decode_attention_torch(q, k, v, table, torch.tensor(lens, dtype=torch.int32), scale)
        for b, n in enumerate(lens):
            for h in sorted({0, hq - 1, rng.randrange(hq)}):
                row = table[b, :blocks_needed(n, bs)].tolist()
                got = chapter.call(fn, "decode_one", q[b, h], k, v, row, n, h // group, scale)
                if not isinstance(got, torch.Tensor) or tuple(got.shape) != (d,):
                    raise CheckFailed(f"decode_one returned {type(got).__name__} "
                                      f"{tuple(getattr(got, 'shape', ()))}; expected a tensor of shape ({d},).")
                if not torch.allclose(got.float(), ref[b, h], atol=1e-4, rtol=1e-4):
                    err = (got.float() - ref[b, h]).abs().max().item()
                    raise CheckFailed(
                        f"decode_one(length={n}, block_size={bs}, row={row}, kv_head={h // group} of {hkv}): "
                        f"off by up to {err:.3g}.\nexpected {ref[b, h][:4].tolist()} ..., got "
                        f"{got.float()[:4].tolist()} ...\nHint: "
                        f"{_decode_one_hint(q[b, h], k, v, row, n, h // group, scale, got.float())}")
    chapter.passed("decode_one", f"{trials} random paged caches agree with pagedlab's decode_attention_torch")
    return fn


def _decode_one_hint(q, k, v, row, length, kv_head, scale, got) -> str:
    """The likely bug behind a wrong decode_one: the output recomputed with one thing done another
    way (another KV head, no block table, a key more or less, another scale, the online softmax's
    rescale or final division left out); the one that matches names the bug."""
    import torch
    bs, hkv = k.shape[1], k.shape[2]

    def keys(n, table=True):
        return [(row[i // bs] if table else i // bs, i % bs) for i in range(n)]

    def softmax_attn(idx, head=kv_head, sc=scale):
        kk = torch.stack([k[b, r, head] for b, r in idx]).float()
        vv = torch.stack([v[b, r, head] for b, r in idx]).float()
        return torch.softmax((kk @ q.float()) * sc, 0) @ vv

    def online(rescale_acc=True, rescale_l=True, divide=True):
        m, l, acc = float("-inf"), 0.0, torch.zeros(q.shape[0])
        for b, r in keys(length):
            s = float(q.float() @ k[b, r, kv_head].float()) * scale
            m_new = max(m, s)
            alpha, p = math.exp(m - m_new), math.exp(s - m_new)
            l = l * (alpha if rescale_l else 1.0) + p
            acc = acc * (alpha if rescale_acc else 1.0) + p * v[b, r, kv_head].float()
            m = m_new
        return acc / l if divide else acc

    d = q.shape[0]
    variants = [(f"that is attention over KV head {h}: read k[..., kv_head, :] with the kv_head argument "
                 f"({kv_head}; query head i reads KV head i // group)", lambda h=h: softmax_attn(keys(length), head=h))
                for h in range(hkv) if h != kv_head]
    variants += [
        ("the keys were read from blocks 0, 1, 2, ... in order: go through the block table, "
         "block = row[n // block_size]", lambda: softmax_attn(keys(length, table=False))),
        (f"that is attention over the first {length - 1} keys: attend to all `length` keys, n in range(length)",
         lambda: softmax_attn(keys(length - 1)) if length > 1 else None),
        (f"that is attention over {length + 1} keys: attend to n in range(length), not one more",
         lambda: softmax_attn(keys(length + 1)) if length < len(row) * bs else None),
        ("the scores are not scaled: s = (q . k) * scale", lambda: softmax_attn(keys(length), sc=1.0)),
        ("the scores are divided by scale: s = (q . k) * scale (scale is already 1/sqrt(D))",
         lambda: softmax_attn(keys(length), sc=1 / scale)),
        (f"scale applied twice: s = (q . k) * scale once (scale = {scale:.4g})",
         lambda: softmax_attn(keys(length), sc=scale * scale)),
        ("acc is not rescaled when the max grows: acc = acc * exp(m_old - m_new) + p * v, like l",
         lambda: online(rescale_acc=False)),
        ("l is not rescaled when the max grows: l = l * exp(m_old - m_new) + p, like acc",
         lambda: online(rescale_l=False)),
        ("neither acc nor l is rescaled when the max grows: multiply both by exp(m_old - m_new)",
         lambda: online(rescale_acc=False, rescale_l=False)),
        ("the result is not normalized: return acc / l", lambda: online(divide=False)),
    ]
    for why, make in variants:
        try:
            alt = make()
        except (IndexError, RuntimeError):
            continue
        if alt is not None and alt.shape == (d,) and torch.allclose(got, alt, atol=1e-4, rtol=1e-4):
            return why
    return ("key n is k[row[n // block_size], n % block_size, kv_head]; scores are (q . k) * scale; keep the "
            "running max m, the sum l and acc, rescaling both by exp(m_old - m_new) when m grows.")


# -- notebook 04: a Triton kernel the learner completes ------------------------------------------------


def check_rmsnorm_kernel(kernel, seed: int = 0):
    """`kernel[(rows,)](x, w, out, H, eps, BLOCK=next_power_of_2(H))`: RMSNorm of each row of x
    [rows, H] into out, one program per row, against pagedlab's rms_norm_torch on row lengths that
    are and are not powers of two (1, 5, 16, 33, 100), several rows, a row of zeros (eps) and large
    values. Runs on the GPU, or in Triton's interpreter on a CPU (TRITON_INTERPRET=1)."""
    import torch
    import triton
    from ..kernels.rmsnorm import rms_norm_torch
    kernel = chapter.pick(kernel, "rmsnorm_kernel")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    eps = 1e-5
    cases = [(1, 1), (3, 5), (4, 16), (2, 33), (5, 100)]
    for rows, h in cases:
        x = torch.randn(rows, h, generator=g)
        if rows >= 3:
            x[1] = 0.0                               # a row of zeros: only eps keeps it finite
        if rows >= 4:
            x[2] *= 1e3                              # large values: the mean of squares in fp32
        w = torch.rand(h, generator=g) + 0.5
        x, w = x.to(device), w.to(device)
        out = torch.full_like(x, float("nan"))
        block = triton.next_power_of_2(h)
        try:
            kernel[(rows,)](x, w, out, h, eps, BLOCK=block)
        except Exception as e:
            raise chapter.raised("rmsnorm_kernel", e, f"rmsnorm_kernel on x of shape ({rows}, {h})") from None
        want = rms_norm_torch(x, w, eps)
        if torch.allclose(out, want, atol=1e-5, rtol=1e-5):
            continue
        if bool(out.isnan().all()):
            raise CheckFailed(chapter.not_written("rmsnorm_kernel", "it stored nothing: out is still all NaN"))
        where = f"rmsnorm_kernel on x of shape ({rows}, {h}) (BLOCK={block})"
        raise CheckFailed(f"{where}: {_rmsnorm_diagnosis(x, w, out, want, eps, block)}")
    chapter.passed("rmsnorm_kernel", f"{len(cases)} shapes (rows of 1 to 100, powers of two or not, a zero row, "
            "large values) equal pagedlab's rms_norm_torch")
    return kernel


def _flash_variants(q, k, v, block_m, block_n) -> dict:
    """Causal GQA attention of q [T, HQ, D] over k, v [T, HKV, D] computed the way the kernel walks
    it (query tiles of block_m, key tiles of block_n, online softmax), with one step done another
    way: the usual mistakes of the tile loop, in float32."""
    import torch
    t, hq, d = q.shape
    hkv = k.shape[1]
    q, k, v = q.float(), k.float(), v.float()

    def run(rescale_acc=True, rescale_l=True, mask="causal", scale=d ** -0.5, head=lambda h: h // (hq // hkv)):
        out = torch.zeros(t, hq, d)
        for h in range(hq):
            kh = head(h)
            for i in range(t):
                tile_end = (i // block_m + 1) * block_m          # the keys the query's tile walks
                m, l, acc = float("-inf"), torch.tensor(0.0), torch.zeros(d)
                for start in range(0, min(tile_end, t), block_n):
                    idx = torch.arange(start, min(start + block_n, t))
                    s = (k[idx, kh] @ q[i, h]) * scale
                    keep = idx <= i if mask == "causal" else idx < i if mask == "strict" else idx >= 0
                    s = torch.where(keep, s, torch.tensor(float("-inf")))
                    m_new = max(m, float(s.max()))
                    if m_new == float("-inf"):
                        continue
                    alpha = math.exp(m - m_new) if m != float("-inf") else 0.0
                    p = torch.exp(s - m_new)
                    l = l * (alpha if rescale_l else 1.0) + p.sum()
                    acc = acc * (alpha if rescale_acc else 1.0) + p @ v[idx, kh]
                    m = m_new
                out[i, h] = acc / l
        return out

    out = {"acc is not rescaled when a tile raises the max: acc = acc * alpha[:, None] + tl.dot(p, v), with "
           "alpha = tl.exp(m - m_new)": lambda: run(rescale_acc=False),
           "l is not rescaled when a tile raises the max: l = l * alpha + tl.sum(p, axis=1)": lambda: run(rescale_l=False),
           "the future is not masked: set s to -inf where the key comes after the query, "
           "tl.where(kn[None, :] <= offs_m[:, None], s, float('-inf'))": lambda: run(mask="none"),
           "the diagonal is masked too: a token sees itself -- keep kn <= offs_m, not kn < offs_m": lambda: run(mask="strict"),
           "the scores are not scaled: s = tl.dot(q, tl.trans(k)) * scale": lambda: run(scale=1.0)}
    if hq != hkv:
        out["query head h reads KV head h // (HQ // HKV) -- that is another KV head"] = lambda: run(head=lambda h: h % hkv)
    return out


def check_flash_kernel(kernel, seed: int = 0):
    """`kernel[(cdiv(T, BLOCK_M), HQ)](q, k, v, out, T, scale, HQ=, HKV=, D=, BLOCK_M=16, BLOCK_N=16)`:
    notebook 04's causal flash attention (one program per query tile and head, the key tiles walked
    with an online softmax), against torch's scaled_dot_product_attention on lengths inside one
    tile, across tiles and ragged (5, 16, 1, 33, 40), grouped heads and two head sizes. On a GPU in
    fp16 (tolerance 2e-2), in Triton's interpreter on a CPU in fp32 (1e-4)."""
    import torch
    import triton
    kernel = chapter.pick(kernel, "flash_attn_kernel")
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.float16) if gpu else ("cpu", torch.float32)
    tol = dict(atol=2e-2, rtol=2e-2) if gpu else dict(atol=1e-4, rtol=1e-4)
    g = torch.Generator().manual_seed(seed)
    bm = bn = 16
    # first a length where only a stub gives NaN everywhere (a masked diagonal leaves row 0 empty)
    cases = [(5, 2, 1, 16), (16, 2, 2, 16), (1, 1, 1, 16), (33, 4, 2, 16), (40, 3, 1, 32)]
    for t, hq, hkv, d in cases:
        q, k, v = (torch.randn(t, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv))
        out = torch.full_like(q, float("nan"))
        where = f"flash_attn_kernel on T={t}, HQ={hq}, HKV={hkv}, D={d} (BLOCK_M = BLOCK_N = 16)"
        try:
            kernel[(triton.cdiv(t, bm), hq)](q, k, v, out, t, d ** -0.5, HQ=hq, HKV=hkv, D=d, BLOCK_M=bm, BLOCK_N=bn)
        except Exception as e:
            raise chapter.raised("flash_attn_kernel", e, where) from None
        want = _gqa_reference(q.float(), k.float(), v.float())
        got = out.float()
        if torch.allclose(got, want, **tol):
            continue
        if bool(got.isnan().all()):
            raise CheckFailed(chapter.not_written("flash_attn_kernel", "every output is NaN: acc / l with l still 0 -- "
                              "the loop over key tiles updated nothing (or exp(-inf - (-inf)) made NaN)"))
        bug = next((why for why, make in _flash_variants(q.cpu(), k.cpu(), v.cpu(), bm, bn).items()
                    if torch.allclose(got.cpu(), make(), equal_nan=True, **tol)), None)
        raise CheckFailed(f"{where}: off by up to {(got - want).abs().nan_to_num(1e9).max().item():.3g}.\nHint: "
                          + (bug or "per key tile: s = tl.dot(q, tl.trans(k)) * scale; -inf where kn > offs_m or kn >= T; "
                             "m_new = max(m, row max of s); alpha = exp(m - m_new); p = exp(s - m_new[:, None]); "
                             "l = l * alpha + sum(p); acc = acc * alpha[:, None] + tl.dot(p, v); m = m_new."))
    chapter.passed("flash_attn_kernel", f"{len(cases)} shapes (one token, one tile, across tiles, ragged, grouped "
                   "heads, D 16 and 32) equal torch's scaled_dot_product_attention")
    return kernel


def _rmsnorm_diagnosis(x, w, out, want, eps, block) -> str:
    """What is wrong with out (expected: want), named by the likely bug."""
    import torch
    rows, h = x.shape
    bad = ~torch.isclose(out, want, atol=1e-5, rtol=1e-5)
    bad_rows = sorted({int(r) for r in bad.nonzero()[:, 0]})
    head = (f"rows {bad_rows} differ; row {bad_rows[0]}: got {out[bad_rows[0], :4].tolist()} ..., "
            f"expected {want[bad_rows[0], :4].tolist()} ...\n")
    ms = (x.float() ** 2).sum(-1, keepdim=True)

    def close(a):
        return bool(torch.allclose(out, a.to(out.dtype), atol=1e-5, rtol=1e-5, equal_nan=True))
    if out.isnan().any() and not out.isnan().all():
        if want[out.isnan().any(-1)].isfinite().all() and (x == 0).all(-1)[out.isnan().any(-1)].all():
            return head + "Hint: a row of zeros gives NaN: add eps inside the square root, 1 / sqrt(mean(x\u00b2) + eps)."
        return head + ("Hint: some elements were never stored: store all H values of every row "
                       "(out_ptr + row * H + offs, with mask = offs < H).")
    if not out.isfinite().all():
        return head + "Hint: a row of zeros gives inf: add eps inside the square root, 1 / sqrt(mean(x\u00b2) + eps)."
    if close(x * torch.rsqrt(ms / block + eps) * w):
        return head + f"Hint: the mean of x\u00b2 divides by H = {h}, the row's length -- not by BLOCK = {block}."
    if close(x * torch.rsqrt(ms / h + eps)):
        return head + "Hint: multiply by the weight w (loaded with the same offsets and mask as x)."
    if bad_rows and bad_rows[0] > 0 and not bad[0].any():
        return head + (f"Hint: row 0 is right, later rows are not: row r starts at x_ptr + r * H "
                       f"(H = {h} here, not BLOCK = {block}), and so does its output.")
    err = (out - want).abs().max().item()
    return head + (f"off by up to {err:.3g}.\nHint: rstd = 1 / sqrt(sum(x\u00b2) / H + eps) over the row in fp32, "
                   "then out = x * rstd * w.")


# -- notebook 02: reading a safetensors file by hand ---------------------------------------------------

def _safetensors_cases(folder, seed: int = 0):
    """(what, path, {name: tensor}) of small safetensors files, written by the library: bf16, fp16
    and fp32 tensors in one file (data past other tensors' bytes), a __metadata__ entry, a 1-number
    tensor, extreme bf16 values (huge, tiny, -0.0, inf) and a 3-d shape."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    files = [
        ("one bf16 matrix", {"w": torch.randn(3, 5, generator=g).to(torch.bfloat16)}, None),
        ("bf16, fp16 and fp32 in one file, with __metadata__",
         {"embed": torch.randn(4, 6, generator=g).to(torch.bfloat16), "norm": torch.rand(6, generator=g) + 0.5,
          "half": (torch.randn(2, 3, 2, generator=g) * 100).to(torch.float16),
          "z.last": torch.randn(7, generator=g).to(torch.bfloat16)}, {"format": "pt", "note": "made by the check"}),
        ("extreme bf16 values", {"x": torch.tensor([3e38, -3e38, 1e-38, -0.0, float("inf"), 1 / 3, -2.5, 1e-3],
                                                   dtype=torch.bfloat16)}, None),
        ("a single number", {"s": torch.tensor([7.0], dtype=torch.bfloat16)}, None),
    ]
    out = []
    for i, (what, tensors, meta) in enumerate(files):
        path = Path(folder) / f"case{i}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        out.append((what, path, tensors))
    return out


def check_read_tensor(fn):
    """`fn(path, name)` -> the tensor `name` of the safetensors file at `path` as fp32, read by hand
    (the 8-byte length, the JSON header, the bytes at data_offsets past the header; BF16 widened by
    the bit shift, F16 and F32 decoded), against the safetensors library on files the check writes."""
    import tempfile

    import torch
    from safetensors import safe_open
    fn = chapter.pick(fn, "read_tensor")
    with tempfile.TemporaryDirectory(prefix="pagedlab-check-") as folder:
        cases = _safetensors_cases(folder)
        for what, path, tensors in cases:
            with safe_open(str(path), framework="pt") as f:
                want_all = {n: f.get_tensor(n).float() for n in f.keys()}
            for name, want in want_all.items():
                where = f"read_tensor(path, {name!r}) on a file with {what}"
                try:
                    got = fn(path, name)
                except Exception as e:
                    raise chapter.raised("read_tensor", e, where, f"\n{_read_tensor_error_hint(e, name)}") from None
                if not isinstance(got, torch.Tensor):
                    raise CheckFailed(f"{where} returned {type(got).__name__}: return a torch tensor (fp32).")
                if tuple(got.shape) != tuple(want.shape):
                    raise CheckFailed(f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}.\n"
                                      "Hint: reshape the numbers to header[name]['shape'].")
                if not torch.equal(got.float(), want):
                    raise CheckFailed(f"{where}: got {got.flatten()[:4].tolist()} ..., expected "
                                      f"{want.flatten()[:4].tolist()} ...\n"
                                      f"{_read_tensor_value_hint(path, name, got, want_all)}")
    chapter.passed("read_tensor", f"{sum(len(t) for _, _, t in cases)} tensors in {len(cases)} files (BF16, F16, F32, "
            "__metadata__, extreme values) equal the safetensors library's")
    return fn


def _read_tensor_error_hint(e, name) -> str:
    import json
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
        return ("Hint: the first 8 bytes are the header's length N, an unsigned 64-bit little-endian integer "
                "(struct.unpack('<Q', f.read(8))); the next N bytes are the JSON.")
    if isinstance(e, KeyError):
        return (f"Hint: look {name!r} up in the parsed header: its keys are the tensor names (and '__metadata__', "
                "which is not a tensor).")
    return "Hint: read the header (8-byte length, JSON), then the bytes data_offsets name, past the header."


def _read_tensor_value_hint(path, name, got, want_all) -> str:
    """The likely bug behind wrong numbers, tested by decoding the file the wrong ways."""
    import json
    import struct

    import numpy as np
    import torch
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])[name]
    start, end = h["data_offsets"]

    def decode(b, dtype):
        if dtype == "BF16":
            return torch.from_numpy((np.frombuffer(b, "<u2").astype(np.uint32) << 16).view(np.float32).copy())
        return torch.from_numpy(np.frombuffer(b, {"F16": "<f2", "F32": "<f4"}[dtype]).astype(np.float32))

    flat = got.detach().float().flatten()

    def same(t):
        return t.numel() == flat.numel() and torch.equal(t, flat)
    if same(decode(raw[start:end], h["dtype"])):
        return ("Hint: data_offsets count from the end of the header, not from the start of the file: the "
                "tensor's bytes are at 8 + N + start .. 8 + N + end.")
    if h["dtype"] == "BF16":
        bits = torch.from_numpy(np.frombuffer(raw[8 + n + start:8 + n + end], "<u2").astype(np.float32))
        if same(bits):
            return "Hint: those are the raw 16-bit patterns as numbers: a bf16 is the TOP half of an fp32."
        return ("Hint: bf16 is the top half of an fp32: widen the 16 bits to 32 (uint32), shift them left by 16, "
                "then view the 32 bits as float32 -- no rounding, no scaling.")
    if h["dtype"] == "F16":
        return "Hint: F16 is IEEE half precision (numpy '<f2'): 5 exponent bits, not bf16's 8."
    return "Hint: F32 is four bytes per number, little-endian (numpy '<f4')."


# -- notebook 02: the header parse and the bf16 bit shift, each on its own -------------------------------

ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}         # bytes per number of the dtypes the course meets


def _st_header(buf: bytes) -> tuple[dict, int]:
    """The JSON header of a well-formed safetensors file and where its data starts (for the checks'
    own edits and diagnoses; the learner's parse_header is checked against the library)."""
    import json
    import struct
    (n,) = struct.unpack("<Q", buf[:8])
    return json.loads(buf[8:8 + n]), 8 + n


def _st_rebuild(buf: bytes, edit) -> bytes:
    """buf with its JSON header changed by edit(header) (padded with spaces to a multiple of 8, as
    the library writes it) and the same data bytes after it."""
    import json
    import struct
    header, start = _st_header(buf)
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + buf[start:]


def _random_st_tensors(g, rng, n: int) -> dict:
    """n tensors of random dtypes (BF16, F16, F32) at irregular shapes: 0-d to 3-d, sides 1-7."""
    import torch
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    out = {}
    for i in range(n):
        shape = [rng.randint(1, 7) for _ in range(rng.randint(0, 3))]
        out[f"layers.{i}.w{rng.randint(0, 99)}"] = (torch.randn(shape, generator=g) * 3).to(rng.choice(dtypes))
    return out


def _parse_header_cases(seed: int = 0):
    """(valid, broken): valid = [(what, file bytes)] written by the safetensors library; broken =
    [(what, bytes, hint)] cut or edited from a valid file, each refused by the library."""
    import random

    import torch
    from safetensors.torch import save
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    valid = [
        ("one fp32 matrix", save({"w": torch.randn(3, 5, generator=g)})),
        ("BF16, F16 and F32 tensors and a __metadata__ entry",
         save({"embed": torch.randn(4, 6, generator=g).to(torch.bfloat16), "norm": torch.rand(6, generator=g),
               "half": torch.randn(2, 3, 2, generator=g).to(torch.float16)},
              metadata={"format": "pt", "note": "made by the check"})),
        ("an empty tensor (shape [0, 4]) and a 0-d scalar (shape [])",
         save({"empty": torch.zeros(0, 4, dtype=torch.bfloat16), "scalar": torch.tensor(2.5),
               "v": torch.randn(7, generator=g).to(torch.bfloat16)})),
    ] + [(f"{n} random tensors at irregular shapes", save(_random_st_tensors(g, rng, n))) for n in (1, 5, 9)]
    base = valid[1][1]
    header, start = _st_header(base)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    last, first = names[-1], names[0]
    size = len(base) - start

    def moved(h):                                     # the last tensor's bytes placed past the file's end
        a, b = h[last]["data_offsets"]
        h[last]["data_offsets"] = [a + size, b + size]

    def reshaped(h):                                  # a shape that does not fit the tensor's bytes
        h[first]["shape"] = [d + 1 for d in h[first]["shape"]]

    def swapped(h):
        h[first]["data_offsets"] = h[first]["data_offsets"][::-1]
    bounds = ("Hint: check that every tensor's bytes lie inside the file: 0 <= start <= end and 8 + N + end "
              "<= len(buf); otherwise raise ValueError (a cut download, or a bad header).")
    broken = [
        ("a file of 5 bytes (no room for the 8-byte length)", base[:5],
         "Hint: a file shorter than 8 bytes has no header length: check len(buf) >= 8 first and raise "
         "ValueError (struct.unpack of fewer bytes raises struct.error, not a ValueError)."),
        ("a file cut inside its JSON header", base[:start - 9],
         "Hint: the header length N may point past the end of a cut file: check 8 + N <= len(buf) and raise "
         "ValueError before parsing the JSON."),
        ("a file cut 3 bytes before the end of its data", base[:-3], bounds),
        (f"offsets of {last!r} past the end of the data", _st_rebuild(base, moved), bounds),
        (f"offsets swapped (start > end) for {first!r}", _st_rebuild(base, swapped), bounds),
        (f"a shape of {first!r} that does not fit its bytes", _st_rebuild(base, reshaped),
         "Hint: end - start must be the tensor's size in bytes: prod(shape) * bytes per number (BF16 and F16 "
         "2, F32 4); otherwise raise ValueError (the header lies about the tensor)."),
    ]
    return valid, broken


def _library_refuses(buf: bytes) -> bool:
    from safetensors.torch import load
    try:
        load(buf)
    except Exception:
        return True
    return False


def check_parse_header(fn, seed: int = 0):
    """`fn(buf)` -> {name: (dtype, shape, start, end)} for the bytes of a safetensors file, start and
    end counted from the start of the file (so buf[start:end] are the tensor's bytes), __metadata__
    left out; a ValueError for a file that is cut or whose header does not fit its bytes. Against
    the safetensors library: every tensor's dtype, shape and bytes, on files it wrote (random
    dtypes and irregular shapes, an empty tensor, a 0-d scalar, __metadata__) and on files it refuses."""
    import torch
    from safetensors.torch import load
    fn = chapter.pick(fn, "parse_header")
    valid, broken = _parse_header_cases(seed)
    for what, buf in valid:
        where = f"parse_header(buf) on a file with {what}"
        header, start = _st_header(buf)
        try:
            got = fn(buf)
        except Exception as e:
            raise chapter.raised("parse_header", e, where, f"\n{_parse_header_error_hint(e, header)}") from None
        want = load(buf)
        if not isinstance(got, dict):
            raise CheckFailed(f"{where} returned {type(got).__name__}: return a dict name -> (dtype, shape, start, end).")
        if "__metadata__" in got:
            raise CheckFailed(f"{where}: the result has a '__metadata__' entry.\nHint: __metadata__ holds free-form "
                              "strings, not a tensor: leave it out.")
        if set(got) != set(want):
            raise CheckFailed(f"{where}: tensors {sorted(got)}, expected {sorted(want)}.\nHint: one entry per key of "
                              "the JSON header (but __metadata__).")
        for name, t in want.items():
            try:
                dtype, shape, a, b = got[name]
            except (TypeError, ValueError):
                raise CheckFailed(f"{where}: [{name!r}] is {got[name]!r}; expected a tuple (dtype, shape, start, end)."
                                  ) from None
            if dtype != header[name]["dtype"] or list(shape) != list(t.shape):
                raise CheckFailed(f"{where}: [{name!r}] has dtype {dtype!r}, shape {list(shape)}; expected "
                                  f"{header[name]['dtype']!r}, {list(t.shape)}.\nHint: copy 'dtype' and 'shape' "
                                  "from the tensor's JSON entry.")
            s, e = (o + start for o in header[name]["data_offsets"])
            if (a, b) != (s, e) or buf[a:b] != t.contiguous().view(-1).view(torch.uint8).numpy().tobytes():
                raise CheckFailed(f"{where}: [{name!r}] at bytes {a}..{b}, expected {s}..{e} (the header is "
                                  f"{start - 8} bytes).\n"
                                  f"{_parse_header_offset_hint(a, b, header[name]['data_offsets'], start)}")
    for what, buf, hint in broken:
        if not _library_refuses(buf):               # pragma: no cover  (every case is refused by the library)
            continue
        where = f"parse_header(buf) on {what}"
        try:
            got = fn(buf)
        except ValueError:
            continue
        except Exception as e:
            raise chapter.raised("parse_header", e, where, f" -- a broken file must raise ValueError.\n{hint}") from None
        raise CheckFailed(f"{where} returned {type(got).__name__} instead of raising ValueError (the safetensors "
                          f"library refuses that file).\n{hint}")
    chapter.passed("parse_header", f"{len(valid)} files equal the safetensors library's dtypes, shapes and bytes (random "
                   f"irregular shapes, empty, 0-d, __metadata__); {len(broken)} broken files refused")
    return fn


def _parse_header_error_hint(e, header) -> str:
    import json
    import struct
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError, struct.error)):
        return ("Hint: the first 8 bytes are the header's length N, an unsigned 64-bit little-endian integer "
                "(struct.unpack('<Q', buf[:8])); the next N bytes are the JSON.")
    if any(0 in h["shape"] for k, h in header.items() if k != "__metadata__") and isinstance(e, ValueError):
        return ("Hint: an empty tensor (a 0 in its shape) has no bytes: start == end is allowed, and "
                "prod(shape) is 0.")
    if "__metadata__" in header:
        return ("Hint: skip the '__metadata__' key: it holds free-form strings (no dtype, shape or offsets), "
                "not a tensor.")
    return "Hint: read N from the first 8 bytes, json.loads(buf[8:8 + N]), then one entry per tensor."


def _parse_header_offset_hint(a, b, offsets, start) -> str:
    s, e = offsets
    if (a, b) == (s, e):
        return ("Hint: data_offsets count from the end of the header, not from the start of the file: add "
                "8 + N (the length bytes and the JSON).")
    if (a, b) == (s + start - 8, e + start - 8):
        return "Hint: add 8 + N, not N: the 8 bytes of the length come before the JSON."
    return "Hint: start, end = data_offsets, each plus 8 + N (where the data begins)."


def _bf16_variants(raw: bytes) -> dict:
    """What raw bf16 bytes become when decoded one wrong way or another (name -> fp32 numpy array)."""
    import numpy as np
    u = np.frombuffer(raw, "<u2").astype(np.uint32)
    return {"raw": u.astype(np.float32),
            "low": u.view(np.float32),
            "astype": (u << 16).astype(np.float32),
            "fp16": np.frombuffer(raw, "<f2").astype(np.float32),
            "big": (np.frombuffer(raw, ">u2").astype(np.uint32) << 16).view(np.float32),
            "shift8": (u << 8).view(np.float32)}


_BF16_HINTS = {
    "raw": "those are the raw 16-bit patterns as numbers: a bf16 is the TOP half of an fp32 -- shift it up.",
    "low": "the 16 bits sit in the LOW half of the 32-bit word (tiny subnormal numbers): shift them up by 16 first.",
    "astype": "after the shift, reinterpret the 32 bits as a float (.view(np.float32)); astype converts the "
              "integer's value (1065353216 for 1.0) instead.",
    "fp16": "bf16 is not fp16: it has 8 exponent bits (fp32's), fp16 has 5 -- widen to uint32 and shift by 16, "
            "do not decode as '<f2'.",
    "big": "safetensors is little-endian: read the 16-bit words as '<u2' (or np.uint16 on a little-endian machine).",
    "shift8": "shift by 16, not 8: the bf16 bits become the top 16 of the 32.",
}


def check_bf16_to_fp32(fn, seed: int = 0):
    """`fn(raw)` -> a 1-d fp32 torch tensor from the bytes of n bf16 numbers (2n bytes, little-endian),
    by the bit shift. Against torch's own bf16 -> fp32 conversion, bit for bit (NaN, infinities,
    -0.0, subnormals and bf16's largest and smallest included), at lengths 0, 1 and irregular ones."""
    import numpy as np
    import torch
    fn = chapter.pick(fn, "bf16_to_fp32")
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([1.0, -2.5, 1 / 3, 3.3895e38, -3.3895e38, 1.1755e-38, 9.2e-41, -0.0, 0.0,
                            float("inf"), float("-inf"), float("nan")]).to(torch.bfloat16)
    cases = [("1.0 alone", torch.tensor([1.0]).to(torch.bfloat16)),
             ("extremes: largest, smallest normal, subnormal, -0.0, +-inf, NaN", special),
             ("no numbers at all (0 bytes)", torch.zeros(0, dtype=torch.bfloat16)),
             ("13 random numbers", (torch.randn(13, generator=g) * 10).to(torch.bfloat16)),
             ("257 random numbers at many scales",
              (torch.randn(257, generator=g) * torch.logspace(-30, 30, 257)).to(torch.bfloat16))]
    for what, t in cases:
        raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
        want = t.float()
        where = f"bf16_to_fp32(raw) on {what} ({len(raw)} bytes)"
        got = chapter.call(fn, "bf16_to_fp32", raw)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.float32 or tuple(got.shape) != tuple(want.shape):
            raise CheckFailed(f"{where} returned {type(got).__name__} {getattr(got, 'dtype', '')} "
                              f"{tuple(getattr(got, 'shape', ()))}; expected a float32 tensor of shape "
                              f"{tuple(want.shape)} (one number per 2 bytes).\nHint: torch.from_numpy(arr.copy()) "
                              "of the float32 array.")
        if torch.equal(got.view(torch.int32), want.view(torch.int32)):
            continue
        flat = got.numpy()
        bug = next((k for k, v in _bf16_variants(raw).items()
                    if np.array_equal(v.view(np.uint32), flat.view(np.uint32))), None)
        hint = _BF16_HINTS.get(bug, "np.frombuffer(raw, '<u2').astype(np.uint32) << 16, then .view(np.float32): "
                                    "the bits move, the value is not computed.")
        bad = int((got.view(torch.int32) != want.view(torch.int32)).nonzero()[0])
        raise CheckFailed(f"{where}: number {bad} is {got[bad].item()!r}, expected {want[bad].item()!r} (bits "
                          f"0x{int(want.view(torch.int32)[bad]) & 0xffffffff:08x}).\nHint: {hint}")
    chapter.passed("bf16_to_fp32", f"{len(cases)} cases equal torch's bf16 -> fp32 bit for bit (NaN, +-inf, -0.0, "
                   "subnormals, 0 and 257 numbers)")
    return fn


# -- notebook 01: the byte-pair merge loop ---------------------------------------------------------

BPE_TEXT = ("the cat sat on the mat. the dog ate the bread; then the cat and the dog slept in the "
            "thin sun. aaaa aaaaa banana bandana 2024 2025 there these those. ")


def toy_ranks(merges: int = 80, text: str = BPE_TEXT) -> dict:
    """A small byte-level BPE vocabulary, learned from `text` the way BPE is trained: the 256 single
    bytes (ranks 0-255), then `merges` times the most frequent adjacent pair (ties: the first seen)
    becomes a token with the next rank; then a few tokens over the letters v-z whose ranks are not
    in left-to-right order (so that lowest-rank-first, leftmost-first, highest-first and rightmost-
    first merging give four different results on "wyzyyy"). Deterministic: the same on every machine."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in text.split(" ") if w]
    for _ in range(merges):
        counts: dict = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[a + b] = counts.get(a + b, 0) + 1
        counts = {p: c for p, c in counts.items() if p not in ranks}
        if not counts:
            break
        best = max(counts, key=counts.get)
        ranks[best] = len(ranks)
        new = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] + w[i + 1] == best:
                    out.append(best)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new.append(out)
        words = new
    for t in ("xy yz wv zx zy yw wx zz wz ww yv vv yy wy vwx xyz wxy yzv zvw").split():
        ranks[t.encode()] = len(ranks)
    return ranks


def _bpe_pieces() -> list[bytes]:
    words = ["wyzyyy", "the", " the", "cat", " sat", "there", " these", "thin", "banana", " bandana", "2024", "aaaa",
             "aaaaa", "aaaaaaa", "x", "", " ", "zzz", "the cat", "caf\u00e9", "\u2615", "breadth", "ththth"]
    return [w.encode() for w in words]


def check_bpe_piece(fn):
    """`fn(piece: bytes, ranks: dict[bytes, int])` -> token ids: the merge loop of byte-pair encoding
    (start from single bytes; repeatedly merge the adjacent pair whose concatenation has the lowest
    rank, the leftmost of equals; stop when no pair is in ranks), against tiktoken (the BPE behind
    pagedlab's Llama 3 tokenizer) on a small vocabulary learned here -- and on Llama 3's own when
    its file is installed."""
    import tiktoken
    fn = chapter.pick(fn, "bpe_piece")
    vocabs = [("a small vocabulary (toy_ranks())", toy_ranks())]
    try:
        from ..tokenizer import llama3_tokenizer_file
        import base64
        real = {}
        for line in llama3_tokenizer_file().read_bytes().splitlines():
            tok, rank = line.split()
            real[base64.b64decode(tok)] = int(rank)
        vocabs.append(("Llama 3's vocabulary", real))
    except Exception:                           # no llama-models: the small vocabulary alone
        pass
    n = 0
    for what, ranks in vocabs:
        ref = tiktoken.Encoding("check", pat_str=r"[\s\S]+", mergeable_ranks=ranks, special_tokens={})
        for piece in _bpe_pieces():
            want = ref._encode_bytes(piece) if piece else []
            got = chapter.call(fn, "bpe_piece", piece, ranks)
            n += 1
            if got is None or list(got) != want:
                raise CheckFailed(f"bpe_piece({piece!r}, ranks) with {what}: got {got}, expected {want}.\n"
                                  f"{_bpe_hint(piece, ranks, got, want)}")
    chapter.passed("bpe_piece", f"{n} pieces on {len(vocabs)} vocabular{'ies' if len(vocabs) > 1 else 'y'} equal tiktoken's BPE")
    return fn


def _bpe_variants(piece: bytes, ranks: dict) -> dict:
    """What the likely wrong merge loops give on `piece`."""
    def run(choose, one_pass=False):
        parts = [bytes([b]) for b in piece]
        while len(parts) > 1:
            pairs = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                     if parts[i] + parts[i + 1] in ranks]
            if not pairs:
                break
            i = choose(pairs)[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
            if one_pass:
                break
        return [ranks[p] for p in parts]
    return {"first": run(lambda ps: ps[0]), "highest": run(lambda ps: max(ps, key=lambda p: (p[0], -p[1]))),
            "rightmost": run(lambda ps: min(ps, key=lambda p: (p[0], -p[1]))),
            "once": run(lambda ps: min(ps), one_pass=True)}


def _bpe_hint(piece, ranks, got, want) -> str:
    if got is not None and len(got) and isinstance(list(got)[0], (bytes, bytearray)):
        return "Hint: return the tokens' ids -- ranks[part] for each part -- not their bytes."
    v = _bpe_variants(piece, ranks) if got is not None else {}
    got = list(got) if got is not None else None
    if got == v.get("first"):
        return ("Hint: that merges the FIRST pair found in the vocabulary; BPE merges the pair whose "
                "concatenation has the LOWEST rank (learned earliest), wherever it is.")
    if got == v.get("highest"):
        return "Hint: that merges the pair with the highest rank; BPE takes the LOWEST rank first."
    if got == v.get("rightmost"):
        return "Hint: when two pairs have the same (lowest) rank, merge the LEFTMOST one."
    if got == v.get("once"):
        return ("Hint: one merge is not the end: repeat -- find the lowest-rank pair again among the new parts "
                "-- until no adjacent pair is in the vocabulary.")
    return ("Hint: start from single bytes, [bytes([b]) for b in piece]; repeat: among adjacent pairs whose "
            "concatenation is in ranks take the lowest rank (leftmost of equals) and merge it; stop when none "
            "is left; return [ranks[p] for p in parts].")


# -- notebook 01: the prompt queue -----------------------------------------------------------------

def _admit_cases():
    """(what, prompt, vocab, max_len): prompts an engine must take and ones it must refuse."""
    return [("a prompt", [5, 6, 7], 50, 16),
            ("a second prompt: it waits BEHIND the first", [9, 9], 50, 16),
            ("the last id of the vocabulary", [0, 49], 50, 16),
            ("an id equal to the vocabulary size", [3, 50], 50, 16),
            ("a negative id", [3, -1, 4], 50, 16),
            ("an empty prompt", [], 50, 16),
            ("a prompt one shorter than max_len", list(range(15)), 50, 16),
            ("a prompt of exactly max_len tokens: no room for a new token", list(range(16)), 50, 16),
            ("a third prompt", [1], 50, 16)]


def _admit_hint(what, prompt, vocab, max_len, accepted) -> str:
    if accepted:
        if not prompt:
            return "refuse an empty prompt: there is nothing to prefill."
        if any(t < 0 for t in prompt):
            return "token ids are 0 .. vocab - 1: refuse a negative id too (0 <= t < vocab for every t)."
        if any(t >= vocab for t in prompt):
            return (f"the vocabulary's ids are 0 .. {vocab - 1}: an id == vocab ({vocab}) is outside it -- "
                    "refuse t >= vocab (an off-by-one with t > vocab lets it through).")
        return (f"a sequence holds at most max_len = {max_len} tokens, the prompt AND at least one new token: "
                f"refuse len(prompt) >= max_len.")
    if len(prompt) == max_len - 1:
        return (f"a prompt of max_len - 1 = {max_len - 1} tokens fits (one token left for the answer): refuse "
                "only len(prompt) >= max_len.")
    return "this prompt is fine: every id in [0, vocab), not empty, shorter than max_len."


def check_admit(fn):
    """`fn(queue, prompt, vocab, max_len)`: check a prompt of token ids and put it at the BACK of the
    queue (a deque), or raise ValueError -- with the queue untouched -- when the prompt is empty,
    holds an id outside [0, vocab), or leaves no room for a new token (len >= max_len): the
    decisions of pagedlab's engine (engine.check_request) on prompts at each edge, in order."""
    from ..engine import check_request
    fn = chapter.pick(fn, "admit")
    queue, want_queue = deque(), []
    for what, prompt, vocab, max_len in _admit_cases():
        try:
            check_request(list(prompt), None, False, None, vocab, max_len)
            ok = True
        except ValueError:
            ok = False
        before = list(queue)
        where = f"admit(queue, {prompt if len(prompt) < 8 else prompt[:4] + ['...']}, vocab={vocab}, max_len={max_len})   # {what}"
        try:
            fn(queue, list(prompt), vocab, max_len)
            accepted = True
        except ValueError:
            accepted = False
        except Exception as e:
            raise chapter.raised("admit", e, where, "\nHint: refuse a bad prompt with raise ValueError(...), "
                                 "saying what is wrong.") from None
        if accepted != ok:
            raise CheckFailed(f"{where}: {'took' if accepted else 'refused'} it; pagedlab's engine "
                              f"{'takes' if ok else 'refuses'} it.\nHint: "
                              f"{_admit_hint(what, prompt, vocab, max_len, accepted)}")
        if ok:
            want_queue.append(list(prompt))
        if not ok and list(queue) != before:
            raise CheckFailed(f"{where}: raised, but changed the queue first (now {list(queue)}).\nHint: check "
                              "the whole prompt BEFORE you append it: a refused prompt leaves no trace.")
        if [list(p) for p in queue] != want_queue:
            hint = ("the queue is first in, first out: append new prompts at the BACK (queue.append); the engine "
                    "takes from the front (popleft)." if sorted(map(tuple, queue)) == sorted(map(tuple, want_queue))
                    else "put the prompt itself (its list of ids) in the queue, once.")
            raise CheckFailed(f"{where}: the queue is now {list(queue)}, expected {want_queue}.\nHint: {hint}")
    chapter.passed("admit", f"{len(_admit_cases())} prompts at each edge (last id, id = vocab, negative, empty, "
                   "max_len - 1 and max_len tokens) taken or refused as pagedlab's engine does, FIFO")
    return fn


# -- notebook 03: RMSNorm, then one decoder layer from the learner's pieces -----------------------------

def _rms_norm_variants(x, w, eps) -> dict:
    """RMSNorm of x over its last dimension with one thing done another way: the usual mistakes."""
    import torch
    ms = x.pow(2).mean(-1, keepdim=True)
    return {"sum": x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w,
            "no_eps": x * torch.rsqrt(ms) * w,
            "eps_outside": x / (ms.sqrt() + eps) * w,
            "no_weight": x * torch.rsqrt(ms + eps),
            "centred": (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps) * w,
            "no_rsqrt": x / (ms + eps) * w,
            "first_dim": x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps) * w}


_RMS_NORM_HINTS = {
    "sum": "divide by the root of the MEAN of x\u00b2 over the last dimension (sum / H), not of the sum.",
    "no_eps": "add eps inside the square root: sqrt(mean(x\u00b2) + eps) -- an all-zero row then gives zeros, not NaN.",
    "eps_outside": "eps goes inside the square root: x / sqrt(mean(x\u00b2) + eps), not x / (sqrt(mean(x\u00b2)) + eps).",
    "no_weight": "multiply by the learned weight w at the end (one number per feature).",
    "centred": "RMSNorm does not subtract the mean (that is LayerNorm): x / sqrt(mean(x\u00b2) + eps) * w.",
    "no_rsqrt": "take the square root: x / sqrt(mean(x\u00b2) + eps), not x / (mean(x\u00b2) + eps).",
    "first_dim": "normalize each token's vector: the mean runs over the LAST dimension (mean(-1, keepdim=True)).",
}


def check_rms_norm(fn, seed: int = 0):
    """`fn(x [..., H], w [H], eps)` -> x / sqrt(mean(x\u00b2 over the last dimension) + eps) * w, against
    pagedlab's rms_norm_torch: one token, irregular T and H, a 3-d input (heads), a row of zeros (eps
    keeps it finite), rows of huge and tiny numbers, eps 1e-5 and 1e-6."""
    import torch
    from ..kernels.rmsnorm import rms_norm_torch
    fn = chapter.pick(fn, "rms_norm")
    g = torch.Generator().manual_seed(seed)
    cases = [("one token", (1, 8), 1e-5, 1.0), ("7 tokens of 48 features", (7, 48), 1e-5, 1.0),
             ("13 tokens of 5 features", (13, 5), 1e-6, 1.0), ("3 tokens, 4 heads of 6 (a 3-d input)", (3, 4, 6), 1e-5, 1.0),
             ("6 tokens, the second all zeros", (6, 9), 1e-5, 0.0), ("4 tokens of huge numbers", (4, 11), 1e-6, 1e4),
             ("4 tokens of tiny numbers (eps matters)", (4, 11), 1e-5, 1e-3)]
    for what, shape, eps, scale in cases:
        x = torch.randn(shape, generator=g) * (scale or 1.0)
        if scale == 0.0:
            x[1] = 0.0
        w = 1.0 + 0.5 * torch.randn(shape[-1], generator=g)
        where = f"rms_norm(x {list(shape)}, w [{shape[-1]}], eps={eps:g})   # {what}"
        try:
            got = fn(x.clone(), w.clone(), eps)
        except Exception as e:
            then = ("\nHint: keep the reduced dimension -- x.pow(2).mean(-1, keepdim=True) is [T, 1], so it divides "
                    "each row; without keepdim it is [T] and lines up with the features instead."
                    if "must match the size" in str(e) else "")
            raise chapter.raised("rms_norm", e, where, then) from None
        want = rms_norm_torch(x, w, eps)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(x.shape):
            raise CheckFailed(f"{where} returned {type(got).__name__} {tuple(getattr(got, 'shape', ()))}; expected a "
                              f"tensor of x's shape {tuple(x.shape)}.\nHint: mean(-1, keepdim=True) keeps the last "
                              "dimension, so the division broadcasts over it.")
        if torch.allclose(got.float(), want, atol=1e-5, rtol=1e-5):
            continue
        variants = _rms_norm_variants(x, w, eps)
        bug = next((k for k, v in variants.items()
                    if torch.allclose(got.float(), v, atol=1e-5, rtol=1e-5, equal_nan=True)), None)
        hint = _RMS_NORM_HINTS.get(bug, "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.")
        err = (got.float() - want).abs().nan_to_num(float("inf")).max().item()
        raise CheckFailed(f"{where}: off by up to {err:.3g}.\nHint: {hint}")
    chapter.passed("rms_norm", f"{len(cases)} cases equal pagedlab's rms_norm_torch (one token, irregular shapes, 3-d, "
                   "a zero row, huge and tiny numbers)")
    return fn


def _layer_reference(h, W, i, pos, freqs, cfg, bug=None):
    """One Llama decoder layer in plain torch (pagedlab's rms_norm_torch and rope_torch, torch's
    attention), or with one planted bug: the usual mistakes, to name the learner's."""
    import torch
    import torch.nn.functional as F
    from ..kernels.rmsnorm import rms_norm_torch
    from ..kernels.rope import rope_torch
    p, t, d, eps = f"model.layers.{i}.", h.shape[0], cfg.head_dim, cfg.rms_norm_eps
    ang = pos[:, None].double() * freqs[None, :].double()
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1).float()
    rows = torch.arange(t)
    x = rms_norm_torch(h, W[p + "input_layernorm.weight"], eps)
    q = (x @ W[p + "self_attn.q_proj.weight"].T).view(t, cfg.num_heads, d)
    k = (x @ W[p + "self_attn.k_proj.weight"].T).view(t, cfg.num_kv_heads, d)
    v = (x @ W[p + "self_attn.v_proj.weight"].T).view(t, cfg.num_kv_heads, d)
    rq, rk = rope_torch(q, k, rows, cos_sin)
    if bug == "no_rope_k":
        rk = k
    if bug == "rope_v":
        v = rope_torch(v, v, rows, cos_sin)[0]
    wo = W[p + "self_attn.o_proj.weight"]
    o = _gqa_reference(rq, rk, v).reshape(t, -1) @ (wo if bug == "no_transpose" else wo.T)
    h2 = o if bug == "no_residual_attn" else h + o
    norm_w = W[p + ("input_layernorm.weight" if bug == "same_norm" else "post_attention_layernorm.weight")]
    x = rms_norm_torch(h if bug == "stale_norm" else h2, norm_w, eps)
    gate, up = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
    act = F.silu(up) * gate if bug == "silu_up" else (gate * up if bug == "no_silu" else F.silu(gate) * up)
    m = act @ W[p + "mlp.down_proj.weight"].T
    return m if bug == "no_residual_mlp" else h2 + m


_LAYER_HINTS = {
    "no_residual_attn": "add the attention's output to the residual: h = h + attention(...) Wo (a layer ADDS to h).",
    "no_residual_mlp": "add the MLP's output to the residual: return h + down(...), not down(...) alone.",
    "same_norm": "the MLP's norm has its own weight: post_attention_layernorm, not input_layernorm again.",
    "stale_norm": "the MLP reads the norm of h AFTER the attention's residual add (the updated h), not of the layer's input.",
    "no_rope_k": "rotate k as well as q: q . k depends on the distance between tokens only when both are rotated.",
    "rope_v": "RoPE rotates q and k only; v is used as it is.",
    "silu_up": "SiLU goes on the gate: down(silu(x Wg) * (x Wu)), not silu(x Wu) * (x Wg).",
    "no_silu": "the MLP is SwiGLU: down(silu(x Wg) * (x Wu)) -- the SiLU is missing.",
    "no_transpose": "a weight is stored [out, in]: multiply x @ W.T (o_proj is square here, so o @ Wo runs -- and is wrong).",
}


def _layer_cases():
    """(what, ModelConfig, T): irregular shapes -- grouped heads, one head for all (MQA), heads x
    head_dim != hidden, llama3 RoPE scaling, one token."""
    from ..config import LLAMA_3_2_1B, ModelConfig
    return [("6 query heads on 2 KV heads, 7 tokens",
             ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=72, num_layers=2, num_heads=6,
                         num_kv_heads=2, name="check-gqa"), 7),
            ("one token, 4 heads of 10 (no grouping)",
             ModelConfig(vocab_size=37, hidden_size=40, intermediate_size=56, num_layers=1, num_heads=4,
                         num_kv_heads=4, name="check-mha"), 1),
            ("one KV head for 4 query heads of 16 (64 != hidden 48), llama3 RoPE scaling, 13 tokens",
             ModelConfig(vocab_size=53, hidden_size=48, intermediate_size=40, num_layers=2, num_heads=4,
                         num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=LLAMA_3_2_1B.rope_theta,
                         rope_scaling=LLAMA_3_2_1B.rope_scaling, name="check-mqa"), 13)]


def _pagedlab_logits(cfg, tensors, ids):
    """pagedlab's LlamaModel (fp32, CPU, torch kernels) on one prompt: the logits at every position."""
    import torch
    from ..attention import AttentionMetadata
    from ..kv_cache import KVCache, blocks_needed
    from ..model import LlamaModel
    t = len(ids)
    model = LlamaModel(cfg, tensors, "cpu", torch.float32, max_positions=max(64, t))
    nb = blocks_needed(t, 16)
    cache = KVCache(cfg.num_layers, nb, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = torch.arange(nb, dtype=torch.int32)[None]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)     # noqa: E731
    pos = torch.arange(t)
    meta = AttentionMetadata(pos, t, table, i32([0, t]), i32([t]), t, table[:0], i32([]), 0)
    return model.forward(torch.tensor(ids), pos, cache, meta)


def check_decoder_layer(fn, seed: int = 0):
    """`fn(h [T, hidden], W, i, pos [T], freqs [head_dim/2], cfg)` -> h after decoder layer i (W: the
    model's tensors by their Hugging Face names). Every layer of a random-weight model run through fn,
    then the final norm and the head, against pagedlab's LlamaModel on the same weights (fp32): grouped
    heads, one token, one KV head for all, heads x head_dim != hidden, llama3-scaled RoPE."""
    import torch
    from ..kernels.rmsnorm import rms_norm_torch
    from ..kernels.rope import rope_inv_freq
    from ..weights import random_checkpoint
    fn = chapter.pick(fn, "decoder_layer")
    g = torch.Generator().manual_seed(seed)
    cases = _layer_cases()
    for what, cfg, t in cases:
        W = random_checkpoint(cfg, seed=seed).tensors
        ids = torch.randint(0, cfg.vocab_size, (t,), generator=g).tolist()
        pos = torch.arange(t)
        freqs = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        want = _pagedlab_logits(cfg, W, ids)
        h = W["model.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(cfg.num_layers):
            where = f"decoder_layer(h [{t}, {cfg.hidden_size}], W, {i}, pos, freqs, cfg)   # {what}"
            try:
                out = fn(h.clone(), W, i, pos.clone(), freqs.clone(), cfg)
            except Exception as e:
                raise chapter.raised("decoder_layer", e, where, f"\n{_layer_error_hint(e)}") from None
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(h.shape):
                raise CheckFailed(f"{where} returned {type(out).__name__} {tuple(getattr(out, 'shape', ()))}; expected "
                                  f"h's shape {tuple(h.shape)}.\nHint: o.reshape(T, num_heads * head_dim) @ Wo.T brings "
                                  "the heads back to hidden_size.")
            ref = _layer_reference(h, W, i, pos, freqs, cfg)
            if not torch.allclose(out.float(), ref, atol=1e-4, rtol=1e-4):
                bug = next((b for b in _LAYER_HINTS
                            if torch.allclose(out.float(), _layer_reference(h, W, i, pos, freqs, cfg, b), atol=1e-4, rtol=1e-4)),
                           None)
                hint = _LAYER_HINTS.get(bug, "x = rms_norm(h, input_layernorm); q, k, v = x Wq, x Wk, x Wv (heads); h = h + "
                                        "attention(rope(q), rope(k), v) Wo; x = rms_norm(h, post_attention_layernorm); "
                                        "h = h + (silu(x Wg) * x Wu) Wd.")
                raise CheckFailed(f"{where}: off by up to {(out.float() - ref).abs().nan_to_num(float('inf')).max().item():.3g}"
                                  f" from layer {i} of pagedlab's model.\nHint: {hint}")
            h = out.float()
        head = W["model.embed_tokens.weight"] if cfg.tie_word_embeddings else W["lm_head.weight"]
        logits = rms_norm_torch(h, W["model.norm.weight"], cfg.rms_norm_eps) @ head.T
        err = ((logits.double() - want.double()).norm() / want.double().norm()).item()
        if err > 1e-5:                    # pragma: no cover  (each layer matched the reference above)
            raise CheckFailed(f"{what}: your layers' logits differ from pagedlab's LlamaModel by {err:.2e} (relative).")
    chapter.passed("decoder_layer", f"{len(cases)} random-weight models, every layer yours: the logits equal pagedlab's "
                   "LlamaModel (grouped heads, one token, one KV head, heads x head_dim != hidden, llama3 RoPE)")
    return fn


def _layer_error_hint(e) -> str:
    msg = str(e)
    if "mat1 and mat2" in msg or "size mismatch" in msg or "must match the size" in msg:
        return ("Hint: a weight is [out, in]: multiply x @ W.T; q, k, v take cfg.num_heads / cfg.num_kv_heads heads of "
                "cfg.head_dim each (heads x head_dim need not be hidden_size), and o is reshaped to [T, num_heads * "
                "head_dim] before Wo.")
    if isinstance(e, KeyError):
        return (f"Hint: W's keys are the Hugging Face names of layer i: 'model.layers.{{i}}.self_attn.q_proj.weight', "
                "'...mlp.gate_proj.weight', '...input_layernorm.weight' (see notebook 02's shapes).")
    return "Hint: build the layer from your rms_norm, rope and attention, reading every size from cfg."


# -- notebook 03: grouped-query causal attention ----------------------------------------------------

def _rope_variants(x, pos, freqs) -> dict:
    """RoPE of x [T, H, D] at positions pos with one thing done another way: the usual mistakes."""
    import torch
    half = x.shape[-1] // 2

    def rot(x1, x2, ang, sign=1.0):
        cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
        return x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin

    ang = pos[:, None].double() * freqs[None, :].double()
    x1, x2 = x[..., :half], x[..., half:]
    a, b = rot(x1, x2, ang)
    out = {"right": torch.cat([a, b], -1)}
    ie, io = rot(x[..., 0::2], x[..., 1::2], ang)                    # pairs (0, 1), (2, 3), ...
    out["interleaved"] = torch.stack([ie, io], -1).flatten(-2)
    out["sign"] = torch.cat(rot(x1, x2, ang, sign=-1.0), -1)
    out["swapped"] = torch.cat([b, a], -1)
    out["shifted"] = torch.cat(rot(x1, x2, (pos[:, None] + 1).double() * freqs[None, :].double()), -1)
    out["index"] = torch.cat(rot(x1, x2, torch.arange(len(pos))[:, None].double() * freqs[None, :].double()), -1)
    return out


_ROPE_HINTS = {
    "interleaved": "that pairs neighbours (0, 1), (2, 3), ... (GPT-J's layout). Llama rotates HALVES: coordinate "
                   "i pairs with i + D/2 -- x1, x2 = x[..., :D/2], x[..., D/2:].",
    "sign": "the rotation turns the wrong way: [x1 cos - x2 sin, x2 cos + x1 sin] (the minus goes on the "
            "first half's x2 sin).",
    "swapped": "the halves come back swapped: cat([x1 cos - x2 sin, x2 cos + x1 sin]) in that order.",
    "shifted": "the angle uses position + 1: a token at position p turns by p * inv_freq (the first token, "
               "p = 0, not at all).",
    "index": "the angle uses the row number, not the token's position: use pos (a prompt's rows are at 0..T-1, "
             "but a decode step's one row is at position n - 1).",
}


def check_rope(fn, seed: int = 0):
    """`fn(x [T, H, D], pos [T], freqs [D/2])` -> x rotated (Llama's rotate-half RoPE): each pair
    (i, i + D/2) of token t's vector turned by pos[t] * freqs[i]. Against pagedlab's rope_torch,
    with positions that are not 0..T-1 (a decode step's one row, a later chunk) and llama3-scaled
    frequencies."""
    import torch
    from ..config import LLAMA_3_2_1B
    from ..kernels.rope import rope_inv_freq, rope_torch
    fn = chapter.pick(fn, "rope")
    g = torch.Generator().manual_seed(seed)
    c = LLAMA_3_2_1B
    cases = [("one token at position 0", [0], 2, 8, 10000.0, None),
             ("a prompt at 0..6", list(range(7)), 3, 16, 10000.0, None),
             ("a decode step: one row at position 37", [37], 2, 8, 10000.0, None),
             ("a later chunk at 50..54", list(range(50, 55)), 1, 64, c.rope_theta, c.rope_scaling),
             ("scattered positions", [3, 900, 17, 4000], 4, 64, c.rope_theta, c.rope_scaling)]
    for what, pos, h, d, theta, scaling in cases:
        x = torch.randn(len(pos), h, d, generator=g)
        pos = torch.tensor(pos)
        freqs = rope_inv_freq(d, theta, scaling)
        where = f"rope(x [{len(pos)}, {h}, {d}], pos {pos.tolist()[:6]}, freqs)   # {what}"
        got = chapter.call(fn, "rope", x.clone(), pos.clone(), freqs.clone())
        cos_sin = torch.cat([(pos[:, None].double() * freqs).cos(), (pos[:, None].double() * freqs).sin()], -1).float()
        want = rope_torch(x, x[:, :1], torch.arange(len(pos)), cos_sin)[0]
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(x.shape):
            raise CheckFailed(f"{where} returned {type(got).__name__} {tuple(getattr(got, 'shape', ()))}; "
                              f"expected a tensor of x's shape {tuple(x.shape)}.")
        if torch.allclose(got.float(), want, atol=1e-4, rtol=1e-4):
            continue
        variants = _rope_variants(x, pos, freqs)
        bug = next((k for k, v in variants.items() if k != "right" and torch.allclose(got.float(), v, atol=1e-4, rtol=1e-4)), None)
        hint = _ROPE_HINTS.get(bug, "angle = pos[:, None] * freqs[None, :] ([T, D/2]); cos and sin of it, broadcast "
                               "over the heads; x1, x2 = the two halves; cat([x1 cos - x2 sin, x2 cos + x1 sin]).")
        raise CheckFailed(f"{where}: off by up to {(got.float() - want).abs().max().item():.3g}.\nHint: {hint}")
    chapter.passed("rope", f"{len(cases)} cases equal pagedlab's rope_torch (a decode row, a later chunk, "
                   "scattered positions, llama3-scaled frequencies)")
    return fn


def _gqa_reference(q, k, v):
    """Causal attention with grouped KV heads by torch's own scaled_dot_product_attention."""
    import torch
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                           v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def check_attention(fn, seed: int = 0):
    """`fn(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])` -> [T, Hq, D]: causal softmax attention
    scaled by 1/sqrt(D), query head h reading KV head h // (Hq // Hkv), against torch's
    scaled_dot_product_attention on one token, one head, and grouped heads (2 and 3 query heads a
    KV head, one KV head for all)."""
    import torch
    fn = chapter.pick(fn, "attention")
    g = torch.Generator().manual_seed(seed)
    cases = [(1, 1, 1, 4), (6, 4, 2, 8), (7, 6, 2, 4), (5, 3, 1, 8), (9, 4, 4, 16)]
    for t, hq, hkv, d in cases:
        q = torch.randn(t, hq, d, generator=g) * 2
        k = torch.randn(t, hkv, d, generator=g) * 2
        v = torch.randn(t, hkv, d, generator=g)
        where = f"attention(q [{t}, {hq}, {d}], k and v [{t}, {hkv}, {d}])"
        got = chapter.call(fn, "attention", q.clone(), k.clone(), v.clone())
        want = _gqa_reference(q, k, v)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            raise CheckFailed(f"{where} returned {type(got).__name__} {tuple(getattr(got, 'shape', ()))}; "
                              f"expected a tensor of shape {tuple(want.shape)} (one output per query head).")
        if torch.allclose(got.float(), want, atol=1e-5, rtol=1e-5):
            continue
        raise CheckFailed(f"{where}: off by up to {(got.float() - want).abs().nan_to_num(1e9).max().item():.3g}.\n"
                          f"{_attention_hint(q, k, v, got.float())}")
    chapter.passed("attention", f"{len(cases)} shapes (one token, one head, 2 and 3 query heads a KV head) equal "
            "torch's scaled_dot_product_attention")
    return fn


def _attention_hint(q, k, v, got) -> str:
    import torch
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv

    def attn(kk, vv, scale=d ** -0.5, mask=True, diagonal=0):
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        if mask:
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(diagonal), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    ki, vi = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

    def same(x):
        return bool(torch.allclose(got, x, atol=1e-5, rtol=1e-5, equal_nan=True))
    if got.isnan().any() and same(attn(ki, vi, diagonal=-1)):
        return ("Hint: query t must see the keys 0..t, itself included: keep the diagonal in the causal "
                "mask (tril(), not tril(-1)); the first query otherwise sees nothing.")
    if g > 1 and same(attn(k.repeat(1, g, 1), v.repeat(1, g, 1))):
        return (f"Hint: query head h reads KV head h // {g} (Hq // Hkv): the {g} query heads of a group are "
                "neighbours -- repeat_interleave the KV heads, not repeat.")
    if same(attn(ki, vi, mask=False)):
        return "Hint: mask the future: query t may attend only to keys 0..t (a causal mask before the softmax)."
    for scale, what in ((1.0, "no scale"), (1.0 / d, "1/D")):
        if same(attn(ki, vi, scale=scale)):
            return f"Hint: scale the scores by 1/sqrt(head_dim) = 1/sqrt({d}) ({what} was used)."
    return ("Hint: scores = q . k / sqrt(D) for query head h against KV head h // (Hq // Hkv), -inf above "
            "the diagonal, softmax over the keys, then the weighted sum of v.")


# -- notebook 00: the slot timeline, read from the trace -------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _toy_trace(num_slots: int, steps: list[tuple[list, list]]):
    """A pagedlab Trace holding only what a timeline reads: per step, each slot's request and phase."""
    from ..trace import StepRecord, Trace
    t = Trace(num_slots, block_size=16, num_blocks=8)
    for k, (req, phase) in enumerate(steps):
        t.append(StepRecord(step=k, start_s=0.0, duration_s=0.0, slot_request=list(req), slot_phase=list(phase),
                            block_table=[[] for _ in req], pool_used=0, pool_total=8, queue=[], emitted={},
                            num_tokens=0))
    return t


def _random_trace(rng, num_slots: int, num_steps: int, first_id: int = 0):
    """Requests run in slots one after another: a prefill step, then decode steps; idle gaps between."""
    steps = [([None] * num_slots, [None] * num_slots) for _ in range(num_steps)]
    rid = first_id
    for slot in range(num_slots):
        k = rng.randint(0, 2)
        while k < num_steps:
            n = rng.randint(1, 6)
            for j in range(k, min(k + n, num_steps)):
                steps[j][0][slot], steps[j][1][slot] = rid, ("prefill" if j == k else "decode")
            rid += 1
            k += n + rng.choice([0, 0, 1, 3])
    return _toy_trace(num_slots, steps)


def _timeline_cases(rng):
    cases = [("one slot, one request: a prefill then three decodes",
              _toy_trace(1, [([0], ["prefill"])] + [([0], ["decode"])] * 3)),
             ("two slots, the second idle at first",
              _toy_trace(2, [([0, None], ["prefill", None]), ([0, 1], ["decode", "prefill"]), ([None, 1], [None, "decode"])])),
             ("a slot idle for the whole trace", _toy_trace(3, [([0, None, 2], ["prefill", None, "prefill"]),
                                                                 ([0, None, 2], ["decode", None, "decode"])])),
             ("request ids past 25 (letters wrap around: request 26 is 'a' again)",
              _toy_trace(2, [([25, 26], ["prefill", "prefill"]), ([25, 27], ["decode", "prefill"]),
                             ([52, 27], ["prefill", "decode"])]))]
    for _ in range(8):
        cases.append(("random", _random_trace(rng, rng.randint(1, 5), rng.randint(1, 30), rng.choice([0, 0, 20]))))
    return cases


def _timeline_hint(trace, got: str, want: str) -> str:
    g, w = got.splitlines(), want.splitlines()
    if len(g) != len(w):
        if len(g) == len(trace):
            return ("there is one line per STEP: the timeline has one ROW per slot (trace.num_slots of them), "
                    "one COLUMN per step.")
        return f"{len(g)} lines, expected {len(w)}: one row per slot (trace.num_slots = {trace.num_slots})."
    if got.lower() == want.lower():
        return ("the letters' case is off: UPPER case marks the step where the request was prefilled "
                    "(slot_phase == 'prefill'), lower case each decode step.")
    strip = lambda rows: [r.split("|")[1] if r.count("|") >= 2 else r for r in rows]   # noqa: E731
    if [r.strip(" ") for r in strip(g)] == strip(w):
        return "the marks are right; the frame is not: each row is f\"slot {slot:2d} |\" + marks + \"|\"."
    for row, (a, b) in enumerate(zip(strip(g), strip(w))):
        if a != b:
            col = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            s = trace.steps[col] if col < len(trace) else None
            rid = s.slot_request[row] if s is not None else None
            if rid is not None and rid >= len(LETTERS) and b[col:col + 1].lower() == LETTERS[rid % 26]:
                return (f"request {rid} at step {col}: ids past 25 wrap around: the letter is "
                        f"'abcdefghijklmnopqrstuvwxyz'[rid % 26] ('{LETTERS[rid % 26]}').")
            if len(a) != len(b):
                return f"slot {row}'s row has {len(a)} marks, expected {len(b)}: one per step ({len(trace)} steps)."
            if b[col] == ".":
                return f"slot {row} is idle at step {col}: an idle slot (slot_request is None) is '.'."
            if a[col].lower() == b[col].lower():
                return ("the letters' case is off: UPPER case marks the step where the request was prefilled "
                        "(slot_phase == 'prefill'), lower case each decode step.")
            return (f"slot {row}, step {col}: request {rid}, phase {s.slot_phase[row] if s else None}: "
                    f"expected {b[col]!r}, got {a[col]!r}.")
    return "compare your text with the expected one above, character by character."


def check_timeline(fn, trace=None, seed: int = 0):
    """fn(trace) -> the slot timeline as text, equal to pagedlab's Trace.timeline(): one row per
    slot, f"slot {slot:2d} |" + one mark per step + "|"; the mark is the request's letter
    ('abc...z'[rid % 26]), UPPER case at its prefill step, lower case at a decode step, '.' when the
    slot is idle. On hand-made traces (edge cases, random ones) and `trace` (the notebook's own)."""
    fn = chapter.pick(fn, "timeline")
    cases = _timeline_cases(random.Random(seed))
    if trace is not None:
        cases.append(("the notebook's trace", trace))
    for what, t in cases:
        want = t.timeline()
        got = chapter.call(fn, "timeline", t)
        if not isinstance(got, str):
            raise CheckFailed(f"timeline returned a {type(got).__name__}, expected the text (a str): "
                              "the rows joined with '\\n'.")
        if got.rstrip("\n") != want:
            raise CheckFailed(f"case: {what} ({t.num_slots} slots, {len(t)} steps)\nexpected:\n{want}\ngot:\n{got}\n"
                              f"Hint: {_timeline_hint(t, got.rstrip(chr(10)), want)}")
    chapter.passed("timeline", f"{len(cases)} traces (an idle slot, ids past 25, random ones) equal "
                   "pagedlab's Trace.timeline()")
    return fn


# -- notebook 09: the engine's step, schedule -> run -> accept -----------------------------------------

class _Watched:
    """A scheduler or runner whose calls of `names` are logged as (name, args, result)."""

    def __init__(self, obj, names, log):
        self._obj, self._names, self._log = obj, names, log

    def __getattr__(self, attr):
        value = getattr(self._obj, attr)
        if attr in self._names:
            def call(*args, **kwargs):
                entry = [attr, args, None]
                self._log.append(entry)
                entry[2] = value(*args, **kwargs)
                return entry[2]
            return call
        return value


STEP_HINTS = {
    "no schedule": "a step starts with batch = scheduler.schedule(): who runs, with which blocks.",
    "schedule twice": ("schedule() once per step: the batch it returns already moved requests into slots and "
                       "gave them blocks, so every batch it returns must be run and accepted."),
    "empty run": ("scheduler.schedule() found nothing to run (batch.empty is True): return before "
                  "runner.run -- there is no batch to send to the device."),
    "no run": "the batch goes to the device: tokens = runner.run(batch).",
    "run other": "run the batch that schedule() returned: runner.run(batch).",
    "no accept": ("the tokens never reach the requests: scheduler.accept(batch, tokens) appends them, finds "
                  "the stops, finishes requests and frees their blocks."),
    "accept other": ("accept exactly what the runner returned, in its order: scheduler.accept(batch, tokens) "
                     "(the tokens are in batch.sampled order)."),
}


def _step_diagnosis(log, partial: bool = False) -> str | None:
    """What is wrong with one step's calls (None: schedule -> run -> accept, as they should be).
    partial: the step raised after these calls (a missing call is not the mistake then)."""
    names = [n for n, _, _ in log]
    if partial and not names:
        return None
    if "schedule" not in names:
        return "no schedule"
    if names.count("schedule") > 1:
        return "schedule twice"
    batch = log[names.index("schedule")][2]
    if batch is None:                                  # schedule() itself raised
        return None
    if batch.empty:
        return "empty run" if "run" in names else None
    if "run" not in names:
        return None if partial else "no run"
    run = log[names.index("run")]
    if len(run[1]) < 1 or run[1][0] is not batch:
        return "run other"
    if "accept" not in names:
        return None if partial else "no accept"
    acc = log[names.index("accept")]
    if len(acc[1]) < 2 or acc[1][0] is not batch or run[2] is None or list(acc[1][1]) != list(run[2]):
        return "accept other"
    return None


def _step_calls(fn, engine, what, k) -> list:
    """Run the learner's step on `engine`'s scheduler and runner; the calls it made. A step that
    raises fails with the hint its calls so far point to."""
    log = []
    try:
        fn(_Watched(engine.scheduler, ("schedule", "accept"), log), _Watched(engine.runner, ("run",), log))
    except CheckFailed:
        raise
    except NotImplementedError as e:
        raise CheckFailed(chapter.not_written("engine_step", e)) from None
    except Exception as e:
        calls = ", ".join(f"{n}()" for n, _, _ in log) or "nothing"
        bad = _step_diagnosis(log, partial=True)
        raise CheckFailed(f"case: {what}, step {k}: your step called {calls} and raised {type(e).__name__}: {e}"
                          + (f"\nHint: {STEP_HINTS[bad]}" if bad else "")) from None
    return log


def _engine_cases(rng):
    """(what, engine keywords, [(prompt, params)]): roomy, one slot, and a pool tight enough to preempt."""
    from ..sampling import SamplingParams

    def work(n, new=(1, 7)):
        return [([rng.randrange(3, 250) for _ in range(rng.randint(2, 9))],
                 SamplingParams(max_new_tokens=rng.randint(*new), ignore_eos=True)) for _ in range(n)]
    return [("3 requests, 2 slots", dict(max_num_seqs=2, num_blocks=24), work(3)),
            ("one slot, one new token each", dict(max_num_seqs=1, num_blocks=8), work(3, (1, 1))),
            ("4 slots, a pool of 6 blocks of 4 tokens: requests are preempted", dict(max_num_seqs=4, num_blocks=6),
             work(5, (4, 9)))]


def check_engine_step(fn, seed: int = 0):
    """fn(scheduler, runner): one engine step -- batch = scheduler.schedule(); if the batch is empty,
    return; tokens = runner.run(batch); scheduler.accept(batch, tokens). Run step after step on
    pagedlab's tiny random Llama (CPU, fp32) beside pagedlab's own Engine.step on the same requests:
    each step must make exactly those calls, and after every step each request's tokens and state
    must be pagedlab's; with nothing left to run, a step must not call the runner."""
    from ..llm import LLM
    fn = chapter.pick(fn, "engine_step")
    ckpt = None
    cases = _engine_cases(random.Random(seed))
    for what, kw, work in cases:
        engines = []
        for _ in range(2):
            llm = LLM("random:tiny", device="cpu", dtype="float32", block_size=4, show_progress=False,
                      attention_backend="torch", overlap=False, checkpoint=ckpt, **kw)
            ckpt = llm.checkpoint
            ids = [llm.engine.add_request(prompt, params) for prompt, params in work]
            engines.append(llm.engine)
        ours, ref = engines
        mine = {r.request_id: r for r in ours.scheduler.waiting}
        theirs = {r.request_id: r for r in ref.scheduler.waiting}
        assert sorted(mine) == sorted(theirs) == sorted(ids)
        k = 0
        while ref.scheduler.has_work() or k == 0:
            log = _step_calls(fn, ours, what, k)
            ref.step()
            got = {i: (list(r.output_token_ids), r.status.name.lower()) for i, r in mine.items()}
            want = {i: (list(r.output_token_ids), r.status.name.lower()) for i, r in theirs.items()}
            bad = _step_diagnosis(log) or ("accept other" if got != want else None)
            if bad is not None:
                calls = ", ".join(f"{n}()" for n, _, _ in log) or "nothing"
                diff = next((i for i in want if got[i] != want[i]), None)
                shown = (f"\n  then request {diff} has tokens {got[diff][0]} ({got[diff][1]}), expected "
                         f"{want[diff][0]} ({want[diff][1]})") if diff is not None else ""
                raise CheckFailed(f"case: {what}, step {k}: your step called {calls}.{shown}\n"
                                  f"Hint: {STEP_HINTS[bad]}")
            k += 1
            if k > 500:
                raise CheckFailed(f"case: {what}: 500 steps and pagedlab's engine is not done (a bug of the check)")
        log = _step_calls(fn, ours, what, "with nothing left to run")    # must not run anything
        bad = _step_diagnosis(log)
        if bad is not None:
            raise CheckFailed(f"case: {what}, a step with nothing left to run: your step called "
                              f"{', '.join(n + '()' for n, _, _ in log) or 'nothing'}.\nHint: {STEP_HINTS[bad]}")
        if ours.scheduler.allocator.num_used:
            raise CheckFailed(f"case: {what}: after the last step {ours.scheduler.allocator.num_used} blocks are "
                              f"still held.\nHint: {STEP_HINTS['no accept']}")
    chapter.passed("engine_step", f"{len(cases)} workloads (one slot, two, a tight pool with preemptions) step "
                   "for step equal to pagedlab's Engine.step, and an idle step runs nothing")
    return fn
