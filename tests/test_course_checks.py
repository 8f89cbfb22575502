"""The course's checks (pagedlab/course/checks.py): each passes on the course's solution (which is
checked against pagedlab's own implementation) and fails, with a message that says what is wrong,
on a stub and on planted bugs."""
from __future__ import annotations

import pytest

from pagedlab.course import checks
from pagedlab.course.chapter import load_pieces
from pagedlab.kv_cache import blocks_needed


@pytest.fixture(scope="module")
def sol():
    return load_pieces()            # the course's solutions/pieces.py, as the notebooks load it


@pytest.fixture(autouse=True)
def _no_solutions(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)


def fails(check, fn, *words):
    with pytest.raises(checks.CheckFailed) as e:
        check(fn)
    msg = str(e.value)
    for w in words:
        assert w in msg, (w, msg)
    return msg


def stub(*args):
    raise NotImplementedError("fill me in")


@pytest.mark.parametrize("name", ["Allocator", "token_slot", "schedule_step", "make_room"])
def test_solutions_pass_and_are_returned(sol, name, capsys):
    check = {"Allocator": checks.check_allocator, "token_slot": checks.check_token_slot,
             "schedule_step": checks.check_schedule_step, "make_room": checks.check_make_room}[name]
    assert check(getattr(sol, name)) is getattr(sol, name)
    assert "\u2713" in capsys.readouterr().out


@pytest.mark.parametrize("check", [checks.check_allocator, checks.check_token_slot,
                                   checks.check_schedule_step, checks.check_make_room])
def test_stub_fails_with_a_friendly_message(check):
    msg = fails(check, stub, "not written yet", "fill me in")
    assert "Traceback" not in msg


def test_failure_renders_without_traceback_in_ipython():
    lines = checks.CheckFailed("first line\nsecond").\
        _render_traceback_()
    assert len(lines) == 2 and "first line" in lines[0] and lines[1] == "second"


def test_solutions_switch_uses_the_course_solution(monkeypatch, sol):
    monkeypatch.setenv("PAGEDLAB_SOLUTIONS", "1")
    got = checks.check_schedule_step(stub)
    assert got is not stub and got.__name__ == "schedule_step"


# -- planted bugs ----------------------------------------------------------------------------------

def test_allocator_bugs(sol):
    class Stack(sol.Allocator):                       # hands out the most recently freed block first
        def allocate(self, who, n=1):
            if n > len(self.free_list):
                raise RuntimeError("out")
            got = [self.free_list.pop() for _ in range(n)]
            self.owner.update({b: who for b in got})
            return got
    fails(checks.check_allocator, Stack, "allocate returned", "FRONT")

    class NoDoubleFreeCheck(sol.Allocator):
        def free(self, blocks):
            for b in blocks:
                self.owner.pop(b, None)
                self.free_list.append(b)
    fails(checks.check_allocator, NoDoubleFreeCheck, "not in use")

    class HalfTaken(sol.Allocator):                   # takes what there is, then complains
        def allocate(self, who, n=1):
            got = []
            for _ in range(n):
                if not self.free_list:
                    raise RuntimeError("out")
                got.append(self.free_list.popleft())
                self.owner[got[-1]] = who
            return got
    fails(checks.check_allocator, HalfTaken, "changed the free list")

    class Unrecorded(sol.Allocator):
        def allocate(self, who, n=1):
            if n > len(self.free_list):
                raise RuntimeError("out")
            return [self.free_list.popleft() for _ in range(n)]

        def free(self, blocks):
            self.free_list.extend(blocks)
    fails(checks.check_allocator, Unrecorded, "after")


def test_token_slot_bugs():
    fails(checks.check_token_slot, lambda row, n, bs: row[n // bs] * bs, "expected", "add n % block_size")
    fails(checks.check_token_slot, lambda row, n, bs: n // bs * bs + n % bs, "LOGICAL slot", "row[n // block_size]")
    fails(checks.check_token_slot, lambda row, n, bs: row[n // bs] + n % bs, "block * block_size")
    fails(checks.check_token_slot, lambda row, n, bs: n // bs * bs + row[n // bs], "physical block goes first")


def test_schedule_step_bugs(sol):
    def highest_slot_first(state):
        state.slots.reverse()
        try:
            return sol.schedule_step(state)
        finally:
            state.slots.reverse()
    fails(checks.check_schedule_step, highest_slot_first, "at step", "expected", "LOWEST free slot")

    def never_frees(state):
        real = state.allocator.free
        state.allocator.free = lambda blocks: None
        try:
            return sol.schedule_step(state)
        finally:
            state.allocator.free = real
    fails(checks.check_schedule_step, never_frees, "blocks in use", "free")

    def no_block_growth(state):               # blocks for the prompt only: never a block for a new token
        saved = {id(s): len(s.blocks) for s in state.running}
        ran = sol.schedule_step(state)
        for s in state.running:                 # give back what step 1 took for decodes
            extra = len(s.blocks) - saved.get(id(s), len(s.blocks))
            if extra > 0:
                state.allocator.free(s.blocks[-extra:])
                del s.blocks[-extra:]
        return ran
    fails(checks.check_schedule_step, no_block_growth, "blocks held per slot")

    def one_token_short(state):
        for seq in list(state.queue):
            seq.max_new_tokens += 1 if seq.generated == 0 and not hasattr(seq, "_seen") else 0
            seq._seen = True
        return sol.schedule_step(state)
    fails(checks.check_schedule_step, one_token_short, "expected")


def test_make_room_bugs(sol):
    def oldest(state, seq):
        return checks.make_room_preempting(state, seq, which=0)
    fails(checks.check_make_room, oldest, "preempted", "newest")

    def back_of_queue(state, seq):
        n = len(state.queue)
        kept = sol.make_room(state, seq)
        while len(state.queue) > n:              # move the victims to the back
            state.queue.rotate(-1)
            n += 1
        return kept
    fails(checks.check_make_room, back_of_queue, "queue", "FRONT")

    def forgets_victims(state, seq):
        kept = sol.make_room(state, seq)
        state.preempted.clear()
        return kept
    fails(checks.check_make_room, forgets_victims, "preempted")


# -- each hint names the bug it was written for -------------------------------------------------------

def _schedule_step_with(stop=lambda seq: seq.generated == seq.max_new_tokens, grow_first=True):
    """The course's schedule_step with a different stop test or order of growth and admission."""
    def step(state):
        bs = state.block_size

        def grow():
            for seq in state.running:
                need = blocks_needed(seq.num_tokens, bs) - len(seq.blocks)
                if need > 0:
                    seq.blocks += state.allocator.allocate(seq.rid, need)
        if grow_first:
            grow()
        new = []
        while state.queue and None in state.slots:
            seq = state.queue.popleft()
            seq.blocks = state.allocator.allocate(seq.rid, blocks_needed(seq.num_tokens, bs))
            state.slots[state.slots.index(None)] = seq
            state.running.append(seq)
            new.append(seq)
        if not grow_first:                            # refill before grow: the new ones hold enough
            for seq in [s for s in state.running if s not in new]:
                need = blocks_needed(seq.num_tokens, bs) - len(seq.blocks)
                if need > 0:
                    seq.blocks += state.allocator.allocate(seq.rid, need)
        ran = [s.rid if s is not None else None for s in state.slots]
        for seq in state.running:
            seq.generated += 1
        for seq in list(state.running):
            if stop(seq):
                state.allocator.free(seq.blocks)
                seq.blocks = []
                state.slots[state.slots.index(seq)] = None
                state.running.remove(seq)
                state.finished.append(seq.rid)
        return ran
    return step


def test_schedule_step_hints_name_the_bug():
    msg = fails(checks.check_schedule_step, _schedule_step_with(stop=lambda s: s.generated > s.max_new_tokens),
                "should have stopped in this step", "generated == max_new_tokens")
    assert "one token per step" not in msg
    msg = fails(checks.check_schedule_step, _schedule_step_with(stop=lambda s: s.generated >= s.max_new_tokens - 1),
                "stopped one step early")
    assert "one token per step" not in msg
    # refill before grow: the same block counts, other ids (a 4,096-block pool never runs out)
    fails(checks.check_schedule_step, _schedule_step_with(grow_first=False), "block ids", "different block ids",
          "First make room")


def _make_room_with(sol, reset=False, return_false=True, slack=0, strict=False):
    def make_room(state, seq):
        need = blocks_needed(seq.num_tokens, state.block_size) - len(seq.blocks)
        while (need >= state.allocator.num_free) if strict else (need > state.allocator.num_free + slack):
            victim = state.running[-1]
            state.allocator.free(victim.blocks)
            victim.blocks = []
            if reset:
                victim.generated = 0
            state.slots[state.slots.index(victim)] = None
            state.running.remove(victim)
            state.queue.appendleft(victim)
            state.preempted.append(victim.rid)
            if victim is seq and return_false:
                return False
        if need > 0:
            seq.blocks += state.allocator.allocate(seq.rid, need)
        return True
    return make_room


def test_make_room_hints_name_the_bug(sol):
    assert checks.check_make_room(_make_room_with(sol)) is not None          # the helper itself is right
    msg = fails(checks.check_make_room, _make_room_with(sol, reset=True), "count started again",
                "never reset seq.generated")
    assert "one token per step" not in msg
    msg = fails(checks.check_make_room, _make_room_with(sol, return_false=False), "still holds blocks",
                "return False")
    assert "free a request's blocks when it stops" not in msg
    msg = fails(checks.check_make_room, _make_room_with(sol, slack=1), "at step", "OutOfBlocks",
                "<= allocator.num_free", "off-by-one")
    assert msg.startswith("workload")                                        # says where it happened
    fails(checks.check_make_room, _make_room_with(sol, strict=True), "preempted although the pool then had room")


def test_allocator_stub_messages_name_the_method(sol):
    class Stub:
        def __init__(self, n):
            self.free_list, self.owner = __import__("collections").deque(range(n)), {}

        def allocate(self, who, n=1):
            raise NotImplementedError("take n blocks")

        def free(self, blocks):
            raise NotImplementedError("give them back")
    msg = fails(checks.check_allocator, Stub, "Allocator.allocate is not written yet", "take n blocks")
    assert "give them back" not in msg

    class HalfDone(Stub):
        allocate = sol.Allocator.allocate
    fails(checks.check_allocator, HalfDone, "Allocator.free is not written yet", "give them back")


# -- notebook 05: the decode loop ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """The tiny random model driven by hand, with notebook 05's new_cache and run."""
    import torch
    from pagedlab import LLM
    from pagedlab.attention import AttentionMetadata
    from pagedlab.kv_cache import KVCache
    llm = LLM("random:tiny", dtype="float32", show_progress=False)
    model, c, dev, BS = llm.model, llm.config, llm.model.device, 16

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=dev)

    def new_cache(max_len):
        n = blocks_needed(max_len, BS)
        return (KVCache(c.num_layers, n, BS, c.num_kv_heads, c.head_dim, model.dtype, dev),
                torch.arange(n, dtype=torch.int32, device=dev)[None, :])

    def run(cache, table, ids, start):
        n, total = len(ids), start + len(ids)
        pos = torch.arange(start, total, device=dev)
        slots = table[0, pos // BS].long() * BS + pos % BS
        empty = table[:0]
        if n > 1 or start == 0:
            meta = AttentionMetadata(slots, n, table, i32([0, n]), i32([total]), n, empty, i32([]), 0)
        else:
            meta = AttentionMetadata(slots, 0, empty, i32([0]), i32([]), 0, table, i32([total]), total)
        return model.forward(torch.tensor(ids, device=dev), pos, cache, meta, torch.tensor([n - 1], device=dev))[0]

    return llm, new_cache, run


def test_kv_generate(tiny, sol, monkeypatch):
    import __main__
    llm, new_cache, run = tiny
    monkeypatch.setattr(__main__, "new_cache", new_cache, raising=False)   # the solution reads the
    monkeypatch.setattr(__main__, "run", run, raising=False)               # notebook's helpers
    assert checks.check_kv_generate(sol.generate_with_cache, llm) is sol.generate_with_cache
    fails(lambda f: checks.check_kv_generate(f, llm), stub, "not written yet")

    def recomputes(prompt, n):                      # right tokens, no cache
        ids, work = list(prompt), 0
        for _ in range(n):
            cache, table = new_cache(len(ids))
            work += len(ids)
            ids.append(int(run(cache, table, ids, 0).argmax()))
        return ids[len(prompt):], work
    fails(lambda f: checks.check_kv_generate(f, llm), recomputes, "fed", "one cache")

    def wrong_position(prompt, n):                  # decodes every token at the prompt's end
        cache, table = new_cache(len(prompt) + n)
        out = [int(run(cache, table, prompt, 0).argmax())]
        for _ in range(n - 1):
            out.append(int(run(cache, table, [out[-1]], len(prompt)).argmax()))
        return out, len(prompt) + n - 1
    fails(lambda f: checks.check_kv_generate(f, llm), wrong_position, "pagedlab's engine gives",
          "decode step 2 fed position", "P + i - 1")

    def feeds_prompt_end(prompt, n):                # decodes from the prompt's last token every step
        cache, table = new_cache(len(prompt) + n)
        out = [int(run(cache, table, prompt, 0).argmax())]
        for i in range(n - 1):
            out.append(int(run(cache, table, [prompt[-1]], len(prompt) + i).argmax()))
        return out, len(prompt) + n - 1
    fails(lambda f: checks.check_kv_generate(f, llm), feeds_prompt_end, "fed token", "out[-1]")


# -- notebook 06: the decode kernel's loop -----------------------------------------------------------

def _decode_one_with(kv_head=None, table=True, extra=0, scale_pow=1, rescale_acc=True, rescale_l=True, divide=True):
    """The course's decode_one loop with one thing done another way."""
    import math

    import torch

    def decode_one(q, k, v, row, length, head, scale):
        bs, head = k.shape[1], head if kv_head is None else kv_head
        m, l, acc = float("-inf"), 0.0, torch.zeros_like(q, dtype=torch.float32)
        for n in range(max(1, length + extra)):
            block = row[n // bs] if table else n // bs
            s = float(q.float() @ k[block, n % bs, head].float()) * scale ** scale_pow
            m_new = max(m, s)
            alpha, p = math.exp(m - m_new), math.exp(s - m_new)
            l = l * (alpha if rescale_l else 1.0) + p
            acc = acc * (alpha if rescale_acc else 1.0) + p * v[block, n % bs, head].float()
            m = m_new
        return acc / l if divide else acc
    return decode_one


def test_decode_one(sol):
    assert checks.check_decode_one(sol.decode_one) is sol.decode_one
    assert checks.check_decode_one(_decode_one_with()) is not None          # the helper itself is right
    fails(checks.check_decode_one, stub, "not written yet")
    for bug, words in [(dict(kv_head=0), ["attention over KV head 0", "kv_head argument"]),
                       (dict(table=False), ["blocks 0, 1, 2", "row[n // block_size]"]),
                       (dict(extra=-1), ["keys: attend to all `length` keys"]),
                       (dict(scale_pow=0), ["not scaled"]),
                       (dict(scale_pow=2), ["scale applied twice"]),
                       (dict(rescale_acc=False), ["acc is not rescaled"]),
                       (dict(rescale_l=False), ["l is not rescaled"]),
                       (dict(rescale_acc=False, rescale_l=False), ["neither acc nor l"]),
                       (dict(divide=False), ["return acc / l"])]:
        fails(checks.check_decode_one, _decode_one_with(**bug), "off by", *words)


# -- the course's fast SmolLM2 ---------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_copy_gives_the_same_tokens(tmp_path, smollm2, smollm2_llm):
    """choose_model's local copy of the embedded SmolLM2 (safetensors + tokenizer files): the same
    config, stop tokens, chat template and greedy tokens as the GGUF, and made only once."""
    from pagedlab import LLM, SamplingParams, course
    path = course.smollm2_copy(tmp_path, smollm2, smollm2_llm.tokenizer)
    made = (path / "model.safetensors").stat().st_mtime
    assert course.smollm2_copy(tmp_path) == path and (path / "model.safetensors").stat().st_mtime == made
    copy = LLM(str(path), max_num_seqs=2, show_progress=False)
    assert copy.engine.stop_token_ids == smollm2_llm.engine.stop_token_ids
    assert copy.tokenizer.hf.chat_template == smollm2_llm.tokenizer.hf.chat_template
    sp = SamplingParams(max_new_tokens=12)
    want = [o.token_ids for o in smollm2_llm.generate(course.DEMO_PROMPTS, sp, chat=True)]
    assert [o.token_ids for o in copy.generate(course.DEMO_PROMPTS, sp, chat=True)] == want


# -- the course's CPU threads ------------------------------------------------------------------------

@pytest.mark.parametrize("env,want", [({}, "1 True"), ({"OMP_NUM_THREADS": "2"}, "2 False"),
                                      ({"PAGEDLAB_CPU_THREADS": "2"}, "2 True")])
def test_setup_limits_torch_threads_on_a_cpu(env, want):
    """The set-up cell's course.limit_cpu_threads(): on a CPU, one torch thread for the whole
    notebook unless the learner chose (the engine's own rule), and the report says how many."""
    import os
    import subprocess
    import sys
    code = ("import torch\n"
            "from pagedlab import course\n"
            "n = course.limit_cpu_threads()\n"
            "print(torch.get_num_threads(), n is not None, course.device_report())")
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PAGEDLAB_CPU_THREADS")}
    r = subprocess.run([sys.executable, "-c", code], env={**base, **env, "CUDA_VISIBLE_DEVICES": ""},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(want), r.stdout
    n = want.split()[0]
    assert f"torch uses {n} thread" in r.stdout


# -- notebook 02: a safetensors tensor read by hand -----------------------------------------------

def _reader(offsets_from_file_start=False, bf16="shift", length="<Q", reshape=True, f16="<f2"):
    """The course's read_tensor with one thing done another way."""
    import json
    import struct

    import numpy as np
    import torch

    def read_tensor(path, name):
        with open(path, "rb") as f:
            size = struct.calcsize(length)
            (n,) = struct.unpack(length, f.read(size))
            h = json.loads(f.read(n))[name]
            start, end = h["data_offsets"]
            f.seek(start if offsets_from_file_start else size + n + start)
            raw = f.read(end - start)
        if h["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2")
            arr = ((bits.astype(np.uint32) << 16).view(np.float32) if bf16 == "shift"
                   else bits.astype(np.float32) if bf16 == "raw"
                   else np.frombuffer(raw, dtype="<f2").astype(np.float32))        # as if fp16
        elif h["dtype"] == "F16":
            arr = np.frombuffer(raw, dtype=f16).astype(np.float32)
        else:
            arr = np.frombuffer(raw, dtype="<f4")
        t = torch.from_numpy(arr.copy())
        return t.reshape(h["shape"]) if reshape else t
    return read_tensor


def test_read_tensor_check(sol, capsys):
    assert checks.check_read_tensor(sol.read_tensor) is sol.read_tensor and "\u2713" in capsys.readouterr().out
    assert checks.check_read_tensor(_reader()) is not None                     # the helper itself is right
    fails(checks.check_read_tensor, stub, "read_tensor is not written yet", "show_solution('read_tensor')")
    fails(checks.check_read_tensor, _reader(offsets_from_file_start=True), "count from the end of the header")
    fails(checks.check_read_tensor, _reader(bf16="raw"), "raw 16-bit patterns", "TOP half")
    fails(checks.check_read_tensor, _reader(bf16="fp16"), "shift them left by 16")
    fails(checks.check_read_tensor, _reader(length="<I"), "unsigned 64-bit little-endian", "'<Q'")
    fails(checks.check_read_tensor, _reader(reshape=False), "shape (15,), expected (3, 5)", "reshape")
    fails(checks.check_read_tensor, _reader(f16="<u2"), "IEEE half precision")


def _parser(relative=False, forgot_8=False, keep_meta=False, length="<Q", bounds=True, size=True,
            strict=False, short=True, cut_header=True):
    """The course's parse_header with one thing done another way (or one check left out)."""
    import json
    import math
    import struct

    def parse_header(buf):
        if short and len(buf) < 8:
            raise ValueError("short")
        w = struct.calcsize(length)
        (n,) = struct.unpack(length, buf[:w])
        if cut_header and w + n > len(buf):
            raise ValueError("cut header")
        header, data = json.loads(buf[w:w + n]), w + n
        out = {}
        for name, h in header.items():
            if name == "__metadata__" and not keep_meta:
                continue
            if name == "__metadata__":
                out[name] = h
                continue
            start, end = h["data_offsets"]
            if bounds and not 0 <= start <= end <= len(buf) - data:
                raise ValueError("out of range")
            if strict and start >= end:
                raise ValueError("no bytes")
            if size and end - start != math.prod(h["shape"]) * {"BF16": 2, "F16": 2, "F32": 4}[h["dtype"]]:
                raise ValueError("size")
            shift = 0 if relative else (data - 8 if forgot_8 else data)
            out[name] = (h["dtype"], h["shape"], start + shift, end + shift)
        return out
    return parse_header


def test_parse_header_check(sol, capsys):
    assert checks.check_parse_header(sol.parse_header) is sol.parse_header
    assert "\u2713 parse_header" in capsys.readouterr().out
    assert checks.check_parse_header(_parser()) is not None                   # the helper itself is right
    for seed in (1, 2):                                                        # other random files
        checks.check_parse_header(sol.parse_header, seed=seed)
    fails(checks.check_parse_header, stub, "parse_header is not written yet", "show_solution('parse_header')")
    fails(checks.check_parse_header, _parser(relative=True), "count from the end of the header", "8 + N")
    fails(checks.check_parse_header, _parser(forgot_8=True), "add 8 + N, not N")
    fails(checks.check_parse_header, _parser(keep_meta=True), "'__metadata__' entry", "leave it out")
    fails(checks.check_parse_header, _parser(length="<I"), "unsigned 64-bit little-endian", "'<Q'")
    fails(checks.check_parse_header, _parser(strict=True), "empty tensor", "start == end is allowed")
    fails(checks.check_parse_header, _parser(short=False), "5 bytes", "len(buf) >= 8", "struct.error")
    checks.check_parse_header(_parser(cut_header=False))     # json.loads of a cut header raises a ValueError itself
    fails(checks.check_parse_header, _parser(bounds=False), "cut 3 bytes before the end", "inside the file")
    fails(checks.check_parse_header, _parser(size=False), "does not fit its bytes", "prod(shape)")


def _bf16(way="shift"):
    """bf16 bytes -> fp32, the right way or one of the usual wrong ones."""
    import numpy as np
    import torch

    def bf16_to_fp32(raw):
        u = np.frombuffer(raw, ">u2" if way == "big" else "<u2").astype(np.uint32)
        arr = {"shift": lambda: (u << 16).view(np.float32), "big": lambda: (u << 16).view(np.float32),
               "raw": lambda: u.astype(np.float32), "low": lambda: u.view(np.float32),
               "astype": lambda: (u << 16).astype(np.float32), "shift8": lambda: (u << 8).view(np.float32),
               "fp16": lambda: np.frombuffer(raw, "<f2").astype(np.float32),
               "float64": lambda: (u << 16).view(np.float32).astype(np.float64)}[way]()
        return torch.from_numpy(arr.copy())
    return bf16_to_fp32


def test_bf16_to_fp32_check(sol, capsys):
    assert checks.check_bf16_to_fp32(sol.bf16_to_fp32) is sol.bf16_to_fp32
    assert "\u2713 bf16_to_fp32" in capsys.readouterr().out
    assert checks.check_bf16_to_fp32(_bf16()) is not None                      # the helper itself is right
    fails(checks.check_bf16_to_fp32, stub, "bf16_to_fp32 is not written yet")
    fails(checks.check_bf16_to_fp32, _bf16("raw"), "raw 16-bit patterns", "TOP half")
    fails(checks.check_bf16_to_fp32, _bf16("low"), "LOW half")
    fails(checks.check_bf16_to_fp32, _bf16("astype"), "reinterpret the 32 bits", "astype")
    fails(checks.check_bf16_to_fp32, _bf16("shift8"), "shift by 16, not 8")
    fails(checks.check_bf16_to_fp32, _bf16("fp16"), "bf16 is not fp16")
    fails(checks.check_bf16_to_fp32, _bf16("big"), "little-endian")
    fails(checks.check_bf16_to_fp32, _bf16("float64"), "float64", "expected a float32 tensor")


# -- notebook 01: the byte-pair merge loop ---------------------------------------------------------

def _bpe_with(choose="lowest", once=False, as_bytes=False):
    def bpe_piece(piece, ranks):
        parts = [bytes([b]) for b in piece]
        while len(parts) > 1:
            pairs = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                     if parts[i] + parts[i + 1] in ranks]
            if not pairs:
                break
            i = {"lowest": min(pairs), "first": pairs[0], "highest": max(pairs, key=lambda p: (p[0], -p[1])),
                 "rightmost": min(pairs, key=lambda p: (p[0], -p[1]))}[choose][1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
            if once:
                break
        return parts if as_bytes else [ranks[p] for p in parts]
    return bpe_piece


def test_bpe_piece_check(sol, capsys):
    assert checks.check_bpe_piece(sol.bpe_piece) is sol.bpe_piece and "\u2713" in capsys.readouterr().out
    assert checks.check_bpe_piece(_bpe_with()) is not None                    # the helper itself is right
    fails(checks.check_bpe_piece, stub, "bpe_piece is not written yet")
    fails(checks.check_bpe_piece, _bpe_with("first"), "FIRST pair", "LOWEST rank")
    fails(checks.check_bpe_piece, _bpe_with("highest"), "highest rank", "LOWEST rank first")
    fails(checks.check_bpe_piece, _bpe_with("rightmost"), "LEFTMOST")
    fails(checks.check_bpe_piece, _bpe_with(once=True), "repeat")
    fails(checks.check_bpe_piece, _bpe_with(as_bytes=True), "ids", "not their bytes")


# -- notebook 01: the prompt queue ------------------------------------------------------------------

def _admit_with(front=False, top=None, negative=True, empty=True, longest=None, check_first=True):
    """The course's admit with one rule done another way."""
    def admit(queue, prompt, vocab, max_len):
        if not check_first:
            queue.append(prompt)
        if empty and not prompt:
            raise ValueError("empty")
        if any(t > vocab if top == "gt" else t >= vocab for t in prompt) or (negative and any(t < 0 for t in prompt)):
            raise ValueError("vocab")
        if len(prompt) > max_len if longest == "gt" else len(prompt) >= (max_len - 1 if longest == "short" else max_len):
            raise ValueError("long")
        if check_first:
            (queue.appendleft if front else queue.append)(prompt)
    return admit


def test_admit_check(sol, capsys):
    assert checks.check_admit(sol.admit) is sol.admit and "\u2713 admit" in capsys.readouterr().out
    assert checks.check_admit(_admit_with()) is not None                     # the helper itself is right
    fails(checks.check_admit, stub, "admit is not written yet", "show_solution('admit')")
    fails(checks.check_admit, _admit_with(front=True), "BACK (queue.append)")
    fails(checks.check_admit, _admit_with(top="gt"), "id == vocab (50)", "t >= vocab")
    fails(checks.check_admit, _admit_with(negative=False), "negative id")
    fails(checks.check_admit, _admit_with(empty=False), "empty prompt")
    fails(checks.check_admit, _admit_with(longest="gt"), "refuse len(prompt) >= max_len")
    fails(checks.check_admit, _admit_with(longest="short"), "max_len - 1 = 15 tokens fits")
    fails(checks.check_admit, _admit_with(check_first=False), "changed the queue first", "BEFORE")


# -- notebook 03: grouped-query causal attention -----------------------------------------------------

def _attention_with(repeat="interleave", mask=True, diagonal=0, scale="sqrt"):
    import math

    import torch

    def attention(q, k, v):
        t, hq, d = q.shape
        g = hq // k.shape[1]
        if repeat == "interleave":
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        else:
            k, v = k.repeat(1, g, 1), v.repeat(1, g, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / {"sqrt": math.sqrt(d), "none": 1.0, "d": d}[scale]
        if mask:
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(diagonal), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return attention


def test_attention_check(sol, capsys):
    assert checks.check_attention(sol.attention) is sol.attention and "\u2713" in capsys.readouterr().out
    assert checks.check_attention(_attention_with()) is not None             # the helper itself is right
    fails(checks.check_attention, stub, "attention is not written yet")
    fails(checks.check_attention, _attention_with(repeat="repeat"), "h // 2", "repeat_interleave")
    fails(checks.check_attention, _attention_with(mask=False), "mask the future")
    fails(checks.check_attention, _attention_with(diagonal=-1), "itself included", "tril()")
    fails(checks.check_attention, _attention_with(scale="none"), "1/sqrt(head_dim)", "no scale")
    fails(checks.check_attention, _attention_with(scale="d"), "1/sqrt(head_dim)", "1/D")


# -- notebook 03: RoPE ----------------------------------------------------------------------------

def _rope_with(pairs="halves", sign=1.0, swap=False, shift=0, rows=False):
    import torch

    def rope(x, pos, freqs):
        p = torch.arange(len(pos)) if rows else pos + shift
        ang = p[:, None].double() * freqs[None, :]
        cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
        if pairs == "neighbours":
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        first, second = x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin
        return torch.cat([second, first] if swap else [first, second], dim=-1)
    return rope


def test_rope_check(sol, capsys):
    assert checks.check_rope(sol.rope) is sol.rope and "\u2713 rope" in capsys.readouterr().out
    assert checks.check_rope(_rope_with()) is not None                         # the helper itself is right
    fails(checks.check_rope, stub, "rope is not written yet", "show_solution('rope')")
    fails(checks.check_rope, _rope_with(pairs="neighbours"), "pairs neighbours", "HALVES")
    fails(checks.check_rope, _rope_with(sign=-1.0), "turns the wrong way")
    fails(checks.check_rope, _rope_with(swap=True), "halves come back swapped")
    fails(checks.check_rope, _rope_with(shift=1), "position + 1")
    fails(checks.check_rope, _rope_with(rows=True), "the row number, not the token's position")


def _rms_norm_with(bug=None):
    """RMSNorm, right or with one planted bug."""
    import torch

    def rms_norm(x, w, eps):
        dim = 0 if bug == "first_dim" else -1
        ms = x.pow(2).sum(dim, keepdim=True) if bug == "sum" else x.pow(2).mean(dim, keepdim=True)
        if bug == "centred":
            x, ms = x - x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
        if bug == "eps_outside":
            return x / (ms.sqrt() + eps) * w
        if bug == "no_rsqrt":
            return x / (ms + eps) * w
        if bug == "keepdim":
            return x * torch.rsqrt(x.pow(2).mean(-1) + eps) * w
        out = x * torch.rsqrt(ms + (0.0 if bug == "no_eps" else eps))
        return out if bug == "no_weight" else out * w
    return rms_norm


def test_rms_norm_check(sol, capsys):
    assert checks.check_rms_norm(sol.rms_norm) is sol.rms_norm and "\u2713 rms_norm" in capsys.readouterr().out
    assert checks.check_rms_norm(_rms_norm_with()) is not None                 # the helper itself is right
    fails(checks.check_rms_norm, stub, "rms_norm is not written yet", "show_solution('rms_norm')")
    for bug, words in [("sum", ["MEAN of x\u00b2"]), ("no_eps", ["add eps inside", "NaN"]),
                       ("eps_outside", ["eps goes inside the square root"]), ("no_weight", ["learned weight w"]),
                       ("centred", ["does not subtract the mean", "LayerNorm"]), ("no_rsqrt", ["take the square root"]),
                       ("first_dim", ["LAST dimension"]), ("keepdim", ["keepdim=True"])]:
        fails(checks.check_rms_norm, _rms_norm_with(bug), *words)


def _layer_with(sol, bug=None):
    """The course's decoder layer (its rms_norm, rope, attention), right or with one planted bug."""
    import torch.nn.functional as F

    def decoder_layer(h, W, i, pos, freqs, cfg):
        p, t, eps = f"model.layers.{i}.", h.shape[0], cfg.rms_norm_eps
        x = sol.rms_norm(h, W[p + "input_layernorm.weight"], eps)
        q = (x @ W[p + "self_attn.q_proj.weight"].T).view(t, cfg.num_heads, cfg.head_dim)
        k = (x @ W[p + "self_attn.k_proj.weight"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = (x @ W[p + "self_attn.v_proj.weight"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
        if bug == "rope_v":
            v = sol.rope(v, pos, freqs)
        o = sol.attention(sol.rope(q, pos, freqs), k if bug == "no_rope_k" else sol.rope(k, pos, freqs), v)
        o = o.reshape(t, -1) @ (W[p + "self_attn.o_proj.weight"] if bug == "no_transpose" else W[p + "self_attn.o_proj.weight"].T)
        h2 = o if bug == "no_residual_attn" else h + o
        norm = "input_layernorm" if bug == "same_norm" else "post_attention_layernorm"
        x = sol.rms_norm(h if bug == "stale_norm" else h2, W[p + norm + ".weight"], eps)
        gate, up = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
        act = F.silu(up) * gate if bug == "silu_up" else F.silu(gate) * up
        m = act @ W[p + "mlp.down_proj.weight"].T
        return m if bug == "no_residual_mlp" else h2 + m
    return decoder_layer


def test_decoder_layer_check(sol, capsys):
    assert checks.check_decoder_layer(sol.decoder_layer) is sol.decoder_layer
    assert "\u2713 decoder_layer" in capsys.readouterr().out
    assert checks.check_decoder_layer(_layer_with(sol)) is not None           # the helper itself is right
    fails(checks.check_decoder_layer, stub, "decoder_layer is not written yet")
    for bug, words in [("no_residual_attn", ["add the attention's output to the residual"]),
                       ("no_residual_mlp", ["add the MLP's output"]), ("same_norm", ["post_attention_layernorm"]),
                       ("stale_norm", ["AFTER the attention's residual add"]), ("no_rope_k", ["rotate k as well"]),
                       ("rope_v", ["v is used as it is"]), ("silu_up", ["SiLU goes on the gate"]),
                       ("no_transpose", ["x @ W.T"])]:
        fails(checks.check_decoder_layer, _layer_with(sol, bug), *words)


# -- outside Jupyter ---------------------------------------------------------------------------------

def test_check_a_chapter_from_the_command_line(tmp_path):
    """`python -m pagedlab.course check 07 FILE` runs 07's checks on what FILE defines: a passing
    piece is reported as passing, a wrong one with its check's hint (exit status 1), a missing one
    by name; without FILE the course's solutions pass (exit status 0)."""
    import os
    import subprocess
    import sys
    mine = tmp_path / "my_pieces.py"
    mine.write_text(
        "from collections import deque\n\n\n"
        "class Allocator:\n"
        "    def __init__(self, num_blocks):\n"
        "        self.free_list, self.owner = deque(range(num_blocks)), {}\n\n"
        "    def allocate(self, who, n=1):\n"
        "        if n > len(self.free_list):\n"
        "            raise RuntimeError('out of blocks')\n"
        "        got = [self.free_list.popleft() for _ in range(n)]\n"
        "        self.owner.update({b: who for b in got})\n"
        "        return got\n\n"
        "    def free(self, blocks):\n"
        "        if any(b not in self.owner for b in blocks):\n"
        "            raise RuntimeError('not in use')\n"
        "        for b in blocks:\n"
        "            del self.owner[b]\n"
        "            self.free_list.append(b)\n\n\n"
        "def token_slot(row, n, block_size):\n"
        "    return row[n // block_size] * block_size            # forgets n % block_size\n")
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLAB_SOLUTIONS"}

    def run(*args, env=env):
        return subprocess.run([sys.executable, "-m", "pagedlab.course", *args], capture_output=True, text=True,
                              timeout=120, env=env, cwd=tmp_path)
    r = run("check", "07", str(mine))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "\u2713 Allocator" in r.stdout and "\u2717 token_slot" in r.stdout and "Hint: the offset inside the block is missing" in r.stdout
    mine.write_text("def schedule_step(state):\n    raise NotImplementedError\n")
    r = run("check", "10", str(mine))
    assert r.returncode == 1 and "defines no make_room" in r.stdout, r.stdout + r.stderr
    # Triton kernels on a CPU: the command turns the interpreter on when the environment did not
    r = run("check", "4", env={k: v for k, v in env.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 0 and "\u2713 flash_attn_kernel" in r.stdout, r.stdout + r.stderr
    mine.write_text("import json, struct\nimport numpy as np, torch\n\n\n"        # 02: no read_tensor (the notebook's)
                    "def parse_header(buf):\n"
                    "    (n,) = struct.unpack('<Q', buf[:8])                  # no length check\n"
                    "    h = json.loads(buf[8:8 + n])\n"
                    "    return {k: (v['dtype'], v['shape'], 8 + n + v['data_offsets'][0], 8 + n + v['data_offsets'][1])\n"
                    "            for k, v in h.items() if k != '__metadata__'}\n\n\n"
                    "def bf16_to_fp32(raw):\n"
                    "    return torch.from_numpy((np.frombuffer(raw, '<u2').astype(np.uint32) << 16).view(np.float32).copy())\n")
    r = run("check", "02", str(mine))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "\u2717 parse_header" in r.stdout and "len(buf) >= 8" in r.stdout and "\u2713 bf16_to_fp32" in r.stdout
    assert "- read_tensor: not in" in r.stdout, r.stdout
    mine.write_text("def quantize_fp8(w):\n    raise NotImplementedError\n")         # 14 checks two pieces
    r = run("check", "14", str(mine))
    assert r.returncode == 1 and "defines no dequantize_fp8" in r.stdout, r.stdout + r.stderr


# -- 00: the slot timeline; 09: the engine step ---------------------------------------------------------

def _timeline_variant(**bug):
    """The course's timeline with one planted bug."""
    def timeline(trace):
        steps = trace.steps
        if bug.get("per_step"):                         # one row per step instead of per slot
            return "\n".join("".join("." if r is None else "abcdefghijklmnopqrstuvwxyz"[r % 26]
                                     for r in s.slot_request) for s in steps)
        rows = []
        for slot in range(trace.num_slots):
            marks = ""
            for s in steps:
                rid, phase = s.slot_request[slot], s.slot_phase[slot]
                if rid is None:
                    marks += " " if bug.get("blank_idle") else "."
                    continue
                letter = "abcdefghijklmnopqrstuvwxyz"[rid % 26] if not bug.get("no_wrap") else chr(ord("a") + rid)
                upper = (phase == "decode") if bug.get("case_swapped") else (phase == "prefill")
                marks += letter.upper() if upper else letter
            rows.append(f"slot {slot} | {marks} |" if bug.get("frame") else f"slot {slot:2d} |{marks}|")
        return "\n".join(rows)
    return timeline


def test_timeline_check(sol, capsys):
    assert checks.check_timeline(sol.timeline) is sol.timeline
    assert "\u2713 timeline" in capsys.readouterr().out
    msg = fails(checks.check_timeline, stub, "timeline is not written yet", "course.show_solution('timeline')")
    assert "Traceback" not in msg
    for bug, words in [("case_swapped", ["UPPER case marks the step where the request was prefilled"]),
                       ("per_step", ["one ROW per slot"]),
                       ("blank_idle", ["an idle slot (slot_request is None) is '.'"]),
                       ("no_wrap", ["ids past 25 wrap around", "rid % 26"]),
                       ("frame", ["the frame is not"])]:
        fails(checks.check_timeline, _timeline_variant(**{bug: True}), *words)
    assert checks.check_timeline(_timeline_variant()) is not None          # the variant helper is sound


def _step_variant(bug):
    def engine_step(scheduler, runner):
        if bug == "schedule_twice":
            scheduler.schedule()
        batch = scheduler.schedule()
        if batch.empty and bug != "run_empty":
            return batch
        tokens = runner.run(batch)
        if bug == "no_accept":
            return batch
        scheduler.accept(batch, tokens[::-1] if bug == "reversed" else tokens)
        return batch
    return engine_step


def test_engine_step_check(sol, capsys):
    assert checks.check_engine_step(sol.engine_step) is sol.engine_step
    assert "\u2713 engine_step" in capsys.readouterr().out
    fails(checks.check_engine_step, stub, "engine_step is not written yet", "course.show_solution('engine_step')")
    fails(checks.check_engine_step, _step_variant("no_accept"), "scheduler.accept(batch, tokens) appends them")
    fails(checks.check_engine_step, _step_variant("schedule_twice"), "schedule() once per step")
    fails(checks.check_engine_step, _step_variant("run_empty"), "batch.empty is True", "return before runner.run")
    fails(checks.check_engine_step, _step_variant("reversed"), "accept exactly what the runner returned")
    assert checks.check_engine_step(_step_variant(None)) is not None
