"""Solutions to the pieces the notebooks ask you to write (each checked by a course.check_* cell).
Read one with course.show_solution("name"); PAGEDLAB_SOLUTIONS=1 makes every check use these."""
from collections import deque

from pagedlab.kv_cache import blocks_needed


# -- 05 -----------------------------------------------------------------------------------------
def generate_with_cache(prompt, n):
    # uses the notebook's new_cache and run (they drive pagedlab's model by hand)
    new_cache, run = _notebook("new_cache"), _notebook("run")
    cache, table = new_cache(len(prompt) + n)
    out = [int(run(cache, table, prompt, 0).argmax())]             # prefill: the prompt, once
    work = len(prompt)
    for _ in range(n - 1):
        out.append(int(run(cache, table, [out[-1]], len(prompt) + len(out) - 1).argmax()))  # decode
        work += 1
    return out, work


def _notebook(name):
    """A name from the running notebook (IPython's user namespace)."""
    import __main__
    return getattr(__main__, name)


# -- 06 -----------------------------------------------------------------------------------------
def decode_one(q, k, v, row, length, kv_head, scale):
    import torch
    block_size = k.shape[1]
    m, l = float("-inf"), 0.0                       # running max and sum of the online softmax
    acc = torch.zeros_like(q, dtype=torch.float32)
    for n in range(length):
        block = row[n // block_size]                    # the block table: logical -> physical
        key = k[block, n % block_size, kv_head].float()
        val = v[block, n % block_size, kv_head].float()
        s = float(q.float() @ key) * scale
        m_new = max(m, s)
        alpha, p = torch.exp(torch.tensor(m - m_new)), torch.exp(torch.tensor(s - m_new))
        l = l * alpha + p
        acc = acc * alpha + p * val
        m = m_new
    return acc / l


# -- 07 -----------------------------------------------------------------------------------------
class Allocator:
    def __init__(self, num_blocks):
        self.free_list = deque(range(num_blocks))
        self.owner = {}

    def allocate(self, who, n=1):
        if n > len(self.free_list):
            raise RuntimeError(f"out of blocks: need {n}, {len(self.free_list)} free")
        got = [self.free_list.popleft() for _ in range(n)]
        self.owner.update({b: who for b in got})
        return got

    def free(self, blocks):
        if any(b not in self.owner for b in blocks) or len(set(blocks)) != len(blocks):
            raise RuntimeError(f"freeing blocks not in use: {blocks}")
        for b in blocks:
            del self.owner[b]
            self.free_list.append(b)


def token_slot(row, n, block_size):
    return row[n // block_size] * block_size + n % block_size


# -- 08 -----------------------------------------------------------------------------------------
def schedule_step(state):
    bs = state.block_size
    # 1. room for each running request's next token (oldest first)
    for seq in state.running:
        need = blocks_needed(seq.num_tokens, bs) - len(seq.blocks)
        if need > 0:
            seq.blocks += state.allocator.allocate(seq.rid, need)
    # 2. refill free slots from the front of the queue, lowest slot first
    while state.queue and None in state.slots:
        seq = state.queue.popleft()
        seq.blocks = state.allocator.allocate(seq.rid, blocks_needed(seq.num_tokens, bs))
        state.slots[state.slots.index(None)] = seq
        state.running.append(seq)
    ran = [s.rid if s is not None else None for s in state.slots]
    # 3. every request in a slot makes one token (a prefill makes its first)
    for seq in state.running:
        seq.generated += 1
    # 4. stop -> free
    for seq in list(state.running):
        if seq.generated == seq.max_new_tokens:
            state.allocator.free(seq.blocks)
            seq.blocks = []
            state.slots[state.slots.index(seq)] = None
            state.running.remove(seq)
            state.finished.append(seq.rid)
    return ran


# -- 10 -----------------------------------------------------------------------------------------
def make_room(state, seq):
    need = blocks_needed(seq.num_tokens, state.block_size) - len(seq.blocks)
    while need > state.allocator.num_free:
        victim = state.running[-1]                  # the newest: it has done the least work
        state.allocator.free(victim.blocks)
        victim.blocks = []
        state.slots[state.slots.index(victim)] = None
        state.running.remove(victim)
        state.queue.appendleft(victim)              # keeps its tokens; recomputed when it returns
        state.preempted.append(victim.rid)
        if victim is seq:
            return False
    if need > 0:
        seq.blocks += state.allocator.allocate(seq.rid, need)
    return True


# -- 02 -----------------------------------------------------------------------------------------
def parse_header(buf):
    import json
    import math
    import struct
    if len(buf) < 8:
        raise ValueError(f"{len(buf)} bytes: too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", buf[:8])                        # u64, little-endian
    if 8 + n > len(buf):
        raise ValueError(f"header of {n} bytes past the end of a {len(buf)}-byte file")
    header, data = json.loads(buf[8:8 + n]), 8 + n           # the data starts after the JSON
    out = {}
    for name, h in header.items():
        if name == "__metadata__":                             # free-form strings, not a tensor
            continue
        start, end = h["data_offsets"]                         # counted from the end of the header
        if not 0 <= start <= end <= len(buf) - data:
            raise ValueError(f"{name}: bytes {start}..{end} outside the {len(buf) - data} bytes of data")
        size = {"BF16": 2, "F16": 2, "F32": 4}[h["dtype"]]
        if end - start != math.prod(h["shape"]) * size:
            raise ValueError(f"{name}: {end - start} bytes for shape {h['shape']} of {h['dtype']}")
        out[name] = (h["dtype"], h["shape"], data + start, data + end)
    return out


def bf16_to_fp32(raw):
    import numpy as np
    import torch
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32)    # widen the 16 bits to 32
    return torch.from_numpy((bits << 16).view(np.float32).copy())   # the top half of an fp32


def read_tensor(path, name):
    import mmap

    import numpy as np
    import torch
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        dtype, shape, start, end = parse_header(buf)[name]
        raw = buf[start:end]
    if dtype == "BF16":
        x = bf16_to_fp32(raw)
    else:
        x = torch.from_numpy(np.frombuffer(raw, {"F16": "<f2", "F32": "<f4"}[dtype]).astype(np.float32))
    return x.reshape(shape)


# -- 01 -----------------------------------------------------------------------------------------
def admit(queue, prompt, vocab, max_len):
    if not prompt:
        raise ValueError("empty prompt")
    bad = [t for t in prompt if not 0 <= t < vocab]           # ids are 0 .. vocab - 1
    if bad:
        raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {vocab})")
    if len(prompt) >= max_len:                                 # room for at least one new token
        raise ValueError(f"prompt of {len(prompt)} tokens: at most {max_len - 1} fit")
    queue.append(prompt)                                       # checked: now it waits, at the back


def bpe_piece(piece, ranks):
    parts = [bytes([b]) for b in piece]                  # start from single bytes
    while len(parts) > 1:
        pairs = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                 if parts[i] + parts[i + 1] in ranks]
        if not pairs:                                    # no adjacent pair is a token: done
            break
        _, i = min(pairs)                                # the lowest rank; the leftmost of equals
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


# -- 03 -----------------------------------------------------------------------------------------
def rms_norm(x, w, eps):                         # x [..., H], w [H]
    import torch
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w     # no mean subtracted, eps inside


def decoder_layer(h, W, i, pos, freqs, cfg):     # h [T, hidden] -> h after layer i
    import torch.nn.functional as F
    p, t, eps = f"model.layers.{i}.", h.shape[0], cfg.rms_norm_eps
    x = rms_norm(h, W[p + "input_layernorm.weight"], eps)
    q = (x @ W[p + "self_attn.q_proj.weight"].T).view(t, cfg.num_heads, cfg.head_dim)
    k = (x @ W[p + "self_attn.k_proj.weight"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
    v = (x @ W[p + "self_attn.v_proj.weight"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
    o = attention(rope(q, pos, freqs), rope(k, pos, freqs), v)          # v is not rotated
    h = h + o.reshape(t, -1) @ W[p + "self_attn.o_proj.weight"].T       # the residual add
    x = rms_norm(h, W[p + "post_attention_layernorm.weight"], eps)      # the updated h, its own norm
    gate, up = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ W[p + "mlp.down_proj.weight"].T


def rope(x, pos, freqs):                         # x [T, H, D], pos [T], freqs [D/2]
    import torch
    ang = pos[:, None].double() * freqs[None, :]                 # [T, D/2]: position times frequency
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]   # broadcast over heads
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]           # coordinate i pairs with i + D/2
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(q, k, v):                          # q [T, Hq, D], k/v [T, Hkv, D]
    import math

    import torch
    t, hq, d = q.shape
    g = hq // k.shape[1]                         # query heads per KV head
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)     # head h -> KV head h // g
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()      # key <= query, itself included
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v)


# -- 00 -----------------------------------------------------------------------------------------
def timeline(trace):
    rows = []
    for slot in range(trace.num_slots):
        marks = ""
        for s in trace.steps:
            rid, phase = s.slot_request[slot], s.slot_phase[slot]
            if rid is None:
                marks += "."                                    # idle
            else:
                letter = "abcdefghijklmnopqrstuvwxyz"[rid % 26]
                marks += letter.upper() if phase == "prefill" else letter
        rows.append(f"slot {slot:2d} |{marks}|")
    return "\n".join(rows)


# -- 09 -----------------------------------------------------------------------------------------
def engine_step(scheduler, runner):
    batch = scheduler.schedule()              # who runs this step, with which blocks (plain Python)
    if batch.empty:                           # nothing to run
        return batch
    tokens = runner.run(batch)                # the device: forward and sample, one read to the host
    scheduler.accept(batch, tokens)           # tokens appended, stops found, finished freed
    return batch
