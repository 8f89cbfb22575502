"""One vocabulary for bad values, used by every door: SamplingParams, EngineConfig / ModelConfig,
the command line and the server.

A rule is written once, here or in the object that owns the field, and every door reaches it by
building the real object: the CLI builds SamplingParams and EngineConfig from its flags before it
loads anything, the server builds SamplingParams from the JSON body. A value that breaks a rule is a
`ValidationError` (a ValueError) that carries the field, what was expected and what was found, so
each door words it the same way under its own name for the field:

    SamplingParams(top_p=2.0)             SamplingParams: top_p must be a finite number in (0, 1] (1 = off), found 2.0
    python -m pagedlab generate --top-p 2 error: --top-p must be a finite number in (0, 1] (1 = off), found 2.0
    POST {"top_p": 2.0, ...}              400, param "top_p": top_p must be a finite number in (0, 1] (1 = off), found 2.0

Bounds are inclusive everywhere ([lo, hi]); booleans are never numbers; a value of the wrong type is
shown with its type (`found <str '5'>`).
"""
from __future__ import annotations

import difflib
import math
import numbers
import re

INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**63                        # seeds travel in int64 device tensors: [0, 2**63 - 1]
SEED_MAX = SEED_LIMIT - 1

# every spelling of a dtype, one table: the CLI's --dtype, LLM(dtype=...), EngineConfig(dtype=...)
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "half": "float16",
                 "float32": "float32", "fp32": "float32", "float": "float32"}
# a device name people type that is not one: what they likely meant
DEVICE_HINTS = {"gpu": "cuda", "cuda0": "cuda:0", "nvidia": "cuda", "cude": "cuda", "cpu0": "cpu",
                "cpu:0": "cpu", "cpus": "cpu", "host": "cpu"}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class ValidationError(ValueError):
    """A field with a bad value: `field` (its name), `expected` (what it must be), `found` (the
    value, as shown), `hint` (more words, e.g. "did you mean ..."), `owner` (the object whose
    field it is, e.g. "SamplingParams": a prefix of the message)."""

    def __init__(self, field: str, expected: str, found, hint: str = "", owner: str | None = None,
                 shown: str | None = None):
        self.field, self.expected, self.found, self.hint, self.owner = field, expected, found, hint, owner
        self.shown = show(found) if shown is None else shown
        super().__init__(self.text())

    def __reduce__(self):                   # pickles as itself (crosses pipes: an engine core's error)
        return type(self), (self.field, self.expected, self.found, self.hint, self.owner, self.shown)

    def rule(self, name: str | None = None) -> str:
        """The message without its owner: "<name> must be <expected>, found <value><hint>"; name:
        the door's name for the field (a CLI flag, a JSON field), default the field's own."""
        return f"{self.field if name is None else name} must be {self.expected}, found {self.shown}{self.hint}"

    def text(self, key: str | None = None) -> str:
        where = f" ({key})" if key else ""
        rule = f"{self.field}{where} must be {self.expected}, found {self.shown}{self.hint}"
        return f"{self.owner}: {rule}" if self.owner else rule

    def located(self, source: str | None, key: str | None = None) -> ValueError:
        """The same error, its message prefixed by the file it came from (and where the file keeps
        the field, `key`: "key 'num_hidden_layers'")."""
        text = self.text(key)
        return ValueError(f"{source}: {text}" if source else text)

    def owned_by(self, owner: str) -> "ValidationError":
        return ValidationError(self.field, self.expected, self.found, self.hint, owner, self.shown)


def show(v) -> str:
    """repr(v) kept short and safe (a huge int's repr can itself raise)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        n = int(v)
        if n.bit_length() > 128:
            return f"{'-' if n < 0 else ''}<an integer of {n.bit_length()} bits>"
    try:
        s = repr(v)
    except Exception:                     # noqa: BLE001 -- only for the message
        s = f"<{type(v).__name__}>"
    return s if len(s) <= 80 else s[:77] + "..."


def typed(v) -> str:
    """A value of the wrong type, shown with its type: <str '5'>."""
    return f"<{type(v).__name__} {show(v)}>"


def is_int(v) -> bool:
    t = type(v)
    if t is int:                  # (the common case first: an ABC's isinstance costs ~1 us)
        return True
    return t is not bool and isinstance(v, numbers.Integral)


def is_real(v) -> bool:
    t = type(v)
    if t is float or t is int:
        return True
    return t is not bool and isinstance(v, numbers.Real)


def _bound(n) -> str:
    """A bound as people read it: 2**31-1 and 2**63-1 by name."""
    return {INT32_MAX: "2**31-1", SEED_MAX: "2**63-1"}.get(n, str(n))


def int_range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{_bound(lo)}, {_bound(hi)}]"
    return f" >= {_bound(lo)}" if lo is not None else f" <= {_bound(hi)}" if hi is not None else ""


def check_int(field: str, v, lo: int | None = None, hi: int | None = None, *, optional: bool = False,
              note: str = "", owner: str | None = None, kind: str = "an integer") -> int | None:
    """A real integer (not a bool, not a float such as 2.0; numpy ints are) with lo <= v <= hi, as
    a Python int. optional: None passes. note: what a value means, e.g. " (0 = off)"; kind: what
    the integer is ("an integer token id")."""
    if v is None and optional:
        return None

    def expected():               # (worded only for an error: a server checks every request)
        return ("None or " if optional else "") + kind + int_range(lo, hi) + note
    if not is_int(v):
        raise ValidationError(field, expected(), v, owner=owner, shown=typed(v))
    n = int(v)
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        raise ValidationError(field, expected(), v, owner=owner)
    return n


def check_seed(field: str, v, *, optional: bool = False, owner: str | None = None) -> int | None:
    """A seed: an integer in [0, 2**63-1] (it travels in an int64 tensor)."""
    return check_int(field, v, 0, SEED_MAX, optional=optional, owner=owner)


def check_real(field: str, v, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
               optional: bool = False, note: str = "", owner: str | None = None) -> float | None:
    """A finite real number (not a bool; an int is fine) in [lo, hi] ((lo, hi] when lo_open), as a
    Python float. Integers are compared before float() so that 10**400 is refused, not an
    OverflowError."""
    if v is None and optional:
        return None

    def expected():               # (worded only for an error: a server checks every request)
        if lo is not None and hi is not None:
            rng = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        elif lo is not None:
            rng = f" {'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f" <= {hi:g}" if hi is not None else ""
        return ("None or " if optional else "") + "a finite number" + rng + note
    if not is_real(v):
        raise ValidationError(field, expected(), v, owner=owner, shown=typed(v))
    try:
        x = int(v) if is_int(v) else float(v)
        if not math.isfinite(x) or (lo is not None and not (lo < x if lo_open else lo <= x)) or \
                (hi is not None and not x <= hi):
            raise OverflowError
        return float(x)
    except (OverflowError, ValueError, TypeError):
        raise ValidationError(field, expected(), v, owner=owner) from None


def check_bool(field: str, v, owner: str | None = None) -> bool:
    if not isinstance(v, bool):
        raise ValidationError(field, "True or False", v, owner=owner, shown=typed(v))
    return v


def check_choice(field: str, v, choices, *, optional: bool = False, owner: str | None = None):
    """One of `choices` (None too when optional); a near miss gets "did you mean ...?"."""
    if (v is None and optional) or v in choices:
        return v
    expected = ("None or " if optional else "") + "one of " + ", ".join(repr(c) for c in choices)
    guess = difflib.get_close_matches(v.lower(), [str(c) for c in choices], n=1, cutoff=0.6) \
        if isinstance(v, str) else []
    raise ValidationError(field, expected, v, f": did you mean {guess[0]!r}?" if guess else "", owner=owner,
                          shown=None if isinstance(v, str) else typed(v))


def check_dtype(v, field: str = "dtype") -> str | None:
    """None, a name ("bf16", "half", "float32", ...) or a torch dtype -> None or one of DTYPES."""
    if v is None:
        return None
    key = str(v).removeprefix("torch.") if type(v).__name__ == "dtype" else v
    if isinstance(key, str) and key.strip().lower() in DTYPE_ALIASES:
        return DTYPE_ALIASES[key.strip().lower()]
    raise ValidationError(field, "None or one of " + ", ".join(repr(d) for d in DTYPES) + " (aliases: " +
                          ", ".join(repr(a) for a in DTYPE_ALIASES if a not in DTYPES) + "; or the torch dtype)",
                          v, shown=None if isinstance(v, str) else typed(v))


def check_device(v, field: str = "device") -> str | None:
    """None, "cpu", "cuda", "cuda:N" or a torch.device of those -> None or that string."""
    if v is None:
        return None
    text = str(v) if type(v).__name__ == "device" else v
    if isinstance(text, str) and _DEVICE.fullmatch(text):
        return text
    hint = ""
    if isinstance(text, str):
        low = text.strip().lower()
        base, _, index = low.partition(":")
        guess = DEVICE_HINTS.get(low) or (low if _DEVICE.fullmatch(low) else None)
        if guess is None and DEVICE_HINTS.get(base) and (not index or index.isdigit()):
            guess = DEVICE_HINTS[base] + (":" + index if index else "")
        if guess is None and re.fullmatch(r"(gpu|cuda)\s*:?\s*\d+", low):
            guess = "cuda:" + re.sub(r"\D", "", low)
        hint = f": did you mean {guess!r}?" if guess else ""
    raise ValidationError(field, "None, 'cpu', 'cuda' or 'cuda:N'", v, hint,
                          shown=None if isinstance(v, str) else typed(v))


def check_device_present(name: str, field: str = "device") -> None:
    """A CUDA device name that torch can use here (imports torch: call it after the cheap checks)."""
    if not name.startswith("cuda"):
        return
    import torch
    if not torch.cuda.is_available():
        raise ValidationError(field, "a device this machine has", name,
                              " (torch.cuda.is_available() is False: a CPU-only torch build or no GPU); "
                              "use 'cpu'")
    count = torch.cuda.device_count()
    if ":" in name and int(name.split(":")[1]) >= count:
        have = ", ".join(f"cuda:{i}" for i in range(min(count, 4))) + (", ..." if count > 4 else "")
        raise ValidationError(field, f"a device this machine has ({have})", name,
                              f" (torch sees {count} CUDA device(s))")
