"""Streaming: deltas that join to the whole output, never a broken character, and a stream closed
early aborts its request without touching the others."""
import pytest

from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.streaming import REPLACEMENT, IncrementalDetokenizer
from pagedlab.tokenizer import ByteTokenizer


@pytest.mark.parametrize("step", [1, 2, 3])
def test_detokenizer_never_splits_a_character(step):
    tok = ByteTokenizer(512, None, [])
    text = "héllo wörld ✓ — 日本語 🚀 done"
    ids = list(text.encode("utf-8"))               # one token per byte: characters span tokens
    detok, deltas = IncrementalDetokenizer(tok), []
    for n in range(step, len(ids) + step, step):
        deltas.append(detok.feed(ids[:min(n, len(ids))], final=n >= len(ids)))
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert sum(d == "" for d in deltas) > 0        # it did hold text back mid-character


def test_detokenizer_flushes_a_broken_tail_at_the_end():
    tok = ByteTokenizer(512, None, [])
    ids = list("ok ✓".encode("utf-8"))[:-1]         # the last character cut short
    detok = IncrementalDetokenizer(tok)
    got = detok.feed(ids[:3]) + detok.feed(ids) + detok.feed(ids, final=True)
    assert got == tok.decode(ids)


@pytest.mark.parametrize("overlap", [False, True])
def test_stream_equals_generate(overlap):
    kw = dict(max_num_seqs=2, num_blocks=64) | ({"cuda_graphs": "eager"} if overlap else {})
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = tiny_llm(max_num_seqs=2, num_blocks=64).generate([[5, 6, 7]], sp)[0]
    llm = tiny_llm(**kw)
    deltas = list(llm.stream([5, 6, 7], sp))
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])
    assert deltas[-1].output.token_ids == want.token_ids
    assert "".join(d.text for d in deltas) == want.text
    assert all(-1 not in d.token_ids for d in deltas)


def test_closing_a_stream_aborts_it_and_keeps_others():
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    eng = llm.engine
    other = eng.add_request([9, 8, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    gen = llm.stream([5, 6, 7], SamplingParams(max_new_tokens=40, ignore_eos=True))
    for i, _ in enumerate(gen):
        if i == 5:
            break
    gen.close()
    back = {r.request_id: r for r in eng.run()}
    assert list(back) == [other] and back[other].finish_reason == "length"
    assert eng.scheduler.allocator.num_used == 0 and not eng.has_work()


def test_stream_on_real_weights_equals_chat(smollm2_llm):
    """SmolLM2: streamed text, joined, is the chat answer's text; it stops at the end of turn."""
    sp = SamplingParams(max_new_tokens=40)
    prompt = "Spell 'café' and add a ✓."
    want = smollm2_llm.chat(prompt, sp)[0]
    deltas = list(smollm2_llm.stream(prompt, sp, chat=True))
    assert "".join(d.text for d in deltas) == want.text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert deltas[-1].finish_reason == want.finish_reason
    assert not any(REPLACEMENT in d.text for d in deltas)
