"""OpenAI's request bodies, read into what the engine takes: prompts and a SamplingParams.

A client sends JSON such as

    {"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32,
     "temperature": 0.7, "stream": true}

and this module turns it into a `ParsedRequest`: the prompts (token ids, the chat template already
applied), one SamplingParams, how many samples per prompt (`n`) and how to answer (stream or not).

Checking happens in two layers, and every failure is an `OpenAIError` -- HTTP 400 with OpenAI's error
JSON naming the field, `{"error": {"message", "type", "param", "code"}}`:

1. the *shape* of the body, here: JSON object, known fields, the JSON type of each field that is the
   server's own (`"stream": "yes"` is refused here, naming stream);
2. the sampling fields, by SamplingParams itself: each is passed straight in, type and value, and its
   ValidationError (validation.py) becomes the 400 with `param` = that field and the same words as
   the Python API and the CLI ("top_p must be a finite number in (0, 1] (1 = off), found 2.0"). So
   the server never has a second, diverging copy of the rules.

Fields that SamplingParams does not have (yet) are refused when set to anything but their "off"
value, so a client never silently gets something other than what it asked for. Fields that do not
change what is generated are accepted and not used (IGNORED_FIELDS: what the OpenAI SDK and vLLM's
clients send -- `metadata`, `store`, `user`, `service_tier`, ...); `chat_template_kwargs` is taken
when it cannot change the prompt (`add_generation_prompt: true`, or keys the template never reads).
The `developer` role is the system role. A max_tokens that cannot fit beside the prompt
(prompt + max_tokens > max_model_len) is a 400 naming max_tokens, as OpenAI's and vLLM's.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass, field

from ..conversation import ROLE_ALIASES
from ..sampling import SamplingParams
from ..validation import ValidationError

# -- errors --------------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error answered as OpenAI does: `status` and `{"error": {message, type, param, code}}`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers=None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code, self.headers = type, code, dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None):
    raise OpenAIError(message, param=param, code=code)


# -- the JSON type of every field ----------------------------------------------------------------

_INT, _NUM, _STR, _BOOL, _OBJ = "an integer", "a number", "a string", "a boolean", "an object"
_PARAMS = "checked by SamplingParams"       # type and value: validation.py's rules, not a copy here

COMMON_FIELDS = {              # field -> what JSON type it must have (None is always allowed: "unset")
    "model": _STR, "stream": _BOOL, "stream_options": _OBJ, "max_tokens": _PARAMS, "n": _PARAMS,
    "temperature": _PARAMS, "top_p": _PARAMS, "seed": _PARAMS, "stop": _PARAMS,
    "presence_penalty": _PARAMS, "frequency_penalty": _PARAMS, "user": _STR,
    # not in OpenAI's API, but in vLLM's (the benchmark clients send them): passed on as they are
    "top_k": _PARAMS, "min_p": _PARAMS, "repetition_penalty": _PARAMS, "ignore_eos": _PARAMS,
    "stop_token_ids": _PARAMS,
}
# accepted and not used: they do not change what is generated (OpenAI's bookkeeping and routing
# fields, vLLM's request id); `user` is OpenAI's too
IGNORED_FIELDS = {"metadata": _OBJ, "store": _BOOL, "service_tier": _STR, "prompt_cache_key": _STR,
                  "safety_identifier": _STR, "request_id": _STR}
COMMON_FIELDS |= IGNORED_FIELDS
COMPLETION_FIELDS = COMMON_FIELDS | {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "logprobs": _PARAMS, "echo": _BOOL, "best_of": _INT, "suffix": _STR, "logit_bias": _OBJ,
}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages": "a list of messages", "max_completion_tokens": _PARAMS, "logprobs": _BOOL,
    "top_logprobs": _PARAMS, "logit_bias": _OBJ, "tools": "a list", "tool_choice": "a string or an object",
    "response_format": _OBJ, "parallel_tool_calls": _BOOL, "chat_template_kwargs": _OBJ,
}

# accepted only at their "off" value: what the engine does not do (a different value is a 400)
OFF_VALUES = {"echo": (False,), "best_of": (1,), "suffix": ("",), "logit_bias": ({},),
              "tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False),
              "response_format": ({"type": "text"},)}

DEFAULT_COMPLETION_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0              # OpenAI's default: sampling, unless the client asks for 0


def _type_ok(value, want: str) -> bool:
    if want == _PARAMS:
        return True
    if want == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if want == _NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want == _STR:
        return isinstance(value, str)
    if want == _BOOL:
        return isinstance(value, bool)
    if want == _OBJ:
        return isinstance(value, dict)
    if want == "a string or a list of strings":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
    if want == "a list of integers":
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    if want == "a string or an object":
        return isinstance(value, (str, dict))
    if want == COMPLETION_FIELDS["prompt"]:
        return isinstance(value, (str, list))
    return isinstance(value, list)         # prompt, messages, tools: looked at more closely below


def _show(value) -> str:
    s = json.dumps(value)
    return s if len(s) <= 60 else s[:57] + "..."


MAX_JSON_DEPTH = 100        # arrays / objects inside each other; OpenAI's bodies need a handful
# a JSON string, with the colon after it when it is a key; or a bracket
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"\s*:|"(?:[^"\\]|\\.)*"|[\[\]{}]')
# the only way a lone surrogate gets into parsed JSON: an escape \ud800 .. \udfff in the text
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


# The largest request body read (413 past it): a body is held whole in memory while it is parsed,
# so without a bound one client's multi-gigabyte POST would take the front end -- and every
# stream it serves -- down. A prompt of 128k token ids is ~1 MB of JSON; 32 MiB leaves room for
# long texts and prompt lists.
MAX_BODY_BYTES = 32 << 20


async def receive_body(request, limit: int | None = None) -> bytes:
    """The request's body, read chunk by chunk and refused (413) as soon as it passes `limit`
    bytes (None: MAX_BODY_BYTES) -- or at once, when its Content-Length says it will."""
    limit = MAX_BODY_BYTES if limit is None else limit
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit():
        # (compared as digits first: int() of a header of more than 4300 digits -- leading zeros
        # count -- raises ValueError, a 500)
        digits = declared.lstrip("0")
        if len(digits) > len(str(limit)) or int(digits or "0") > limit:
            size = f"{int(digits):,} bytes" if len(digits) <= 30 else f"a {len(digits)}-digit number of bytes"
            raise OpenAIError(f"the request body has {size}; at most {limit:,} are accepted", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(f"the request body passes {limit:,} bytes, the most accepted", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def read_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400: also for a body nested deeper than
    MAX_JSON_DEPTH (the parser and everything after it recurse: a 500 otherwise) and for a string
    holding a lone surrogate such as "\\ud800" (valid JSON, but not text: it cannot be encoded
    to UTF-8 for the tokenizer). Both name the field."""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        field, depth = _deepest_field(raw)
        if depth > MAX_JSON_DEPTH:
            bad(f"{field or 'the request body'} nests arrays and objects {depth} deep; at most "
                f"{MAX_JSON_DEPTH} are accepted", param=field)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        bad(f"the request body is not valid JSON: {e}")
    except ValueError:            # an integer literal past sys.get_int_max_str_digits(): a 500 otherwise
        bad(f"the request body holds an integer of more than {sys.get_int_max_str_digits():,} digits: "
            "not a number this server can read")
    if not isinstance(body, dict):
        bad(f"the request body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        path = _lone_surrogate(body)
        if path is not None:
            bad(f"{path} holds a lone UTF-16 surrogate (an escape \\ud800 .. \\udfff without its pair): "
                f"not valid Unicode text", param=path)
    return body


def _deepest_field(raw: bytes) -> tuple[str | None, int]:
    """(the top-level field holding the deepest nesting, that depth), from the raw text's strings
    and brackets (no parsing: the parser is what would fail)."""
    depth = deepest = 0
    key = field = None
    for m in _JSON_TOKENS.finditer(raw):
        tok = m.group()
        if tok in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest, field = depth, key
        elif tok in (b"]", b"}"):
            depth -= 1
        elif depth == 1 and tok.endswith(b":"):
            key = tok[:tok.rindex(b'"') + 1][1:-1].decode("utf-8", "replace")
    return field, deepest - 1          # the body's own braces are not nesting


def _lone_surrogate(value, path: str | None = None) -> str | None:
    """The path ("messages[0].content") of the first string (or key) holding a lone surrogate."""
    todo = [(path, value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = k if path is None else f"{path}.{k}"
                todo.append((sub, k))
                todo.append((sub, x))
        elif isinstance(v, list):
            todo += [(f"{path}[{i}]", x) for i, x in enumerate(v)]
    return None


def check_shape(body: dict, allowed: dict) -> None:
    """Known fields only, each of its JSON type (null counts as not given)."""
    for name, value in body.items():
        if name not in allowed:
            bad(f"unrecognized request argument: {name}", param=name)
        if value is not None and not _type_ok(value, allowed[name]):
            bad(f"{name} must be {allowed[name]}, got {_show(value)}", param=name)
        if name in OFF_VALUES and value is not None and value not in OFF_VALUES[name]:
            bad(f"{name}={_show(value)} is not supported by this server", param=name)


# -- SamplingParams from the body ----------------------------------------------------------------

def sampling_fields() -> set[str]:
    """What this SamplingParams takes (its fields, and the init-only alias max_tokens)."""
    return {f.name for f in dataclasses.fields(SamplingParams)} | {"max_tokens"}


def make_params(kwargs: dict, params_of: dict[str, str]) -> SamplingParams:
    """SamplingParams(**kwargs); its ValidationError becomes a 400 naming the request field, in
    the words of validation.py. params_of: SamplingParams field -> the request field it came from."""
    known = sampling_fields()
    for name in list(kwargs):
        if name not in known:
            bad(f"{params_of.get(name, name)} is not supported by this engine (SamplingParams has no "
                f"field {name!r})", param=params_of.get(name, name))
    try:
        return SamplingParams(**kwargs)
    except ValidationError as e:
        name, _, index = e.field.partition("[")            # stop_token_ids[1] -> stop_token_ids
        param = params_of.get(name, name)
        raise OpenAIError(e.rule(param + (f"[{index}" if index else "")), param=param) from None


def _sampling_kwargs(body: dict) -> tuple[dict, dict]:
    """The body's sampling fields as SamplingParams keyword arguments (only those given, and not
    n/logprobs, which the endpoints handle), and {SamplingParams field: request field}."""
    kwargs, params_of = {}, {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos"):
        if body.get(name) is not None:
            kwargs[name], params_of[name] = body[name], name
    kwargs.setdefault("temperature", DEFAULT_TEMPERATURE)
    params_of.setdefault("temperature", "temperature")
    return kwargs, params_of


def _n_samples(body: dict, kwargs: dict, params_of: dict) -> None:
    """n: samples per prompt, checked by SamplingParams (the server then runs n streams)."""
    if body.get("n") is not None:
        kwargs["n"], params_of["n"] = body["n"], "n"


# -- the parsed request --------------------------------------------------------------------------

@dataclass
class ParsedRequest:
    """What an endpoint needs: prompts as token ids, the sampling parameters, how to answer."""
    kind: str                                  # "chat" or "completion"
    model: str
    prompts: list[list[int]]                   # token ids, chat template applied
    params: SamplingParams                     # its n: samples per prompt (params.samples())
    stream: bool = False
    include_usage: bool = False                # stream_options.include_usage
    logprobs: int | None = None                # top alternatives per token (None: no logprobs)
    texts: list[str | None] = field(default_factory=list)
    timing: bool = False                       # stream_options.pagedlab_timing (a pagedlab extension)

    @property
    def n(self) -> int:
        return self.params.n


def _common(body: dict, allowed: dict, served_model: str) -> tuple[str, bool, bool, bool]:
    check_shape(body, allowed)
    model = body.get("model")
    if model is None:
        bad("you must provide a model parameter", param="model")
    if model != served_model:
        bad(f"the model {model!r} does not exist: this server serves {served_model!r}",
            param="model", code="model_not_found")
    stream = bool(body.get("stream") or False)
    opts = body.get("stream_options")
    given = {"include_usage": False, "pagedlab_timing": False}
    if opts is not None:
        if not stream:
            bad("stream_options is only allowed when stream is true", param="stream_options")
        for k, v in opts.items():
            if k not in given:
                bad(f"unrecognized stream option: {k} (stream_options takes {', '.join(given)})",
                    param="stream_options")
            if not isinstance(v, bool):
                bad(f"stream_options.{k} must be a boolean, got {_show(v)}", param="stream_options")
            given[k] = v
    # pagedlab_timing (pagedlab's own, for `bench serve`): the usage chunk, with each choice's
    # moments in the server -- arrived, first token -- on the machine's monotonic clock
    timing = given["pagedlab_timing"]
    return model, stream, given["include_usage"] or timing, timing


def _prompt_token_lists(prompt, tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """/v1/completions' prompt: a string, a list of strings, token ids or a list of token-id lists."""
    what = COMPLETION_FIELDS["prompt"]
    if prompt is None:
        bad("you must provide a prompt", param="prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        bad(f"prompt must be {what}, got {_show(prompt)}", param="prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)], [None]
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            if not p.strip():
                bad("prompt is empty: give some text or token ids", param="prompt")
            ids.append(tokenizer.encode(p, add_bos=True))
            texts.append(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids.append(list(p))
            texts.append(None)
        else:
            bad(f"prompt must be {what}, got an element {_show(p)}", param="prompt")
    return ids, texts


def check_context(max_tokens, prompt_lengths: list[int], max_model_len: int | None, param: str) -> None:
    """prompt + max_tokens must fit in max_model_len (a prompt too long by itself is left to the
    engine's check, which names the prompt)."""
    if max_model_len is None or not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        return
    for n in prompt_lengths:
        if n < max_model_len < n + max_tokens:
            bad(f"{param}={max_tokens} does not fit: this model's maximum context length is {max_model_len} "
                f"tokens and the prompt has {n}, so at most {max_model_len - n} new tokens can be asked for",
                param=param)


def parse_completion(body: dict, served_model: str, tokenizer, max_model_len: int | None = None) -> ParsedRequest:
    """A /v1/completions body. max_tokens defaults to 16 (OpenAI's and vLLM's), fewer if the
    context has no room for 16."""
    model, stream, include_usage, timing = _common(body, COMPLETION_FIELDS, served_model)
    prompts, texts = _prompt_token_lists(body.get("prompt"), tokenizer)
    kwargs, params_of = _sampling_kwargs(body)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        room = [max_model_len - len(ids) for ids in prompts if max_model_len is not None]
        max_tokens = max(1, min([DEFAULT_COMPLETION_MAX_TOKENS] + room))
    else:
        check_context(max_tokens, [len(ids) for ids in prompts], max_model_len, "max_tokens")
    kwargs["max_tokens"] = max_tokens
    params_of["max_tokens"] = "max_tokens"
    _n_samples(body, kwargs, params_of)
    logprobs = body.get("logprobs")             # completions: an integer, the number of alternatives
    if logprobs is not None:
        kwargs["logprobs"], params_of["logprobs"] = logprobs, "logprobs"
    params = make_params(kwargs, params_of)
    return ParsedRequest("completion", model, prompts, params, stream, include_usage, logprobs, texts, timing)


# -- chat messages -------------------------------------------------------------------------------

ROLES = ("system", "user", "assistant")          # and "developer", OpenAI's newer name for system


def message_text(content, i: int) -> str:
    """A message's content: a string, or a list of text parts [{"type": "text", "text": ...}]."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                bad(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": \"...\"}}, got "
                    f"{_show(part)} (only text is supported)", param=f"messages[{i}].content")
            extra = set(part) - {"type", "text"}
            if extra:
                bad(f"{where}[{j}] has unknown keys {sorted(extra)}", param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    bad(f"{where} must be a string or a list of text parts, got {_show(content)}",
        param=f"messages[{i}].content")


def check_messages(messages) -> list[dict]:
    """[{"role": system|user|assistant, "content": ...}, ...] -> the same with content as plain text."""
    if not isinstance(messages, list) or not messages:
        bad(f"messages must be a non-empty list of messages, got {_show(messages)}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            bad(f"messages[{i}] must be an object with role and content, got {_show(m)}", param=f"messages[{i}]")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            bad(f"messages[{i}] has unknown keys {sorted(extra)}", param=f"messages[{i}]")
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            bad(f"messages[{i}].role must be one of {', '.join(ROLES)} (or developer), got {_show(m.get('role'))}",
                param=f"messages[{i}].role")
        if "content" not in m or m["content"] is None:
            bad(f"messages[{i}].content is missing", param=f"messages[{i}].content")
        if m.get("name") is not None and not isinstance(m["name"], str):
            bad(f"messages[{i}].name must be a string, got {_show(m['name'])}", param=f"messages[{i}].name")
        out.append({"role": role, "content": message_text(m["content"], i)})
    if not any(m["content"].strip() for m in out):
        bad("messages are all empty: give some text", param="messages")
    return out


def check_template_kwargs(kwargs: dict | None, tokenizer) -> None:
    """vLLM's chat_template_kwargs, taken where they cannot change the prompt: add_generation_prompt
    true (the prompt always ends with the assistant's turn to speak), and keys the chat template
    never reads (e.g. enable_thinking for a template without thinking). Anything else is a 400."""
    for key, value in (kwargs or {}).items():
        if key == "add_generation_prompt":
            if value is not True:
                bad("chat_template_kwargs.add_generation_prompt must be true here (the prompt always ends "
                    f"with the assistant's turn to speak), got {_show(value)}", param="chat_template_kwargs")
        elif key in str(getattr(getattr(tokenizer, "hf", None), "chat_template", None) or ""):
            bad(f"chat_template_kwargs.{key}: this model's chat template reads {key!r}, and this server "
                "does not pass template variables", param="chat_template_kwargs")


def parse_chat(body: dict, served_model: str, tokenizer, max_model_len: int) -> ParsedRequest:
    """A /v1/chat/completions body. The conversation goes through the tokenizer's chat template
    (tokenizer.chat(messages): every message, ending with the assistant's turn to speak)."""
    model, stream, include_usage, timing = _common(body, CHAT_FIELDS, served_model)
    if body.get("messages") is None:
        bad("you must provide messages", param="messages")
    messages = check_messages(body["messages"])
    check_template_kwargs(body.get("chat_template_kwargs"), tokenizer)
    ids = tokenizer.chat(messages)
    kwargs, params_of = _sampling_kwargs(body)
    given = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        bad("max_tokens and max_completion_tokens disagree: give one of them", param="max_completion_tokens")
    if given:
        kwargs["max_tokens"], params_of["max_tokens"] = body[given[0]], given[0]
        check_context(body[given[0]], [len(ids)], max_model_len, given[0])
    else:                       # OpenAI: as long as the context allows
        kwargs["max_tokens"], params_of["max_tokens"] = max(1, max_model_len - len(ids)), "messages"
    _n_samples(body, kwargs, params_of)
    logprobs = None
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        bad("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.get("logprobs"):
        logprobs = 0 if top is None else top
        kwargs["logprobs"] = logprobs
        params_of["logprobs"] = "logprobs" if top is None else "top_logprobs"
    params = make_params(kwargs, params_of)
    return ParsedRequest("chat", model, [ids], params, stream, include_usage, logprobs, [None], timing)


# -- /tokenize and /detokenize (vLLM's) -----------------------------------------------------------

TOKENIZE_FIELDS = {"model": _STR, "prompt": _STR, "messages": "a list of messages", "add_special_tokens": _BOOL,
                   "add_generation_prompt": _BOOL, "chat_template_kwargs": _OBJ}
DETOKENIZE_FIELDS = {"model": _STR, "tokens": "a list of integers"}


def _model_if_given(body: dict, served_model: str) -> None:
    model = body.get("model")
    if model is not None and model != served_model:
        bad(f"the model {model!r} does not exist: this server serves {served_model!r}",
            param="model", code="model_not_found")


def parse_tokenize(body: dict, served_model: str, tokenizer) -> list[int]:
    """POST /tokenize: {"prompt": text} -> the ids /v1/completions would run (BOS first unless
    add_special_tokens is false); {"messages": [...]} -> the ids /v1/chat/completions would run."""
    check_shape(body, TOKENIZE_FIELDS)
    _model_if_given(body, served_model)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        bad("give either prompt (text) or messages (a conversation)", param="prompt")
    if messages is not None:
        if body.get("add_generation_prompt") is False:
            bad("add_generation_prompt must be true here (the prompt always ends with the assistant's turn "
                "to speak)", param="add_generation_prompt")
        check_template_kwargs(body.get("chat_template_kwargs"), tokenizer)
        return tokenizer.chat(check_messages(messages))
    return tokenizer.encode(prompt, add_bos=body.get("add_special_tokens") is not False)


def parse_detokenize(body: dict, served_model: str, vocab_size: int | None) -> list[int]:
    """POST /detokenize: {"tokens": [ids]}, each id in the vocabulary."""
    check_shape(body, DETOKENIZE_FIELDS)
    _model_if_given(body, served_model)
    tokens = body.get("tokens")
    if tokens is None:
        bad("you must provide tokens (a list of token ids)", param="tokens")
    outside = [t for t in tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        bad(f"tokens {outside[:5]} are outside the vocabulary [0, {vocab_size})", param="tokens")
    return tokens
