"""speculative_config: vLLM's names, checked when the engine config is built."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..validation import ValidationError, check_bool, check_choice, check_int, typed

METHODS = ("ngram", "draft")
MAX_K = 32
_OWNER = "speculative_config"


@dataclass
class SpeculativeConfig:
    """method: "ngram" (prompt lookup) or "draft" (a smaller model, `model`: a name or path any
    LLM() loads, same tokenizer). num_speculative_tokens: k, the most guesses per step.
    prompt_lookup_max / prompt_lookup_min: n-gram sizes tried, longest first. adaptive: let each
    request's acceptance drive its k (spec/accept.py AdaptiveK), down to none when it does not pay."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    adaptive: bool = True

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValidationError("speculative_config", "None or a dict such as {'method': 'ngram', "
                                  "'num_speculative_tokens': 4}", value, shown=typed(value))
        known = sorted(cls.__dataclass_fields__)
        for key in value:
            check_choice("a key", key, known, owner=_OWNER)
        return cls(**value)

    def __post_init__(self):
        o = _OWNER
        check_choice("method", self.method, METHODS, owner=o)
        self.num_speculative_tokens = check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_K,
                                                owner=o)
        self.prompt_lookup_max = check_int("prompt_lookup_max", self.prompt_lookup_max, 1, owner=o)
        self.prompt_lookup_min = check_int("prompt_lookup_min", self.prompt_lookup_min, 1, self.prompt_lookup_max,
                                           note=" (prompt_lookup_max)", owner=o)
        check_bool("adaptive", self.adaptive, owner=o)
        m = self.model
        if self.method == "draft" and (m is None or isinstance(m, (bool, int, float, bytes, dict, list, tuple, set))
                                       or (isinstance(m, str) and not m.strip())):
            raise ValidationError("model", "a name or path LLM() loads, or a loaded model, with method 'draft'",
                                  m, owner=o, shown=None if m is None or isinstance(m, str) else typed(m))

    def to_dict(self) -> dict:
        return asdict(self)
