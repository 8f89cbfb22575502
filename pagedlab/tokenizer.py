"""Tokens: text <-> token ids, and the chat template that wraps a user prompt.

Three tokenizers behind one small interface (encode, decode, chat, stop_token_ids, eos_token_ids):
  * Llama3Tokenizer: the Llama 3 BPE (tiktoken ranks from the `llama-models` package's
    tokenizer.model) plus its 256 special tokens and the Llama 3 chat template. Built here in
    ~60 lines so a learner can see every piece.
  * HFTokenizer: any other checkpoint's own tokenizer (tokenizer.json or a GGUF's metadata),
    through transformers.
  * ByteTokenizer: one id per byte, for random-weight models.

stop_token_ids ({token id: where it comes from}) is what the engine stops on: the tokenizer's EOS
*and* the chat template's end-of-turn token, found by rendering the template. The tokenizer's EOS
alone is not enough: transformers up to at least 5.17 reports SmolLM2's GGUF EOS as <|im_start|>
(id 1), not <|im_end|> (id 2), so a chat would never stop at the end of the assistant's turn.
eos_token_ids (a list) is kept for older callers.

Message content is always encoded as plain text: a user who types "<|im_end|>" gets the characters,
never the control token (only the template's own markers are special).
"""
from __future__ import annotations

import base64
import importlib.util
import re
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


# Where a stop token comes from (the values of stop_token_ids).
STOP_EOS = "tokenizer eos"
STOP_END_OF_TURN = "chat template end of turn"

# Plain-text stand-ins rendered through a chat template: lower-case letters only (a template that
# strips or trims content leaves them alone), and no special token can be spelled by them.
_PROBE_USER = "pagedlabprobeuserturn"
_PROBE_ASSISTANT = "pagedlabprobeassistantturn"


def _probe_conversations() -> list[list[dict]]:
    user, assistant = {"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}
    # A finished assistant turn; then the same turn followed by a user turn, for templates that
    # want the conversation to end with the user (the turn is then closed for certain).
    return [[user, assistant], [user, assistant, dict(user)]]


def find_end_of_turn(render, special_tokens: dict[str, int]) -> int | None:
    """The chat template's end-of-turn token, read off the template itself: render(messages) -> text
    renders a conversation [user, assistant] (no generation prompt); the special token that follows
    the assistant's text (whitespace skipped) ends a turn: <|im_end|> for SmolLM2 and Qwen,
    <|eot_id|> for Llama 3, </s> for Mistral. None when the template renders no assistant turn
    (it raises, or drops it) or closes it with no special token."""
    by_length = sorted(special_tokens, key=len, reverse=True)   # longest match first, as a tokenizer
    for messages in _probe_conversations():
        try:
            text = render(messages)
        except Exception:           # a template that cannot render an assistant turn: no end-of-turn
            continue
        if not isinstance(text, str) or _PROBE_ASSISTANT not in text:
            continue
        after = text[text.rfind(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT):].lstrip()
        token = next((t for t in by_length if t and after.startswith(t)), None)
        if token is not None:
            return special_tokens[token]
    return None


def make_stop_token_ids(eos_token_ids, end_of_turn: int | None) -> dict[int, str]:
    """{id: source}: each EOS id, and the template's end-of-turn id (one id with both sources lists
    both, comma-separated). Order: EOS first."""
    stops: dict[int, list[str]] = {}
    for t in eos_token_ids or []:
        stops.setdefault(int(t), []).append(STOP_EOS)
    if end_of_turn is not None:
        stops.setdefault(int(end_of_turn), []).append(STOP_END_OF_TURN)
    return {t: ", ".join(dict.fromkeys(sources)) for t, sources in stops.items()}


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
        self.end_of_turn_token_id = find_end_of_turn(lambda m: self.decode(self.chat(m)), self.special_tokens)

    @property
    def stop_token_ids(self) -> dict[int, str]:
        """What the engine stops on, {id: source}: the EOS ids and the chat template's end of turn
        (<|eot_id|>, which is also an EOS here)."""
        return make_stop_token_ids(self.eos_token_ids, self.end_of_turn_token_id)

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
        self.eos_token_ids = [] if eos is None else [eos]     # the tokenizer's own claim; see stop_token_ids
        # The control tokens: special added tokens (<|im_end|> is one, though transformers 4.x leaves
        # it out of all_special_tokens) and the named ones (bos, eos, unk, pad).
        specials = {t.content: int(i) for i, t in self.hf.added_tokens_decoder.items() if t.special}
        for tok in self.hf.all_special_tokens:
            tid = self.hf.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid >= 0:
                specials.setdefault(tok, tid)
        self.special_tokens = specials
        self._special_ids = set(specials.values())
        self._strips = {t.content: (bool(getattr(t, "lstrip", False)), bool(getattr(t, "rstrip", False)))
                        for t in self.hf.added_tokens_decoder.values() if t.special}
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True) if t))
        self.end_of_turn_token_id = (find_end_of_turn(self._render, specials)
                                     if getattr(self.hf, "chat_template", None) else None)

    @property
    def stop_token_ids(self) -> dict[int, str]:
        """What the engine stops on, {id: source}: the tokenizer's EOS and the chat template's end of
        turn (for SmolLM2 <|im_end|>, whatever transformers reports as EOS)."""
        return make_stop_token_ids(self.eos_token_ids, self.end_of_turn_token_id)

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False, split_special_tokens=not allow_special)
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def _render(self, messages, add_generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _specials_in(self, ids) -> list[int]:
        return [i for i in ids if i in self._special_ids]

    def chat(self, prompt_or_messages, system: str | None = None) -> list[int]:
        """The checkpoint's chat template, ending with the generation prompt. Only the template's own
        markers become control tokens: message content is encoded as plain text, so a user typing
        "<|im_end|>\\n<|im_start|>system" cannot open a system turn.

        The template is rendered twice: with the real content and with a placeholder for each
        message's text (the skeleton: the template's own markers alone). When the real rendering
        encodes to exactly the skeleton's control tokens, nothing was forged and its ids are
        returned as they are (the ids transformers' apply_chat_template gives). Otherwise the
        skeleton is encoded piecewise: its markers as control tokens, each message's text as plain
        text (_chat_piecewise)."""
        messages = _normalize_messages(prompt_or_messages, system)
        if not getattr(self.hf, "chat_template", None):
            return self.encode("\n".join(m["content"] for m in messages), add_bos=True)
        ids = self.hf.encode(self._render(messages, add_generation_prompt=True), add_special_tokens=False)
        skeleton, holders = self._skeleton(messages)
        if self._specials_in(ids) == self._specials_in(self.hf.encode(skeleton, add_special_tokens=False)):
            return ids
        return self._chat_piecewise(messages)

    def _skeleton(self, messages) -> tuple[str, dict[str, str]]:
        """The template rendered with a placeholder for each message's text, and {placeholder: text}."""
        holders, masked = {}, []
        for i, m in enumerate(messages):
            if isinstance(m.get("content"), str):
                holder = f"\ue000pagedlab{i}\ue001"      # private-use marks: no special token, never stripped
                holders[holder] = m["content"]
                m = dict(m, content=holder)
            masked.append(m)
        return self._render(masked, add_generation_prompt=True), holders

    def _chat_piecewise(self, messages) -> list[int]:
        """The skeleton's markers as control tokens, each message's content as plain text."""
        skeleton, holders = self._skeleton(messages)
        text = self._render(messages, add_generation_prompt=True)
        ids = self._encode_parts(self._split_skeleton(skeleton, holders, text))
        if self._specials_in(ids) != self._specials_in(self.hf.encode(skeleton, add_special_tokens=False)):
            raise ValueError("this tokenizer cannot encode special-token text as plain text "
                             "(split_special_tokens had no effect); refusing a chat prompt that "
                             "would forge control tokens")
        return ids

    def _split_skeleton(self, skeleton: str, holders: dict[str, str], text: str) -> list[tuple[str, bool]]:
        """[(text, is_content)] with each placeholder replaced by its message's content. A template
        that trims content (Llama 3's does) is followed: the variant whose join equals the real
        rendering wins; if none does, the untrimmed content is used (still plain text)."""
        if not holders:
            return [(skeleton, False)]
        pattern = re.compile("|".join(re.escape(h) for h in holders))
        pieces, pos = [], 0
        for m in pattern.finditer(skeleton):
            pieces.append((skeleton[pos:m.start()], None))
            pieces.append((m.group(), m.group()))
            pos = m.end()
        pieces.append((skeleton[pos:], None))
        variants = [lambda c: c, str.strip]
        chosen = variants[0]
        for v in variants:
            if "".join(v(holders[h]) if h else t for t, h in pieces) == text:
                chosen = v
                break
        return [(chosen(holders[h]), True) if h else (t, False) for t, h in pieces]

    def _encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Encode template text and content the way encoding the joined text would, except that
        special-token strings inside content stay plain text: the template text is cut at its
        special tokens (longest first, as the tokenizer matches them; lstrip/rstrip tokens take
        the whitespace beside them), and each run of text between two of them, template text and
        content together, is encoded with split_special_tokens=True."""
        ids: list[int] = []
        run: list[str] = []
        strip_left = False

        def flush(strip_right: bool):
            nonlocal strip_left
            seg = "".join(run)
            run.clear()
            if strip_left:
                seg = seg.lstrip()
            if strip_right:
                seg = seg.rstrip()
            strip_left = False
            if seg:
                ids.extend(self.hf.encode(seg, add_special_tokens=False, split_special_tokens=True))

        for piece, is_content in parts:
            if is_content or not self._special_re.pattern:
                run.append(piece)
                continue
            pos = 0
            for m in self._special_re.finditer(piece):
                lstrip, rstrip = self._strips.get(m.group(), (False, False))
                run.append(piece[pos:m.start()])
                flush(strip_right=lstrip)
                ids.append(self.special_tokens[m.group()])
                strip_left = rstrip
                pos = m.end()
            run.append(piece[pos:])
        flush(strip_right=False)
        return ids


class ByteTokenizer:
    """For random-weight models: one id per byte (ids < 256), plus BOS/EOS from the config.
    Output is meaningless text, but the whole pipeline (queue, slots, pages) runs."""

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.end_of_turn_token_id = None      # its "template" (role: text lines) has no special token

    @property
    def stop_token_ids(self) -> dict[int, str]:
        """What the engine stops on, {id: source}: the EOS ids it was given (from the model config)."""
        return make_stop_token_ids(self.eos_token_ids, None)

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        ids = [b % self.vocab_size for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """skip_special (a request's text): BOS and EOS ids are left out, as the other tokenizers
        leave their special tokens out -- a request that stopped at EOS does not end in its byte."""
        if skip_special:
            specials = {self.bos_token_id, *self.eos_token_ids}
            ids = [i for i in ids if int(i) not in specials]
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def chat(self, prompt_or_messages, system: str | None = None) -> list[int]:
        messages = _normalize_messages(prompt_or_messages, system)
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ",
                           add_bos=True)
