"""Notebook 09's capstone (pagedlab/course/own_engine.py): the learner's tokenizer loop and forward
pieces in pagedlab's engine give pagedlab's ids and tokens with the course's solutions, a planted
bug in either is caught by the notebook's checks, and each piece left None is pagedlab's own (and
the printed line says so)."""
from __future__ import annotations

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.course import CheckFailed, DEMO_PROMPTS, own_engine
from pagedlab.course.chapter import load_pieces

TEXTS = DEMO_PROMPTS + ["  spaces and\ttabs, naïve café ☕ 12345678 don't WON'T", "Hello, world!"]


@pytest.fixture(scope="module")
def sol():
    return load_pieces()            # the course's solutions/pieces.py, as the notebooks load it


def _highest_rank_first(piece, ranks):              # 01's planted bug: merges the HIGHEST rank first
    parts = [bytes([b]) for b in piece]
    while True:
        pairs = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
        if not pairs:
            return [ranks[p] for p in parts]
        i = max(pairs)[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def test_your_pieces_say_whose_they_are(sol, monkeypatch, capsys):
    monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)
    got = own_engine.your_pieces(rope=sol.rope)
    out = capsys.readouterr().out
    assert got["rope"] == (sol.rope, "yours") and "rope       (03): yours" in out
    assert got["bpe_piece"] == (None, "pagedlab's tokenizer") and "bpe_piece  (01): pagedlab's tokenizer" in out
    assert all(got[n][0] is None for n in own_engine.PIECES if n != "rope")
    monkeypatch.setenv("PAGEDLAB_SOLUTIONS", "1")
    got = own_engine.your_pieces(verbose=False)
    assert all(got[n][1] == "the course's solution" and callable(got[n][0]) for n in own_engine.PIECES)
    with pytest.raises(TypeError, match="no piece named"):
        own_engine.your_pieces(bpe=sol.bpe_piece)


def test_tokenizer_loop_gives_pagedlabs_ids_and_a_bug_is_named(sol):
    from pagedlab.tokenizer import ByteTokenizer, Llama3Tokenizer
    llama3 = Llama3Tokenizer()
    for base in (llama3, ByteTokenizer(300, 1, [2])):
        tok, kind = own_engine.tokenizer_from(sol.bpe_piece, base)
        assert isinstance(tok, own_engine.YourTokenizer), kind
        assert own_engine.check_tokenizer(tok, base, TEXTS) is tok
        assert tok.chat(TEXTS[0]) == base.chat(TEXTS[0]) and tok.encode(TEXTS[-1]) == base.encode(TEXTS[-1])
    assert own_engine.tokenizer_from(None, llama3) == (llama3, "pagedlab's")
    assert own_engine.check_tokenizer(llama3, llama3, TEXTS) is llama3
    with pytest.raises(CheckFailed, match="LOWEST-rank pair"):
        own_engine.check_tokenizer(own_engine.YourTokenizer(_highest_rank_first, llama3), llama3, TEXTS)



def test_a_vocabulary_the_course_cannot_merge_falls_back_to_pagedlabs(monkeypatch, capsys):
    """When the course's own loop differs from pagedlab's tokenizer too, the learner is not blamed."""
    from pagedlab.course import checks
    from pagedlab.tokenizer import ByteTokenizer
    base = ByteTokenizer(300, 1, [2])
    shifted = own_engine.YourTokenizer(lambda piece, ranks: [b + 1 for b in piece], base)
    monkeypatch.setattr(checks, "solution", lambda name: (lambda piece, ranks: [0] * len(piece)))
    assert own_engine.check_tokenizer(shifted, base, TEXTS) is base
    assert "not BPE by rank alone" in capsys.readouterr().out


@pytest.mark.slow
def test_tokenizer_loop_on_smollm2s_byte_level_vocabulary(sol, smollm2_llm):
    base = smollm2_llm.tokenizer
    tok, kind = own_engine.tokenizer_from(sol.bpe_piece, base)
    assert "byte-level BPE" in kind
    assert own_engine.check_tokenizer(tok, base, TEXTS + own_engine.chat_prompts(12)) is tok
    with pytest.raises(CheckFailed, match="LOWEST-rank pair"):
        own_engine.check_tokenizer(own_engine.YourTokenizer(_highest_rank_first, base), base, TEXTS)


def _run(llm, prompts, sp):
    return [(o.token_ids, o.num_preemptions) for o in llm.generate(prompts, sp)]


def test_forward_pieces_give_pagedlabs_tokens_and_a_bug_fails_the_check(sol):
    """A pool of 8 blocks for 4 requests of 16-31 tokens: prefill, decode, preemption and recompute
    all run through the learner's attention (its rows at the sequence's end, keys from the pages)."""
    import torch
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(16 + 5 * i)] for i in range(4)]
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    cfg = dict(dtype="float32", max_num_seqs=4, num_blocks=8, show_progress=False, prefix_caching=False)
    ref = LLM("random:tiny", **cfg)
    want = _run(ref, prompts, sp)
    assert sum(p for _, p in want) > 0                                    # the pool is tight enough
    forward = dict(rms_norm=sol.rms_norm, rope=sol.rope, attention=sol.attention)
    mine = LLM("random:tiny", **cfg, checkpoint=ref.checkpoint)
    assert own_engine.plug_forward(mine, **forward) == ["rms_norm", "rope", "attention"]
    got = _run(mine, prompts, sp)
    own_engine.check_same(got, want, rerun=lambda: pytest.fail("no rerun when equal"))
    assert mine.model.kernels.prefill_attention is not ref.model.kernels.prefill_attention

    def rope_backwards(x, pos, freqs):                                    # 03's planted bug: turns the wrong way
        return sol.rope(x, -pos, freqs)

    bad = dict(forward, rope=rope_backwards)
    wrong = LLM("random:tiny", **cfg, checkpoint=ref.checkpoint)
    own_engine.plug_forward(wrong, **bad)
    got = _run(wrong, prompts, sp)
    fw, kw = own_engine.course_twin(bad, decode_plugged=False)
    assert {n: f.__name__ for n, f in fw.items()} == {n: n for n in forward} and kw == {}   # the course's, each
    assert own_engine.course_twin(dict.fromkeys(forward), decode_plugged=False) is None

    def twin():
        e = LLM("random:tiny", **cfg, checkpoint=ref.checkpoint)
        own_engine.plug_forward(e, **fw)
        return _run(e, prompts, sp)
    with pytest.raises(CheckFailed, match="Plug one piece at a time"):
        own_engine.check_same(got, want, rerun=twin)
    with pytest.raises(CheckFailed, match="Plug one piece at a time"):
        own_engine.check_same(got, want)
    # rounding, not a bug: the course's pieces give the learner's tokens exactly -> said, not failed
    own_engine.check_same(got, want, rerun=lambda: got)
    with pytest.raises(ValueError, match="scales by 1/sqrt"):
        mine.model.kernels.decode_attention(torch.zeros(1, 4, 16), *[torch.zeros(2, 16, 2, 16)] * 2,
                                            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
