"""A chat conversation as LLM.chat takes it: role/content dicts, checked before anything runs.

    llm.chat("Hi!")                                                    # one user turn
    llm.chat([{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Hi!"}])                     # one conversation
    llm.chat([conversation_a, conversation_b])                         # several, answered together
    llm.chat(["Hi!", "Name a color."], system="Be brief.")             # a system turn first

The shapes are vLLM's LLM.chat and OpenAI's `messages`: each message a dict with a `role` --
system, user or assistant, and OpenAI's `developer`, which is the system role under a newer name --
and a `content`: a string, or OpenAI's text parts [{"type": "text", "text": "..."}]. The tokenizer's
chat template then renders the turns and ends with the assistant's turn to speak; it encodes every
content as plain text, so "<|im_end|>" typed by a user is characters, never a control token
(tokenizer.py).
"""
from __future__ import annotations

from collections.abc import Mapping

from .validation import show

# Four short prompts: the CLI demo's, the tests' and notebook 00's.
DEMO_PROMPTS = ["What is 2+2?", "Name a color.", "Say hello.", "Capital of France?"]
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}          # OpenAI's newer name for the system role


def is_conversation(prompt) -> bool:
    """A list (or tuple) of message dicts, as opposed to a string or a list of token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], Mapping)


def message_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': '...'}}, "
                                 f"got {part!r:.60} (only text is supported)")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def check_conversation(messages, system: str | None = None) -> list[dict]:
    """The messages as [{"role": system|user|assistant, "content": str}], a `system` turn first if
    given; a ValueError naming the message and the field otherwise."""
    if system is not None and not isinstance(system, str):
        raise ValueError(f"system must be a string, got {type(system).__name__}")
    out = [{"role": "system", "content": system}] if system is not None else []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ValueError(f"{where} has unknown keys {sorted(extra)} (expected 'role' and 'content')")
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role    # (a list is unhashable)
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)} (or developer), got {show(m.get('role'))}")
        if m.get("content") is None:
            raise ValueError(f"{where}.content is missing")
        out.append({"role": role, "content": message_text(m["content"], where)})
    if not any(m["content"].strip() for m in out):
        raise ValueError("the conversation is empty: give some text")
    return out
