"""Chapter 13 — what a request asks its output to be: a JSON schema, any JSON object, a regex, a choice
list, an EBNF grammar or a structural tag (vLLM's `StructuredOutputsParams`, the same names).

Exactly one is given. `key` is the request's grammar as canonical text, what the compiled-grammar cache
is keyed by, so two requests with the same schema written differently (spacing, a string vs a dict, the
order of a schema's keywords) share one compilation:

    >>> StructuredOutputsParams(json='{"type": "integer", "minimum": 0}').key
    'json:{"minimum":0,"type":"integer"}'
    >>> StructuredOutputsParams(json={"minimum": 0, "type": "integer"}).key
    'json:{"minimum":0,"type":"integer"}'
    >>> StructuredOutputsParams(choice=["yes", "no"]).key
    'choice:["yes","no"]'

Keywords are sorted, with two exceptions that keep the order they came in: the names under `properties`
(a schema's property order is the order the grammar writes the keys in, so {"a", "b"} and {"b", "a"} are
two grammars) and literal values (`enum`, `const`: the grammar writes them out as given). Lists keep
their order everywhere.
"""

import json as _json
from dataclasses import dataclass, field

from nanoserve.structured.trie_grammar import MAX_CHOICE_NODES, trie_nodes

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_LITERALS = ("enum", "const", "default", "examples")  # values the grammar writes verbatim: never reordered


def canonical(node, names: bool = False):
    """`node` with every object's keys sorted, except a `properties` map's names and literal values.
    names: `node` is a `properties` map (its order is the grammar's; its values are schemas)."""
    if isinstance(node, list):
        return [canonical(v) for v in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {k: canonical(v) for k, v in node.items()}
    return {k: node[k] if k in _LITERALS else canonical(node[k], names=k == "properties") for k in sorted(node)}


def _json_text(value, what: str, kinds: tuple) -> str:
    try:
        obj = _json.loads(value) if isinstance(value, str) else value
    except _json.JSONDecodeError as e:
        raise ValueError(f"the {what} is not valid JSON: {e}") from None
    if not isinstance(obj, kinds):
        raise ValueError(f"a {what} is an object, got {type(obj).__name__}")
    return _json.dumps(canonical(obj), separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema (a dict, or its text)
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # xgrammar's EBNF
    structural_tag: dict | str | None = None  # xgrammar's structural tag: free text, and JSON inside tags
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        kind = given[0]
        if kind == "json":
            text = _json_text(self.json, "JSON schema", (dict, bool))
        elif kind == "structural_tag":
            text = _json_text(self.structural_tag, "structural tag", (dict,))
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            nodes = len(trie_nodes(self.choice))
            if nodes > MAX_CHOICE_NODES:  # each node's mask is a walk over the vocabulary at compile time
                raise ValueError(f"choice has {nodes} trie nodes (distinct prefixes of its choices' bytes), over "
                                 f"this server's limit of {MAX_CHOICE_NODES}")
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
