"""Chapter 13 — what a request asks its output to be: a JSON schema, any JSON object, a regex, a choice
list or an EBNF grammar (vLLM's `StructuredOutputsParams`, the same names).

Exactly one is given. `key` is the request's grammar as canonical text, what the compiled-grammar cache
is keyed by, so two requests with the same schema written differently (spacing, a string vs a dict)
share one compilation:

    >>> StructuredOutputsParams(json='{"type": "integer"}').key
    'json:{"type":"integer"}'
    >>> StructuredOutputsParams(choice=["yes", "no"]).key
    'choice:["yes","no"]'

Key order is kept, not sorted: a schema's property order is the order the grammar writes the keys in,
so {"a", "b"} and {"b", "a"} are two grammars.
"""

import json as _json
from dataclasses import dataclass, field

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema (a dict, or its text)
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # xgrammar's EBNF
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        kind = given[0]
        if kind == "json":
            try:
                schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            except _json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            text = _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            text = _json.dumps(self.choice, separators=(",", ":"), ensure_ascii=False)
        elif kind == "json_object":
            text = "object"
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
            text = value
        object.__setattr__(self, "key", f"{kind}:{text}")

    @property
    def kind(self) -> str:
        return self.key.split(":", 1)[0]

    @property
    def text(self) -> str:
        """The canonical text after `kind:` (the schema, the regex, the choices as JSON, ...)."""
        return self.key.split(":", 1)[1]
