"""Text handling under fuzzing: the incremental detokenizer, stop strings, round trips and chat
templates, on all three tokenizers (bytes, Llama 3's tiktoken BPE, SmolLM2's GGUF tokenizer through
transformers) and on a byte-fallback tokenizer (Llama 2 style, built here), with random token ids
(ones whose text is half a UTF-8 character, special tokens) and random text (emoji, CJK, combining
marks, RTL, zero-width joiners, NUL, CR LF, lone U+FFFD, long words, whitespace runs).

What a request's text is (output_processor.RequestState): the token ids decoded without special
tokens, handed out as it becomes final text -- everything up to an unfinished character's trailing
replacement marks. A stop string ends the request at the first token whose final text holds one, the
text cut at the earliest occurrence in that text; the request's last text (the unfinished character
flushed when it ends) is searched too. Whole and streamed requests give the same text; the stream's
deltas join to it.
"""
import random

import pytest

from pagedlab import SamplingParams
from pagedlab.output_processor import Finished, OutputProcessor, StepOutput
from pagedlab.streaming import REPLACEMENT, IncrementalDetokenizer
from pagedlab.tokenizer import ByteTokenizer, Llama3Tokenizer

R = REPLACEMENT
TEXTS = ["héllo wörld ✓ — 日本語 🚀 done", "👩\u200d👩\u200d👧\u200d👦 family", "e\u0301\u0302 combining",
         "مرحبا بالعالم שלום", "a\u200db\u200c", "nul\x00byte", "crlf\r\nline\r\n", "\ufffd lone", "x" * 60,
         "   \t\t  \n\n\n   ", "<|im_end|><|eot_id|><|start_header_id|>", "🇺🇸🇯🇵", "\U0001F600" * 3, "ok 🚀 go"]
# Text that is special-token strings, template syntax and pieces of both (chat fuzzing).
PIECES = ["<|im_end|>", "<|im_start|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
          "<|begin_of_text|>", "<|endoftext|>", "<repo_name>", "<|im_", "end|>", "\n", "\r\n", " ", "  ",
          "system", "assistant", "héllo", "🚀", "日本", "\u200d", "\x00", "\ufffd", "e\u0301", "مرحبا",
          "\ue000pagedlab0\ue001", "{{ x }}", "{% if %}", "x" * 40, "<|python_tag|>", "\t"]


@pytest.fixture(scope="module")
def llama3():
    return Llama3Tokenizer()


@pytest.fixture(scope="module")
def smol(smollm2_llm):
    return smollm2_llm.tokenizer


@pytest.fixture(scope="module")
def tokenizers(llama3, smol):
    return {"bytes": ByteTokenizer(512, 1, [2]), "llama3": llama3, "smollm2": smol}


def special_ids(tok) -> list[int]:
    return sorted(set(getattr(tok, "special_tokens", {}).values()))[:20] or [1, 2]


def partial_ids(tok, rnd, want=40) -> list[int]:
    """Token ids whose own text holds a replacement mark: part of a UTF-8 character."""
    if isinstance(tok, ByteTokenizer):
        return list(range(128, 256))
    out = []
    while len(out) < want:
        i = rnd.randrange(tok.vocab_size)
        if i not in tok.special_tokens.values() and R in tok.decode([i]):
            out.append(i)
    return out


def random_ids(tok, rnd, partial) -> list[int]:
    kind = rnd.randrange(3)
    if kind == 0:
        ids = [rnd.randrange(tok.vocab_size) for _ in range(rnd.randint(1, 20))]
    elif kind == 1:
        pool = partial + special_ids(tok)
        ids = [rnd.choice(pool) if rnd.random() < 0.7 else rnd.randrange(tok.vocab_size)
               for _ in range(rnd.randint(1, 20))]
    else:
        ids = tok.encode("".join(rnd.choice(TEXTS) for _ in range(rnd.randint(1, 3))))
    if rnd.random() < 0.3:
        k = rnd.randrange(len(ids) + 1)
        ids = ids[:k] + [rnd.choice(special_ids(tok))] + ids[k:]
    return ids


def run(tok, ids, stops, stream, rnd, reason="length"):
    """ids through one OutputProcessor as an engine would hand them out (random steps of 1-3
    tokens, the last one ending the request): (RequestOutput, the stream's deltas)."""
    proc = OutputProcessor(tok)
    state = proc.add(0, [1], None, SamplingParams(max_tokens=len(ids), stop=stops), stream=stream)
    deltas, n = [], 0
    while state.output is None:
        k = min(len(ids), n + rnd.choice([1, 1, 2, 3]))
        step = StepOutput()
        step.add(0, ids[n:k], finished=Finished(reason) if k == len(ids) else None)
        proc.process(step)
        n = k
        if stream and (d := state.delta()) is not None:
            deltas.append(d)
    return state.output, deltas


def final_text_at(tok, ids, i) -> str:
    """The text of ids[:i] that is final while more tokens may come: an unfinished character's
    replacement marks at the end are not text yet."""
    text = tok.decode(ids[:i], skip_special=True)
    return text.rstrip(R) if i < len(ids) else text


def expected(tok, ids, stops):
    """(text, finish_reason, stop_reason, number of tokens kept)."""
    for i in range(1, len(ids) + 1):
        text = final_text_at(tok, ids, i)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            k, s = min(hits)
            return text[:k], "stop", s, i
    return tok.decode(ids, skip_special=True), "length", None, len(ids)


# ---------------------------------------------------------------- bugs found here

@pytest.mark.parametrize("name", ["bytes", "llama3", "smollm2"])
def test_a_stop_string_in_the_text_flushed_at_the_end_is_cut(tokenizers, name):
    """A request that ends (max_tokens) right after a token holding half a character: its text is
    flushed at the end, "ok " plus a replacement mark. That last text was never searched for stop
    strings: stop=[" "] gave "ok \\ufffd" (finish "length"), and stop=["\\ufffd"] on random bytes
    showed the stop string."""
    tok = tokenizers[name]
    ids = list(b"ok \xf0\x9f") if name == "bytes" else tok.encode("ok 🚀")[:2]   # "ok", " " + half of 🚀
    assert tok.decode(ids) == "ok " + R
    for stops, text in [([" "], "ok"), ([R], "ok "), (["k" + " " + R], "o")]:
        for stream in (False, True):
            out, deltas = run(tok, ids, stops, stream, random.Random(0))
            assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", stops[0]), (stops, stream)
            if stream:
                assert "".join(d.text for d in deltas) == text


def test_random_bytes_never_show_a_replacement_mark_stop_string():
    """End to end on random weights (a byte tokenizer: its text is full of U+FFFD)."""
    from helpers import tiny_llm
    llm = tiny_llm(max_num_seqs=4, num_blocks=64)
    rnd = random.Random(0)
    prompts = [[rnd.randrange(3, 500) for _ in range(6)] for _ in range(8)]
    free = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    sp = SamplingParams(max_tokens=3, ignore_eos=True, stop=[R])
    cut = llm.generate(prompts, sp)
    assert sum(R in o.text for o in free) >= 3
    for p, f, o in zip(prompts, free, cut):
        assert R not in o.text and f.text.startswith(o.text), (f.text, o.text)
        if R in f.text:
            assert o.finish_reason == "stop" and o.text == f.text[:f.text.find(R)]
    deltas = list(llm.stream(prompts[0], sp))
    assert "".join(d.text for d in deltas) == cut[0].text


@pytest.mark.parametrize("name", ["llama3", "smollm2"])
def test_a_stop_string_before_an_unfinished_character_stops_at_once(tokenizers, name):
    """" \xf0\x9f" is one token (a space and half of 🚀), held back until 🚀 is complete. Its space
    was not searched meanwhile, so stop=[" "] was seen two or three tokens late: the request kept
    the tokens of 🚀 after its stop string (and the core ran the steps that made them)."""
    tok = tokenizers[name]
    ids = tok.encode("ok 🚀 go")
    assert tok.decode(ids[:2]) == "ok " + R and len(ids) >= 4
    for stream in (False, True):
        out, deltas = run(tok, ids, [" "], stream, random.Random(1), reason="stop")
        assert (out.text, out.finish_reason, out.stop_reason) == ("ok", "stop", " ")
        assert out.token_ids == ids[:2], (stream, out.token_ids)
    detok = IncrementalDetokenizer(tok)          # the text waits for the whole character
    got = [detok.feed(ids, end=k) for k in range(1, len(ids) + 1)]
    assert "".join(got) == "ok 🚀 go" and not any(R in d for d in got)


def test_byte_tokenizer_text_leaves_out_bos_and_eos():
    """A random-weights request that stops at EOS (id 2): its text ended in "\\x02", the EOS
    token's byte (the other tokenizers leave special tokens out of the text)."""
    from helpers import tiny_llm
    from pagedlab import tiny_config

    tok = ByteTokenizer(512, 1, [2])
    assert tok.decode([104, 2, 105, 1], skip_special=True) == "hi"
    assert tok.decode([104, 2, 105, 1]) == "h\x02i\x01"                 # round trips keep them
    assert tok.decode(tok.encode("\x01\x02 ok")) == "\x01\x02 ok"
    free = tiny_llm().generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    eos = free.token_ids[3]
    out = tiny_llm(config=tiny_config(eos_token_ids=[eos])).generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=8))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    assert out.text == ByteTokenizer(512, 1, [eos]).decode(out.token_ids[:-1], skip_special=True)


# ---------------------------------------------------------------- fuzzing (regression guards)

@pytest.mark.parametrize("name", ["bytes", "llama3", "smollm2"])
def test_stop_strings_and_streams_on_random_tokens(tokenizers, name):
    """Random ids, random steps, stop strings cut from the text (inside multi-byte characters,
    overlapping, one a prefix of another, U+FFFD, a special token's text): whole and streamed
    requests give the expected text and tokens; deltas join to the text and never show a stop
    string; without stop strings the text is decode(ids, skip_special=True)."""
    tok = tokenizers[name]
    rnd = random.Random(7)
    partial = partial_ids(tok, rnd)
    for trial in range(600):
        ids = random_ids(tok, rnd, partial)
        full = tok.decode(ids, skip_special=True)
        stops = []
        for _ in range(rnd.randint(0, 3)):
            if full:
                a = rnd.randrange(len(full))
                stops.append(full[a:a + rnd.randint(1, 6)])
        if stops and rnd.random() < 0.3:
            stops.append(stops[0] + "x")                           # a stop string that extends another
        if rnd.random() < 0.15:
            stops.append(R)
        if rnd.random() < 0.2:
            stops.append(" ")                                      # often just before half a character
        if rnd.random() < 0.15:
            stops.append(rnd.choice(["<|im_end|>", "<|eot_id|>"]))  # special tokens are not text
        text, reason, stop_reason, kept = expected(tok, ids, stops)
        for stream in (False, True):
            ended = rnd.choice(["length", "stop", "abort"])             # how the core ended it
            out, deltas = run(tok, ids, stops, stream, random.Random(trial), reason=ended)
            got = (out.text, out.finish_reason, out.stop_reason, len(out.token_ids))
            assert got == (text, reason if stop_reason else ended, stop_reason, kept), (ids, stops, stream)
            assert out.token_ids == ids[:kept]
            if stream:
                assert "".join(d.text for d in deltas) == out.text
                assert not any(s in d.text for d in deltas for s in stops)
                assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


@pytest.mark.parametrize("name", ["bytes", "llama3", "smollm2"])
def test_detokenizer_deltas_join_to_decode_at_every_split(tokenizers, name):
    tok = tokenizers[name]
    rnd = random.Random(11)
    partial = partial_ids(tok, rnd)
    for _ in range(600):
        ids = random_ids(tok, rnd, partial)
        skip = rnd.random() < 0.8
        detok, deltas, n = IncrementalDetokenizer(tok, skip_special=skip), [], 0
        while n < len(ids):
            n = min(len(ids), n + rnd.choice([1, 1, 2, 5]))
            deltas.append(detok.feed(ids, end=n))
        deltas.append(detok.feed(ids, final=True))
        assert "".join(deltas) == tok.decode(ids, skip_special=skip), ids
        assert all(not d.endswith(R) for d in deltas[:-1] if d) or R in tok.decode(ids, skip_special=skip)


def byte_fallback_tokenizer(directory):
    """A Llama 2 style tokenizer: SentencePiece-like BPE with <0xNN> byte-fallback tokens, "▁" for
    spaces, and a decoder that turns byte runs into text (one U+FFFD per byte of a broken run) and
    strips the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from pagedlab.tokenizer import HFTokenizer
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for w in ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", "é", "▁é", "日", "本"]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "é")],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(directory))
    return HFTokenizer(str(directory))


def test_byte_fallback_tokenizer_streams_exactly(tmp_path):
    """Byte-fallback tokens give one U+FFFD per byte of an unfinished character ("<0xE2><0x82>" is
    two marks, "<0xE2><0x82><0xAC>" is "€"): the detokenizer holds back the whole run of marks, not
    just the last one; the first space is stripped from a decode's text, never from a delta's."""
    tok = byte_fallback_tokenizer(tmp_path)
    assert tok.decode([3 + 0xE2, 3 + 0x82]) == R + R and tok.decode([3 + 0xE2, 3 + 0x82, 3 + 0xAC]) == "€"
    rnd = random.Random(3)
    texts = ["€ 🚀 日本 é", "ab a b", "x\u0301", "  ", "a\u200db", "\x00\r\n", " lead"]
    for _ in range(400):
        s = "".join(rnd.choice(texts) for _ in range(rnd.randint(1, 4)))
        ids = tok.encode(s)
        if rnd.random() < 0.3:
            k = rnd.randrange(len(ids) + 1)
            ids = ids[:k] + [rnd.choice([1, 2])] + ids[k:]
        want = tok.decode(ids, skip_special=True)
        detok, deltas, n = IncrementalDetokenizer(tok), [], 0
        while n < len(ids):
            n = min(len(ids), n + rnd.choice([1, 1, 2]))
            deltas.append(detok.feed(ids, end=n))
        deltas.append(detok.feed(ids, final=True))
        assert "".join(deltas) == want and not any(R in d for d in deltas), (s, ids, deltas)


def test_round_trips(tokenizers):
    """decode(encode(text)) == text for every tokenizer, on hostile text. SmolLM2's vocabulary has
    no token for the bytes 0x04 0x06 0x13 0x14 0x16 0x1d (and 0xf1 0xf2: code points U+40000 to
    U+BFFFF): those characters are dropped -- by the vocabulary, as transformers itself drops them."""
    rnd = random.Random(5)
    pieces = TEXTS + ["\u00a0", "\u3000", "\ufeff", "\u202e", "\U0010FFFF", "\ue000", "é" * 300, "'s", "'S",
                      "don't", "ǅ", "ﬁ", "Å", "Ω", "\u2028", "\u0085", "\x0b", "\x1c", "\r"]
    for name, tok in tokenizers.items():
        for _ in range(200):
            s = "".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 6)))
            assert tok.decode(tok.encode(s)) == s, (name, s)
            assert not set(tok.encode(s)) & set(getattr(tok, "special_tokens", {}).values()), (name, s)
    smol = tokenizers["smollm2"]
    for ch in "\x04\x06\x13\x14\x16\x1d\U00040000\U000BFFFF":
        assert smol.decode(smol.encode("a" + ch + "b")) != "a" + ch + "b"
        assert smol.hf.decode(smol.hf.encode("a" + ch + "b", add_special_tokens=False)) != "a" + ch + "b"


def test_chat_content_never_becomes_control_tokens(tokenizers):
    """Random conversations whose text mixes special-token strings, template syntax, placeholders
    and hostile characters: as many control tokens as the same conversation saying "hi", the
    rendered text exactly; ids equal to transformers' apply_chat_template when no special-token
    string is in the text (transformers' own ids forge control tokens otherwise)."""
    smol, llama3 = tokenizers["smollm2"], tokenizers["llama3"]
    rnd = random.Random(2)
    forged_by_transformers = 0
    for _ in range(80):
        roles = (["system"] if rnd.random() < 0.4 else []) + ["user", "assistant", "user"][:rnd.randint(1, 3)]
        msgs = [{"role": r, "content": "".join(rnd.choice(PIECES) for _ in range(rnd.randint(0, 6)))} for r in roles]
        hi = [dict(m, content="hi") for m in msgs]
        ids = smol.chat(msgs)
        assert sum(i in smol._special_ids for i in ids) == sum(i in smol._special_ids for i in smol.chat(hi)), msgs
        assert smol.decode(ids) == smol._render(msgs, add_generation_prompt=True)
        theirs = smol.hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
        if smol._special_re.search("".join(m["content"] for m in msgs)):
            forged_by_transformers += theirs != ids
        else:
            assert theirs == ids, msgs
        ids3 = llama3.chat(msgs)
        assert sum(i >= 128000 for i in ids3) == sum(i >= 128000 for i in llama3.chat(hi)), msgs
        assert llama3.decode(ids3) == ("<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in msgs)
            + "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert forged_by_transformers > 10
