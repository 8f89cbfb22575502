"""Notebook 09's capstone: an engine of the learner's own, from the pieces written in 01-10.

    pieces = own_engine.your_pieces(bpe_piece=..., rms_norm=..., rope=..., attention=...,
                                    decode_one=..., Allocator=..., make_room=...)

Each piece is the learner's when given; left None it is pagedlab's own -- or, with
PAGEDLAB_SOLUTIONS=1, the course's solution -- and `your_pieces` prints one line per piece saying
which. The pieces go where pagedlab's would:

    tokenizer_from(bpe_piece, llm.tokenizer)   01's merge loop inside an encode (and a chat template)
                                               for this model's vocabulary: Llama 3's ranks and
                                               pre-tokenizer, a byte-level BPE's (SmolLM2's) vocab,
                                               or one id per byte (a byte tokenizer)
    plug_forward(llm, rms_norm, rope, attention)
                                               03's pieces as the model's math, around pagedlab's
                                               paged KV cache: RMSNorm before QKV, the MLP and the
                                               head; RoPE on q and k; causal attention over each
                                               sequence's cached keys, asked for its new rows only
    LLM(allocator=, scheduler=, decode_kernel=) 07's Allocator, 10's make_room, 06's decode_one
                                               (pagedlab/plugins.py)

03's decoder_layer is not plugged as a whole: it computes every key of the sequence on each call,
while an engine computes a token's key once and keeps it in the cache. The engine's layer
(pagedlab/model.py) is decoder_layer's wiring with the cache in the middle, and it calls the
three pieces decoder_layer calls.
"""
from __future__ import annotations

import functools
import json
from types import SimpleNamespace

from .chapter import CheckFailed, solutions_on

# where each piece was written, and pagedlab's own in its place
PIECES = {
    "bpe_piece": ("01", "pagedlab's tokenizer"),
    "rms_norm": ("03", "pagedlab's RMSNorm"),
    "rope": ("03", "pagedlab's RoPE"),
    "attention": ("03", "pagedlab's attention"),
    "decode_one": ("06", "pagedlab's decode kernel"),
    "Allocator": ("07", "pagedlab's BlockAllocator"),
    "make_room": ("10", "pagedlab's Scheduler.make_room"),
}


def your_pieces(verbose: bool = True, **given) -> dict:
    """{name: (piece or None, who)}: the learner's piece when given, else with PAGEDLAB_SOLUTIONS=1
    the course's solution, else None (pagedlab's own is used). Prints one line per piece."""
    from .checks import solution
    out = {}
    if verbose and solutions_on():
        print("  (PAGEDLAB_SOLUTIONS=1: the course's solution in place of every piece left None)")
    for name, (chapter, theirs) in PIECES.items():
        yours = given.pop(name, None)
        if yours is not None:
            out[name] = (yours, "yours")
        elif solutions_on():
            out[name] = (solution(name), "the course's solution")
        else:
            out[name] = (None, theirs)
        if verbose:
            print(f"  {name:10} ({chapter}): {out[name][1]}")
    if given:
        raise TypeError(f"your_pieces(): no piece named {sorted(given)}; the pieces are {list(PIECES)}")
    return out


def who(pieces: dict, name: str) -> str:
    return pieces[name][1]


QUESTIONS = ["What is 2+2?", "Name a color.", "Say hello.", "Capital of France?", "Why is the sky blue?",
             "Name three fruits.", "What does a CPU do?", "Translate 'good morning' into French.",
             "How many legs does a spider have?", "Write one sentence about the sea.",
             "At what temperature does water boil?", "Give me a word that rhymes with cat."]


def chat_prompts(n: int) -> list[str]:
    """n short chat prompts (text): QUESTIONS, then again with a number (n > 12: still distinct)."""
    return [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i // len(QUESTIONS) + 1})")
            for i in range(n)]


def course_twin(forward: dict, decode_plugged: bool):
    """The engine a mismatch is judged by, as (forward pieces, LLM plug-ins): the course's solution
    in place of each plugged piece that computes values (rms_norm, rope, attention, decode_one), and
    pagedlab's own allocator and scheduler. None when no plugged piece computes values."""
    from ..plugins import decode_kernel_from
    from .checks import solution
    if not decode_plugged and all(f is None for f in forward.values()):
        return None
    return ({n: f and solution(n) for n, f in forward.items()},
            {"decode_kernel": decode_kernel_from(solution("decode_one"))} if decode_plugged else {})


def check_same(got, want, rerun=None) -> None:
    """got, want: [(token ids, preemptions)] per request, from your engine and pagedlab's. Equal, or a
    CheckFailed -- unless `rerun()` (course_twin's engine: the course's solutions for the pieces of
    yours that compute, pagedlab's allocator and scheduler) gives exactly your tokens and preemptions:
    then your pieces compute what the course's do, and both part from pagedlab's kernels where two
    scores nearly tie (another order of additions rounds otherwise in the last bits); that is said,
    not failed."""
    bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if bad is None:
        return
    (a, pa), (b, pb) = got[bad], want[bad]
    if rerun is not None and rerun() == got:
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"note: request {bad} parts from pagedlab's at its token {j} ({a[j:j + 3]} vs {b[j:j + 3]}), and "
              "the course's solutions give exactly your tokens: a near-tie of two scores, rounded another way "
              "by your pieces' order of additions than by pagedlab's kernels -- not a bug in your pieces")
        return
    raise CheckFailed(f"request {bad}: your engine gave {a} ({pa} preemptions), pagedlab's {b} ({pb}).\n"
                      "Plug one piece at a time (set the others to None) to find the one that differs.")


# -- 01: the tokenizer, with the learner's merge loop ----------------------------------------------

@functools.lru_cache(maxsize=1)
def byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: {printable character: the byte it stands for}.
    Byte-level BPE vocabularies (GPT-2, SmolLM2, Llama 3's tokenizer.json) write every byte as a
    printable character: the printable ones as themselves, the others as 256 + their rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def bpe_tables(tok):
    """(ranks: bytes -> id, pieces: text -> [bytes], kind) for pagedlab's tokenizer `tok`, the
    way 01's encode uses them; None when its vocabulary is not BPE over bytes by rank."""
    from ..tokenizer import LLAMA3_PATTERN, ByteTokenizer, HFTokenizer, Llama3Tokenizer
    if isinstance(tok, Llama3Tokenizer):
        import regex
        pattern = regex.compile(LLAMA3_PATTERN)
        return tok.bpe._mergeable_ranks, lambda text: [p.encode("utf-8") for p in pattern.findall(text)], \
            "Llama 3's ranks and pre-tokenizer (01)"
    if isinstance(tok, ByteTokenizer):
        return {bytes([b]): b % tok.vocab_size for b in range(256)}, lambda text: [text.encode("utf-8")], \
            "one id per byte (this model's byte tokenizer: nothing to merge)"
    if isinstance(tok, HFTokenizer):
        backend = getattr(tok.hf, "backend_tokenizer", None)
        spec = json.loads(backend.to_str()) if backend is not None else {}
        model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
        if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel" or spec.get("normalizer"):
            return None
        chars, vocab = byte_level_chars(), model["vocab"]
        merged = [vocab.get("".join(m.split(" ", 1) if isinstance(m, str) else m)) for m in model.get("merges", [])]
        if None in merged or any(a >= b for a, b in zip(merged, merged[1:])):
            return None                            # ids not in merge order: an id is not a rank here
        ranks = {bytes(chars[c] for c in s): i for s, i in vocab.items() if all(c in chars for c in s)}
        pre = backend.pre_tokenizer

        def pieces(text):
            return [bytes(chars[c] for c in p) for p, _ in pre.pre_tokenize_str(text)] if pre else [text.encode()]
        return ranks, pieces, f"this checkpoint's byte-level BPE ({len(ranks):,} tokens; ids in merge order)"
    return None


class YourTokenizer:
    """pagedlab's tokenizer `base` with encode's merge loop replaced by `bpe_piece(piece, ranks)`
    (01): the same pre-tokenizer, vocabulary, special tokens and chat template; decode is base's."""

    def __init__(self, bpe_piece, base):
        tables = bpe_tables(base)
        if tables is None:
            raise ValueError(f"{type(base).__name__}: not a byte-pair vocabulary merged by rank")
        self.ranks, self._pieces, self.kind = tables
        self.bpe_piece, self.base = bpe_piece, base
        self.vocab_size, self.bos_token_id = base.vocab_size, base.bos_token_id
        self.special_tokens = getattr(base, "special_tokens", {})

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [int(t) for p in self._pieces(text) for t in self.bpe_piece(p, self.ranks)]
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.base.decode(ids, skip_special)

    def chat(self, prompt) -> list[int]:
        """The chat template around `prompt`, its text encoded by encode above."""
        from ..tokenizer import HFTokenizer, _normalize_messages
        if not isinstance(self.base, HFTokenizer):
            return type(self.base).chat(self, prompt)        # Llama 3's and the byte tokenizer's call self.encode
        text = self.base._render(_normalize_messages(prompt), add_generation_prompt=True)
        ids, pos = [], 0
        for m in self.base._special_re.finditer(text):       # the template's markers are special tokens
            ids += self.encode(text[pos:m.start()]) + [self.special_tokens[m.group()]]
            pos = m.end()
        return ids + self.encode(text[pos:])


def tokenizer_from(bpe_piece, base):
    """(tokenizer, what it is): a YourTokenizer when `bpe_piece` is given and base's vocabulary is
    merged by rank; else base itself (pagedlab's)."""
    if bpe_piece is None:
        return base, "pagedlab's"
    try:
        tok = YourTokenizer(bpe_piece, base)
    except ValueError as e:
        print(f"  (bpe_piece cannot run here: {e}; pagedlab's tokenizer instead)")
        return base, "pagedlab's"
    return tok, tok.kind


def check_tokenizer(tok, base, texts):
    """Your tokenizer's chat ids for every text equal pagedlab's (prints a pass, returns tok); a
    CheckFailed naming the first difference otherwise -- unless the course's own merge loop differs
    there too: then this vocabulary is not BPE by rank alone (not your loop's fault), and pagedlab's
    tokenizer `base` is returned instead, with a line saying so."""
    if tok is base:                                   # no bpe_piece of yours: nothing to check
        return base
    for text in texts:
        got, want = tok.chat(text), base.chat(text)
        if got == want:
            continue
        i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        from .checks import solution
        if YourTokenizer(solution("bpe_piece"), base).chat(text) != want:
            print(f"tokenizer: pagedlab's -- this vocabulary is not BPE by rank alone: the course's merge loop "
                  f"differs from pagedlab's tokenizer too on {text!r} (id {i}), so your loop is not to blame")
            return base
        raise CheckFailed(f"{text!r}: your tokenizer gave ids {got[max(0, i - 2):i + 4]} from id {max(0, i - 2)} on, "
                          f"pagedlab's {want[max(0, i - 2):i + 4]} (the first of {len(want)} that differs: id {i}: "
                          f"{base.decode(want[i:i + 1])!r}).\nHint: your bpe_piece passed 01's check? Run it there again "
                          "on this piece: merge the LOWEST-rank pair (the leftmost of equals) until none is left.")
    print(f"\u2713 your tokenizer: pagedlab's ids for all {len(texts)} chat prompts "
          f"({sum(len(base.chat(t)) for t in texts)} tokens), e.g. {texts[0]!r} -> {tok.chat(texts[0])[:12]}...")
    return tok


# -- 03: the model's math from the learner's pieces ------------------------------------------------

def forward_kernels(base, config, device, rms_norm=None, rope=None, attention=None):
    """The model's kernel functions (kernels/__init__.py's names) with RMSNorm, RoPE and attention
    done by the learner's pieces where given: each computes in fp32 and hands back the model's
    dtype, as pagedlab's torch references do. Attention runs one sequence at a time: its keys and
    values are read from the paged cache (the block table's row), the step's queries put at their
    positions, and only those rows of your causal attention kept -- a decode step is the last row of
    causal attention over the whole sequence. (Slower than pagedlab's kernels, and a Python loop
    over sequences: your pieces, not an engine's.)"""
    import torch

    from ..kernels.activation import silu_and_mul_torch
    from ..kernels.gemv import _qkv_composed
    from ..kernels.kv_store import kv_store_torch
    from ..kernels.rmsnorm import rms_norm_torch
    from ..kernels.rope import rope_inv_freq, rope_torch
    from ..kv_cache import blocks_needed
    from ..quantization import linear

    ops = SimpleNamespace(**vars(base))
    ops.learner_pieces = [n for n, f in (("rms_norm", rms_norm), ("rope", rope), ("attention", attention)) if f is not None]
    if not ops.learner_pieces:
        return base
    norm = rms_norm_torch if rms_norm is None else (lambda x, w, eps: rms_norm(x.float(), w.float(), eps).to(x.dtype))
    if rope is None:
        rotate = rope_torch
    else:
        freqs = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(device)

        def rotate(q, k, positions, cos_sin):
            return (rope(q.float(), positions, freqs).to(q.dtype), rope(k.float(), positions, freqs).to(k.dtype))

    def norm_qkv_rope_store(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads):
        return _qkv_composed(norm, rotate, kv_store_torch, x, norm_w, eps, w, positions, cos_sin,
                             k_cache, v_cache, slot_mapping, num_heads)

    def norm_swiglu(x, norm_w, eps, w_gate_up):
        return silu_and_mul_torch(linear(norm(x, norm_w, eps), w_gate_up))

    def norm_lm_head(x, norm_w, eps, w, greedy=False):
        logits = linear(norm(x, norm_w, eps), w).float()
        return (logits, logits.argmax(dim=-1)) if greedy else logits

    ops.norm_qkv_rope_store, ops.norm_swiglu, ops.norm_lm_head = norm_qkv_rope_store, norm_swiglu, norm_lm_head
    if attention is None:
        return ops

    def attend_each(q, k_cache, v_cache, block_table, starts, seq_lens, scale):
        """q [T, Hq, D]: sequence i's new rows are q[starts[i]:starts[i + 1]], its last rows."""
        d, bs, hkv = q.shape[-1], k_cache.shape[1], k_cache.shape[2]
        if abs(scale - d ** -0.5) > 1e-12:
            raise ValueError(f"attention scales by 1/sqrt(head_dim); this model asks for {scale}")
        out = torch.empty_like(q)
        for i, n in enumerate(seq_lens.tolist()):
            a, b = starts[i], starts[i + 1]
            row = block_table[i, :blocks_needed(n, bs)].long()
            k = k_cache[row].reshape(-1, hkv, d)[:n].float()          # the sequence's keys, in order
            v = v_cache[row].reshape(-1, hkv, d)[:n].float()
            qs = q.new_zeros(n, q.shape[1], d, dtype=torch.float32)   # queries of earlier tokens: unused
            qs[n - (b - a):] = q[a:b].float()
            out[a:b] = attention(qs, k, v)[n - (b - a):].to(q.dtype)
        return out

    def prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, max_q_len=None):
        return attend_each(q, k_cache, v_cache, block_table, cu_seqlens_q.tolist(), seq_lens, scale)

    def decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, max_seq_len=None):
        return attend_each(q, k_cache, v_cache, block_table, list(range(q.shape[0] + 1)), seq_lens, scale)

    ops.prefill_attention = prefill_attention
    if not getattr(base, "decode_plugged", False):               # 06's decode_one, when plugged, stays
        ops.decode_attention = decode_attention
    return ops


def plug_forward(llm, rms_norm=None, rope=None, attention=None) -> list[str]:
    """Put the learner's RMSNorm, RoPE and attention into `llm`'s model (an LLM built with
    cuda_graphs=False: a graph would replay pagedlab's kernels). Returns the pieces plugged."""
    model = llm.model
    if llm.engine_config.cuda_graphs is True and model.device.type == "cuda":
        raise ValueError("plug_forward needs an LLM built with cuda_graphs=False")
    model.kernels = forward_kernels(model.kernels, model.config, model.device, rms_norm, rope, attention)
    return list(getattr(model.kernels, "learner_pieces", []))
