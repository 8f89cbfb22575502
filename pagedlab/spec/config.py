"""speculative_config: vLLM's names, checked when the engine config is built."""
from __future__ import annotations

from dataclasses import asdict, dataclass

METHODS = ("ngram", "draft")


def _bad(msg):
    raise ValueError(f"speculative_config: {msg}")


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
            _bad(f"a dict such as {{'method': 'ngram', 'num_speculative_tokens': 4}}, got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            _bad(f"unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def __post_init__(self):
        if self.method not in METHODS:
            _bad(f"method must be one of {METHODS}, got {self.method!r}")
        for name, lo in (("num_speculative_tokens", 1), ("prompt_lookup_max", 1), ("prompt_lookup_min", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                _bad(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.num_speculative_tokens > 32:
            _bad(f"num_speculative_tokens={self.num_speculative_tokens}: at most 32")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            _bad(f"prompt_lookup_min={self.prompt_lookup_min} > prompt_lookup_max={self.prompt_lookup_max}")
        if not isinstance(self.adaptive, bool):
            _bad(f"adaptive must be True or False, got {self.adaptive!r}")
        if self.method == "draft" and self.model is None:
            _bad("method 'draft' needs model= (a name or path LLM() loads, or a loaded model)")

    def to_dict(self) -> dict:
        return asdict(self)
