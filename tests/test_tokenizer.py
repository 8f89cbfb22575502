from conftest import DEMO_PROMPTS
from pagedlab.tokenizer import Llama3Tokenizer

# The token ids the original engine hard-codes (made once with the Llama-3.2-1B-Instruct tokenizer).
ORIGINAL_IDS = [
    [128000, 128006, 882, 128007, 271, 3923, 374, 220, 17, 10, 17, 30, 128009, 128006, 78191, 128007, 271],
    [128000, 128006, 882, 128007, 271, 678, 264, 1933, 13, 128009, 128006, 78191, 128007, 271],
    [128000, 128006, 882, 128007, 271, 46864, 24748, 13, 128009, 128006, 78191, 128007, 271],
    [128000, 128006, 882, 128007, 271, 64693, 315, 9822, 30, 128009, 128006, 78191, 128007, 271],
]


def test_chat_template_reproduces_the_original_ids():
    tok = Llama3Tokenizer()
    assert [tok.chat(p) for p in DEMO_PROMPTS] == ORIGINAL_IDS


def test_round_trip_and_specials():
    tok = Llama3Tokenizer()
    text = "Paged attention, décodé: 12345 tokens!\n\n  ok"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 128256 and tok.bos_token_id == 128000
    assert {128001, 128009} <= set(tok.eos_token_ids)
    # user text cannot forge a special token
    assert 128009 not in tok.encode("<|eot_id|>")
    assert tok.encode("<|eot_id|>", allow_special=True) == [128009]
    assert tok.decode(ORIGINAL_IDS[0]).startswith("<|begin_of_text|><|start_header_id|>user")


def test_system_message_and_multi_turn():
    tok = Llama3Tokenizer()
    ids = tok.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Bye"}], system="Be brief.")
    text = tok.decode(ids)
    assert text.count("<|eot_id|>") == 4 and text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "system<|end_header_id|>\n\nBe brief." in text
