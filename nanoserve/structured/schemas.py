"""Chapter 13 — the schemas the tests, the notebook and `bench structured` ask for: nested objects, arrays with
bounds, enums, numbers with ranges, strings with patterns, optional fields. Small on purpose (a 135M model, short
outputs), each with the prompt that asks for it — the schema is in the prompt too (chapter 13: constrain *and*
tell the model what you want)."""

import json

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"]}}, "required": ["user"]},
    "array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 3}},
        "required": ["colors"]},
    "enum": {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                                              "note": {"type": "string", "maxLength": 15}}, "required": ["mood"]},
    "numbers": {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                                 "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["price", "qty"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                 "ok": {"type": "boolean"}}, "required": ["code", "ok"]},
}

TASKS = {
    "nested": "Describe a user with a name and an age.",
    "array": "List two or three colours.",
    "enum": "How do you feel today?",
    "numbers": "Give the price and quantity of an order.",
    "pattern": "Give a product code like ABC-123 and whether it is in stock.",
}


def prompt(name: str) -> list[dict]:
    """The chat messages for schema `name`: the task, and the schema it must answer in."""
    return [{"role": "user", "content": f"{TASKS[name]} Answer only with JSON that follows this schema: "
                                        f"{json.dumps(SCHEMAS[name])}"}]
