"""Tokens: text <-> token ids, and the chat template that wraps a user prompt.

Two tokenizers behind one small interface (encode, decode, chat, eos_token_ids):
  * Llama3Tokenizer: the Llama 3 BPE (tiktoken ranks from the `llama-models` package's
    tokenizer.model) plus its 256 special tokens and the Llama 3 chat template. Built here in
    ~60 lines so a learner can see every piece.
  * HFTokenizer: any other checkpoint's own tokenizer (tokenizer.json or a GGUF's metadata),
    through transformers.
"""
from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

# Llama 3's pre-tokenizer: splits text into words, numbers (1-3 digits), punctuation and spaces
# before BPE merges run inside each piece.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                  "<|python_tag|>", "<|image|>"]
NUM_SPECIAL = 256


def llama3_tokenizer_file() -> Path:
    """Path of tokenizer.model inside the installed `llama-models` package (never committed here:
    its licence asks for notices on redistribution, so it is installed, not copied)."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The Llama 3 tokenizer comes from the `llama-models` package, which is not installed. "
            "Run: pip install --no-deps llama-models")
    path = Path(list(spec.submodule_search_locations)[0]) / "llama3" / "tokenizer.model"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llama-models")
    return path


def _normalize_messages(prompt_or_messages, system: str | None = None) -> list[dict]:
    if isinstance(prompt_or_messages, str):
        messages = [{"role": "user", "content": prompt_or_messages}]
    else:
        messages = list(prompt_or_messages)
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    return messages


class Llama3Tokenizer:
    """Llama 3 BPE over tiktoken, with the special tokens at ids 128000..128255."""

    def __init__(self, path: str | Path | None = None):
        import tiktoken

        path = Path(path) if path else llama3_tokenizer_file()
        ranks = {}
        for line in path.read_bytes().splitlines():   # each line: base64(token bytes) rank
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        specials = LLAMA3_SPECIAL + [f"<|reserved_special_token_{i}|>"
                                     for i in range(2, NUM_SPECIAL - len(LLAMA3_SPECIAL) + 2)]
        self.special_tokens = {tok: len(ranks) + i for i, tok in enumerate(specials)}
        self.bpe = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=self.special_tokens)
        self.vocab_size = len(ranks) + len(specials)
        self.bos_token_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_token_ids = [self.special_tokens[t] for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        """Plain text -> ids. Special-token strings in `text` are encoded as ordinary text unless
        allow_special=True (so user input cannot forge <|eot_id|>)."""
        ids = self.bpe.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
        return ([self.bos_token_id] if add_bos else []) + ids

    def decode(self, ids, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids if not (skip_special and int(i) >= self.bos_token_id)]
        return self.bpe.decode(ids)

    def chat(self, prompt_or_messages, system: str | None = None) -> list[int]:
        """The Llama 3 chat template, ending with the assistant header the model continues from:
        <|begin_of_text|>(<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>)*
        <|start_header_id|>assistant<|end_header_id|>\\n\\n"""
        sp = self.special_tokens
        ids = [self.bos_token_id]
        for m in _normalize_messages(prompt_or_messages, system):
            ids += [sp["<|start_header_id|>"]] + self.encode(m["role"]) + [sp["<|end_header_id|>"]]
            ids += self.encode("\n\n" + m["content"].strip()) + [sp["<|eot_id|>"]]
        ids += [sp["<|start_header_id|>"]] + self.encode("assistant") + [sp["<|end_header_id|>"]]
        return ids + self.encode("\n\n")


class HFTokenizer:
    """A checkpoint's own tokenizer through transformers (tokenizer.json, or a GGUF's metadata)."""

    def __init__(self, path: str | Path, gguf_file: str | None = None):
        import transformers
        from transformers import AutoTokenizer

        transformers.logging.set_verbosity_error()
        self.hf = AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
        self.vocab_size = len(self.hf)
        self.bos_token_id = self.hf.bos_token_id
        eos = self.hf.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos]

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False, split_special_tokens=not allow_special)
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def chat(self, prompt_or_messages, system: str | None = None) -> list[int]:
        messages = _normalize_messages(prompt_or_messages, system)
        if getattr(self.hf, "chat_template", None):
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.hf.encode(text, add_special_tokens=False)
        return self.encode("\n".join(m["content"] for m in messages), add_bos=True)


class ByteTokenizer:
    """For random-weight models: one id per byte (ids < 256), plus BOS/EOS from the config.
    Output is meaningless text, but the whole pipeline (queue, slots, pages) runs."""

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        ids = [b % self.vocab_size for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def chat(self, prompt_or_messages, system: str | None = None) -> list[int]:
        messages = _normalize_messages(prompt_or_messages, system)
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ",
                           add_bos=True)
