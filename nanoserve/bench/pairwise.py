"""Chapter 08 — every pair of request features: a covering array of requests, sent, and each answer checked.

One feature at a time is tested everywhere; two together is where servers break (response_format with
top_logprobs once answered 500: the grammar's masked tokens had log p = -inf, which is not JSON). Trying every
combination of the 20 features below is 2^13 · 3^3 · 4^2 · 5^2 ≈ 8.8·10^7 requests; trying every *pair* of values
takes 62 (covering_rows()), because one request covers C(20, 2) = 190 pairs at once:

    FACTORS        feature -> its values (a fault: one invalid field, whose 400 must name it)
    covering_rows  a greedy all-pairs generator: rows until every allowed pair of values is in some row
    request_body   a row -> the JSON body of one request;  expected(row) -> (status, param)
    send           one row through the official openai client or raw HTTP, keeping the raw bytes of the answer
    problems       what is wrong with an answer: a 5xx, a body that is not strict JSON (NaN / Infinity), not
                   OpenAI's shape, an error that names the wrong `param`

tests/test_ch08_pairwise.py runs the crossing on the tiny model and checks, after each request, that no
request is running and no KV block is held; `.venv/bin/python -m nanoserve bench soak --pairwise` repeats it
for a minute against SmolLM2.
"""

import itertools
import json
import math
import random

# The features a request can carry, and the values tried. `fault` is one invalid field at a time (None: none):
# its 400 must name that field whatever else the request asks. A row with a fault counts only for the pairs
# that involve the fault (the rest of it is never served); every other pair is covered by a served request.
FACTORS = {
    "client": ["openai", "http"],
    "endpoint": ["chat", "completions"],
    "stream": ["no", "yes", "yes+usage"],
    "n": [1, 2],
    "logprobs": [None, 0, 5],  # chat: logprobs + top_logprobs k; completions: logprobs k
    "echo": [False, True],
    "response_format": [None, "json_object", "json_schema", "choice"],  # choice: vLLM's structured_outputs
    "stop": [None, "\n", [".", "!", "?", ","]],
    "penalties": [False, True],
    "logit_bias": [False, True],
    "seed": [None, 7],
    "temperature": [0.0, 0.9],
    "max_tokens": [None, 0, 1, 6],  # None: the server's default (chat) or OpenAI's 16 (completions)
    "speculative": [True, False],  # the server speculates (chapter 14) unless the request opts out
    "prefix": ["fresh", "shared"],  # shared: the prompt starts with text earlier requests cached (chapter 05)
    "key": ["plain", "tenant"],  # the server's --api-key, or a tenant's key from --api-keys
    "timeout": [None, "expired"],
    "disconnect": [False, True],  # the client leaves after the first event (streamed) or at once
    "tools": [None, "required", "named", "auto", "none"],  # chapter 13: TOOLS offered, and tool_choice
    "fault": [None, "max_tokens_huge", "logit_bias_oov", "image_part", "echo_with_stream"],
}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
SHARED = "You are a careful assistant who answers in one short sentence. " * 3  # > 2 KV blocks of 16 tokens
CHOICES = ["yes", "no"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]
TOOL_CHOICE = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}},
               "auto": "auto", "none": "none"}
KEYS = {"plain": "pairwise-key", "tenant": "pairwise-tenant-key"}  # the keys the server under test must accept


# what a value needs of other features: echo is completions' alone, and not streamed (echo + stream is a fault of
# its own); max_tokens 0 only scores the prompt (echo); an image part is a chat message's; tools are chat's, and
# offered they constrain the reply themselves (no response_format beside them); a grammar (a response_format, a
# forced call; "auto" has none here: no tool is strict) has no stop strings (a stop would cut its JSON: the server refuses the pair, tests/test_ch13_tools.py)
NEEDS = {("echo", True): {"endpoint": {"completions"}, "stream": {"no"}},
         ("max_tokens", 0): {"endpoint": {"completions"}, "echo": {True}, "stream": {"no"}},
         ("fault", "image_part"): {"endpoint": {"chat"}},
         ("fault", "echo_with_stream"): {"endpoint": {"completions"}, "stream": {"yes", "yes+usage"}},
         ("tools", "none"): {"endpoint": {"chat"}},
         ("tools", "auto"): {"endpoint": {"chat"}, "response_format": {None}},  # no tool strict: no grammar
         **{("tools", forced): {"endpoint": {"chat"}, "response_format": {None}, "stop": {None}}
            for forced in ("required", "named")},
         **{("response_format", rf): {"stop": {None}} for rf in ("json_object", "json_schema", "choice")}}


def allowed(row: dict) -> bool:
    """Whether these (possibly partial) values can go in one request: what each needs of the others agrees
    with what is there and with what the rest need (the needs are closed: echo's are part of max_tokens 0's);
    and no streamed logprobs beside offered tools (the server refuses the three together)."""
    for factor in ("endpoint", "stream", "echo", "response_format", "stop"):
        options = {_key(row[factor])} if factor in row else {_key(v) for v in FACTORS[factor]}
        for (k, v), needs in NEEDS.items():
            if k in row and row[k] == v and factor in needs:
                options &= {_key(n) for n in needs[factor]}
        if not options:
            return False
    offered = row.get("tools") not in (None, "none")
    return not (offered and row.get("stream", "no") != "no" and row.get("logprobs") is not None)


def _key(value):
    return json.dumps(value)  # lists are values too: hashable, and equal when equal


def counted_pairs(row: dict) -> set:
    """The pairs of values a full row covers: all of them, or with a fault only those that involve it."""
    if row["fault"] is None:
        return {((a, _key(row[a])), (b, _key(row[b]))) for a, b in itertools.combinations(FACTORS, 2)}
    return {((k, _key(row[k])), ("fault", _key(row["fault"]))) for k in FACTORS if k != "fault"}


def required_pairs() -> set:
    """Every pair of values of two features that some row can hold ("fault" is the last feature)."""
    return {((a, _key(va)), (b, _key(vb))) for a, b in itertools.combinations(FACTORS, 2)
            for va, vb in itertools.product(FACTORS[a], FACTORS[b]) if allowed({a: va, b: vb})}


def covering_rows(seed: int = 0, tries: int = 8) -> list[dict]:
    """Rows (feature -> value) such that every pair of required_pairs() is counted by some row.

    Greedy, as AETG: each new row starts from a pair not yet covered (so every row makes progress), fills the
    other features one at a time in a random order, each with the allowed value that covers the most pairs
    still to cover; of `tries` such rows the one covering most is kept. Deterministic for a seed."""
    rng, todo, rows = random.Random(seed), required_pairs(), []
    while todo:
        (a, va), (b, vb) = min(todo)
        either_way = todo | {(q, p) for p, q in todo}
        best, best_new = None, -1
        for _ in range(tries):
            row = {a: json.loads(va), b: json.loads(vb)}
            row.setdefault("fault", None)  # a pair of two features is covered by a request served whole
            for k in rng.sample([k for k in FACTORS if k not in row], len(FACTORS) - len(row)):
                options = [v for v in FACTORS[k] if allowed({**row, k: v})]
                if not options:
                    raise ValueError(f"no value of {k} fits {row}")
                rng.shuffle(options)  # ties broken at random
                row[k] = max(options, key=lambda v: len({((k, _key(v)), (j, _key(row[j]))) for j in row} & either_way))
            new = len(counted_pairs(row) & todo)
            if new > best_new:
                best, best_new = row, new
        rows.append({k: best[k] for k in FACTORS})
        todo -= counted_pairs(best)
    return rows


def request_body(row: dict, i: int, model: str) -> dict:
    """Request i of the crossing: the row's features as one body of the row's endpoint."""
    chat, fault = row["endpoint"] == "chat", row["fault"]
    text = (SHARED if row["prefix"] == "shared" else f"Request {i}. ") + "Name a colour."
    body = {"model": model, **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})}
    if fault == "image_part":
        body["messages"][0]["content"] = [{"type": "text", "text": text},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    if row["stream"] != "no":
        body["stream"] = True
    if row["stream"] == "yes+usage":
        body["stream_options"] = {"include_usage": True}
    if row["n"] > 1:
        body["n"] = row["n"]
    if row["logprobs"] is not None:
        body |= {"logprobs": True, "top_logprobs": row["logprobs"]} if chat else {"logprobs": row["logprobs"]}
    if row["echo"] or fault == "echo_with_stream":
        body["echo"] = True
    if row["response_format"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif row["response_format"] == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    elif row["response_format"] == "choice":  # a narrow grammar: fewer allowed tokens than top_logprobs asks
        body["structured_outputs"] = {"choice": CHOICES}
    if row["stop"] is not None:
        body["stop"] = row["stop"]
    if row["penalties"]:
        body |= {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    if row["logit_bias"] or fault == "logit_bias_oov":
        body["logit_bias"] = {"13": 5.0} | ({"1000000": 1.0} if fault == "logit_bias_oov" else {})
    if row["seed"] is not None:
        body["seed"] = row["seed"]
    body["temperature"] = row["temperature"]
    if row["max_tokens"] is not None or fault == "max_tokens_huge":
        body["max_tokens"] = 10**9 if fault == "max_tokens_huge" else row["max_tokens"]
    if not row["speculative"]:
        body["speculative"] = False
    if row["tools"] is not None:
        body |= {"tools": TOOLS, "tool_choice": TOOL_CHOICE[row["tools"]]}
    if row["timeout"] == "expired":
        body["timeout"] = 1e-6  # past before the first step: the deadline check fires at once
    return body


def expected(row: dict) -> tuple[int, str | None]:
    """(HTTP status, the error's param) the row must get (200, None: served; a stream may still carry an error)."""
    params = {"image_part": "messages[0].content", "max_tokens_huge": "max_tokens", "logit_bias_oov": "logit_bias",
              "echo_with_stream": "echo"}
    if row["fault"] is not None:
        return 400, params[row["fault"]]
    if row["timeout"] == "expired" and row["stream"] == "no":
        return 408, "timeout"
    return 200, None


def strict_loads(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity (Python's accepts them; JSON does not)."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# the openai client's own parameters; the rest of a body travels in extra_body
_OPENAI_ARGS = {"model", "stream", "stream_options", "n", "logprobs", "stop", "presence_penalty", "frequency_penalty",
                "logit_bias", "seed", "temperature", "max_tokens"}
_OPENAI_CHAT = {"messages", "top_logprobs", "response_format", "tools", "tool_choice"}
_OPENAI_COMPLETIONS = {"prompt", "echo"}


def send(row: dict, body: dict, url: str, wait: float = 60.0) -> tuple[int | None, bytes]:
    """Send one request as the row says; (status, the raw bytes of the answer). status None: the client left
    before the status line (a disconnect without a stream)."""
    import httpx
    import openai

    headers = {"Authorization": f"Bearer {KEYS[row['key']]}"}
    chat, streamed = row["endpoint"] == "chat", body.get("stream", False)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if row["client"] == "http":
        with httpx.Client(base_url=url, timeout=0.05 if row["disconnect"] and not streamed else wait) as http:
            try:
                with http.stream("POST", path, json=body, headers=headers) as r:
                    if r.status_code == 200 and streamed and row["disconnect"]:
                        return 200, next(r.iter_bytes())  # the first event, then leave
                    return r.status_code, r.read()
            except httpx.TimeoutException:
                return None, b""
    recorder = _Recorder()
    own = _OPENAI_ARGS | (_OPENAI_CHAT if chat else _OPENAI_COMPLETIONS)
    args = {k: v for k, v in body.items() if k in own}
    extra = {k: v for k, v in body.items() if k not in own}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[row["key"]], max_retries=0,
                           timeout=0.05 if row["disconnect"] and not streamed else wait,
                           http_client=httpx.Client(transport=recorder))
    create = client.chat.completions.create if chat else client.completions.create
    try:
        answer = create(**args, extra_body=extra or None)
        if streamed:
            for _ in answer:
                if row["disconnect"]:
                    break  # leave after the first event
            answer.close()
        return 200, recorder.body
    except openai.APIStatusError as e:
        return e.status_code, recorder.body
    except openai.APITimeoutError:
        return None, b""
    except openai.APIError:  # an error event in a stream (the status line said 200): the client raises it
        return 200, recorder.body
    finally:
        client.close()


class _Recorder:
    """An httpx transport that keeps the raw bytes of the last response body it passes on (the openai client
    parses them; the check reads them as sent)."""

    def __init__(self):
        import httpx

        self.inner, self.raw = httpx.HTTPTransport(), bytearray()

    @property
    def body(self) -> bytes:
        return bytes(self.raw)

    def handle_request(self, request):
        import httpx

        response = self.inner.handle_request(request)
        self.raw = bytearray()
        raw = self.raw

        class Tee(httpx.SyncByteStream):
            def __iter__(self):
                for chunk in response.stream:
                    raw.extend(chunk)
                    yield chunk

            def close(self):
                response.stream.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Tee(),
                              extensions=response.extensions)

    def close(self):
        self.inner.close()


def problems(row: dict, body: dict, status: int | None, raw: bytes, default_max_tokens: int | None) -> list[str]:
    """What is wrong with one answer ([] when nothing): the status, strict JSON, OpenAI's shape."""
    want, param = expected(row)
    if status is None:  # left before the answer: nothing to judge here (the caller checks nothing is left behind)
        return []
    if status >= 500:
        return [f"a {status}: {raw[:300]!r}"]
    if row["disconnect"] and body.get("stream") and status == 200:
        return _stream_problems(row, body, raw, partial=True)
    if status != want:
        return [f"status {status}, expected {want}: {raw[:300]!r}"]
    try:
        if status != 200:
            return _error_problems(strict_loads(raw), status, param)
        if body.get("stream"):
            return _stream_problems(row, body, raw, partial=False)
        return _body_problems(row, body, strict_loads(raw), default_max_tokens)
    except ValueError as e:  # a JSONDecodeError, or a NaN / Infinity
        return [f"not strict JSON ({e}): {raw[:300]!r}"]


def _error_problems(answer: dict, status: int, param: str | None) -> list[str]:
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return [f"not OpenAI's error format: {answer}"]
    if error["code"] != status or error["param"] != param or not error["message"]:
        return [f"error {error}, expected code {status} and param {param!r}"]
    return []


def _body_problems(row: dict, body: dict, answer: dict, default_max_tokens: int | None) -> list[str]:
    chat = row["endpoint"] == "chat"
    found = []
    if answer.get("object") != ("chat.completion" if chat else "text_completion") or not answer.get("id"):
        found.append(f"object / id: {answer.get('object')!r} {answer.get('id')!r}")
    choices = answer.get("choices", [])
    if [c.get("index") for c in choices] != list(range(row["n"])):
        found.append(f"choice indices {[c.get('index') for c in choices]}, n = {row['n']}")
    cap = body.get("max_tokens", default_max_tokens if chat else 16)
    usage = answer.get("usage", {})
    if usage.get("total_tokens") != usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0) or \
            (cap is not None and usage.get("completion_tokens", 0) > row["n"] * cap):
        found.append(f"usage {usage}, max_tokens {cap}, n {row['n']}")
    for c in choices:
        text = (c["message"]["content"] or "") if chat else c["text"]
        if chat and c["message"].get("role") != "assistant":
            found.append(f"message {c['message']}")
        if c.get("finish_reason") not in ("stop", "length", *(("tool_calls",) if _offered(row) else ())):
            found.append(f"finish_reason {c.get('finish_reason')!r}")
        if chat:
            found += _tool_call_problems(row, c["message"].get("tool_calls"), c.get("finish_reason"))
        if row["echo"] and not text.startswith(body["prompt"]):
            found.append(f"echo: {text[:60]!r} does not start with the prompt")
        found += _logprobs_problems(row, c.get("logprobs"))
        found += _json_problems(row, text[len(body["prompt"]):] if row["echo"] else text, c.get("finish_reason"))
    return found


def _stream_problems(row: dict, body: dict, raw: bytes, partial: bool) -> list[str]:
    """Every event `data: {json}`, strict; the last `data: [DONE]` (unless the client left); the timeout's
    error event where one is due; each completion's text valid JSON when it finished under a response_format."""
    text = raw.decode(errors="replace")
    if partial:  # the client left after its first read: the last event may be cut
        text = text[:text.rfind("\n\n") + 1]
    events = [e for e in text.split("\n\n") if e.strip()]
    if (not events and not partial) or any(not e.startswith("data: ") for e in events):
        return [f"not server-sent events: {raw[:300]!r}"]
    stopped_at_error = row["client"] == "openai" and events[-1].startswith('data: {"error"')  # it reads no further
    if not partial and events[-1] != "data: [DONE]" and not stopped_at_error:
        return [f"no [DONE] at the end: {events[-1][:200]!r}"]
    chunks, found = [strict_loads(e[6:]) for e in events if e != "data: [DONE]"], []
    errors = [c["error"] for c in chunks if "error" in c]
    if row["timeout"] == "expired" and (errors or not partial):  # a client that left may have read the 408 first
        if [(e["code"], e["param"]) for e in errors] != [(408, "timeout")]:
            found.append(f"a stream past its timeout must carry one 408 event naming timeout: {errors}")
    elif errors:
        found.append(f"error events {errors}")
    texts, finish, calls = {}, {}, {}
    kind = "chat.completion.chunk" if row["endpoint"] == "chat" else "text_completion"
    for c in (c for c in chunks if "error" not in c):
        if c.get("object") != kind or not isinstance(c.get("choices"), list):
            found.append(f"chunk {str(c)[:200]}")
            continue
        for choice in c["choices"]:
            if not 0 <= choice["index"] < row["n"]:
                found.append(f"choice index {choice['index']}")
            piece = choice["delta"].get("content") if row["endpoint"] == "chat" else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
            for part in (choice["delta"].get("tool_calls") or []) if row["endpoint"] == "chat" else []:
                call = calls.setdefault(choice["index"], {}).setdefault(
                    part["index"], {"id": part.get("id"), "type": part.get("type"),
                                    "function": {"name": part["function"].get("name"), "arguments": ""}})
                call["function"]["arguments"] += part["function"].get("arguments", "")
            if "role" not in choice.get("delta", {}):  # chat's first chunk of a completion carries no token
                found += _logprobs_problems(row, choice.get("logprobs"))
    if not partial and body.get("stream_options") and not errors and not chunks[-1].get("usage"):
        found.append(f"include_usage, but the last chunk has none: {chunks[-1]}")
    for i, text in texts.items():
        if not partial:
            found += _json_problems(row, text, finish.get(i))
            if row["endpoint"] == "chat":
                listed = calls.get(i)
                found += _tool_call_problems(row, [listed[j] for j in sorted(listed)] if listed else None, finish.get(i))
    return found


def _offered(row: dict) -> bool:
    return row["tools"] not in (None, "none")


def _tool_call_problems(row: dict, tool_calls: list | None, finish_reason: str | None) -> list[str]:
    """No tool_calls unless tools were offered; finish_reason "tool_calls" exactly when there are calls; a call
    that finished ("tool_calls") has an id, a tool's name (the named one, if named) and arguments that are a JSON
    object valid against that tool's schema. A call cut by max_tokens ("length") may hold partial arguments."""
    import jsonschema

    if not tool_calls:
        return ["finish_reason tool_calls without calls"] if finish_reason == "tool_calls" else []
    if not _offered(row):
        return [f"tool_calls without tools offered: {tool_calls}"]
    if finish_reason not in ("tool_calls", "length"):
        return [f"tool_calls with finish_reason {finish_reason!r}"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    found = []
    for call in tool_calls:
        name = call["function"]["name"]
        if not str(call.get("id")).startswith("call_") or call.get("type") != "function" or name not in schemas or \
                (row["tools"] == "named" and name != TOOL_CHOICE["named"]["function"]["name"]):
            found.append(f"tool call {call}")
        elif finish_reason == "tool_calls":
            try:
                jsonschema.validate(strict_loads(call["function"]["arguments"]), schemas[name])
            except (ValueError, jsonschema.ValidationError) as e:
                found.append(f"tool call {name}: arguments {call['function']['arguments']!r} ({str(e)[:100]})")
    return found


def _logprobs_problems(row: dict, logprobs) -> list[str]:
    """None when not asked; else the endpoint's shape, every number finite and <= 0, at most k alternatives."""
    k = row["logprobs"]
    if k is None:
        return [] if logprobs is None else [f"logprobs not asked for: {str(logprobs)[:100]}"]
    if logprobs is None:
        return ["logprobs asked for, got null"]

    def bad(x, may_be_none=False):
        return not ((x is None and may_be_none) or (isinstance(x, float | int) and math.isfinite(x) and x <= 1e-6))

    if row["endpoint"] == "chat":
        for e in logprobs["content"]:
            tops = e["top_logprobs"]
            if bad(e["logprob"]) or len(tops) > k or any(bad(t["logprob"]) for t in tops) or not isinstance(e["bytes"], list):
                return [f"chat logprobs entry {e}"]
        return []
    lists = [logprobs[f] for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset")]
    if len({len(x) for x in lists}) != 1:
        return [f"completions logprobs of unequal lengths: {logprobs}"]
    first_free = row["echo"]  # with echo the prompt's first token has no logprob (null)
    for i, (lp, top) in enumerate(zip(lists[1], lists[2])):
        none_ok = first_free and i == 0
        if bad(lp, none_ok) or (top is not None and (len(top) > k or any(bad(v) for v in top.values()))) or \
                (top is None and not none_ok):
            return [f"completions logprobs at {i}: {lp} {top}"]
    return []


def _json_problems(row: dict, text: str, finish_reason: str | None) -> list[str]:
    """Under a response_format a completion that stopped (not cut by max_tokens) is one JSON value, strict
    (a choice: one of the choices)."""
    if row["response_format"] is None or finish_reason != "stop":
        return []
    if row["response_format"] == "choice":
        return [] if text in CHOICES else [f"choice: {text!r} is none of {CHOICES}"]
    try:
        value = strict_loads(text)
    except ValueError:
        return [f"response_format {row['response_format']}: {text!r} is not JSON"]
    if row["response_format"] == "json_schema" and not (isinstance(value, dict) and isinstance(value.get("answer"), int)):
        return [f"response_format json_schema: {value!r} does not follow the schema"]
    return [] if isinstance(value, dict) else [f"json_object: {value!r} is not an object"]


def soak(url: str, model: str, duration: float, concurrency: int = 4, default_max_tokens: int | None = None) -> dict:
    """The crossing's rows, sent round and round from `concurrency` threads for `duration` seconds against the
    server at `url` (which accepts KEYS); its statuses counted and every answer checked with `problems`."""
    import threading
    import time
    from collections import Counter

    rows, statuses, found, lock = covering_rows(), Counter(), [], threading.Lock()
    stop_at, sent = time.monotonic() + duration, itertools.count()

    def client():
        while time.monotonic() < stop_at:
            with lock:
                i = next(sent)
            row = rows[i % len(rows)]
            body = request_body(row, i, model)
            status, raw = send(row, body, url)
            bad = problems(row, body, status, raw, default_max_tokens)
            with lock:
                statuses["left before the answer" if status is None else str(status)] += 1
                found.extend(f"request {i} {row}: {p}" for p in bad)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"statuses": dict(statuses), "requests": sum(statuses.values()), "rows": len(rows), "problems": found,
            "5xx": sum(n for s, n in statuses.items() if s.startswith("5"))}
