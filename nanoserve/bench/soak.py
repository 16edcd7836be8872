"""`python -m nanoserve bench soak`: a bounded soak of the HTTP server with good and bad clients mixed (chapter 08).

    python -m nanoserve bench soak --duration 60                 # starts its own server (the embedded model)
    python -m nanoserve bench soak --duration 60 --url http://127.0.0.1:8000 --api-key KEY

`--concurrency` clients loop for `--duration` seconds, each request drawn (seeded) from the mix:

    good        a short chat completion, streamed or not               expect 200
    malformed   garbage JSON, an unknown field, a bad value             expect 400
    cancelled   a stream the client drops after its first event         (the server must abort it)
    timed_out   a long request with "timeout": 0.2                      expect 408 / an error event
    limited     a request with the rate-limited key                     expect 429 (own server only)
    hostile     what a hostile tenant sends (chapter 15's tests): a seed  expect 4xx, or 200 where it is allowed
                past 2**64, NaN, a lone surrogate, text/plain, n × max_tokens
                past the bound, another tenant's cache salt, /metrics
                with a tenant's key, the engine view

and reports the requests by outcome, how many 5xx (must be 0), the KV blocks still held once the server is idle
again (must be 0; read from /metrics' kv_cache_usage_perc and num_requests_running) and, for a server it
started itself, this process's resident memory at start and end (the server runs in it).
"""

import asyncio
import json
import random
import time
from collections import Counter

KINDS = ["good", "good", "good", "malformed", "cancelled", "timed_out", "limited", "hostile"]
OWN_KEYS = {"soak": {"tenant": "soak"}, "soak-limited": {"tenant": "limited", "requests_per_second": 0.5, "burst": 1},
            "soak-ops": {"tenant": "ops", "role": "operator"}}  # the operator's key reads /metrics


def register(sub):
    p = sub.add_parser("soak", help="a bounded soak: good, malformed, cancelled, timed-out and rate-limited "
                                    "requests mixed; 5xx, leaked blocks, memory (chapter 08)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to run (default 30)")
    p.add_argument("--url", default=None, help="a running server's base URL (default: start one here)")
    p.add_argument("--api-key", default=None, help="with --url: the key to send (with tenants, an operator's: the "
                                                   "soak reads /metrics with it)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pairwise", action="store_true",
                   help="instead of the mix: every pair of request features (nanoserve/bench/pairwise.py), round "
                        "and round, each answer checked (strict JSON, OpenAI's shape, the param an error names)")
    p.set_defaults(func=run)


def rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return None


async def one(http, kind: str, rng: random.Random, key: str | None) -> str:
    """One request of `kind`; returns its outcome: the status code, or 'cancelled' / 'error event'."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    chat = {"messages": [{"role": "user", "content": rng.choice(["Hi", "Name a colour.", "2+2?"])}],
            "max_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(100)}
    if kind == "malformed":
        content = rng.choice([b"{not json", json.dumps({**chat, "tools": [{}]}).encode(),
                              json.dumps({**chat, "temperature": "hot"}).encode(),
                              json.dumps({**chat, "frobnicate": 1}).encode(), b"[" * 5000])
        r = await http.post("/v1/chat/completions", content=content, headers={**headers, "Content-Type": "application/json"})
        return str(r.status_code)
    if kind == "hostile":
        return await hostile(http, rng, headers, chat)
    if kind == "limited":
        headers = {"Authorization": "Bearer soak-limited"}
    if kind == "timed_out":
        chat |= {"max_tokens": 400, "ignore_eos": True, "timeout": 0.2}
    if kind in ("cancelled", "timed_out") or rng.random() < 0.5:
        async with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code)
            async for line in r.aiter_lines():
                if kind == "cancelled" and line.startswith("data: "):
                    return "cancelled"  # leaving the block closes the connection mid-stream
                if line.startswith('data: {"error"'):
                    return f"error event {json.loads(line[6:])['error']['code']}"
        return "200"
    r = await http.post("/v1/chat/completions", json=chat, headers=headers)
    return str(r.status_code)


async def hostile(http, rng: random.Random, headers: dict, chat: dict) -> str:
    """One hostile tenant's request (chapter 15's tests/test_ch15_hostile.py, among the normal ones); its outcome
    is "<status> <what it tried>". None may be a 5xx, none may leave anything behind."""
    attack = rng.choice(["seed past 2**64", "NaN", "lone surrogate", "text/plain", "n x max_tokens",
                         "another tenant's salt", "metrics", "engine view"])
    json_headers = {**headers, "Content-Type": "application/json"}
    if attack in ("seed past 2**64", "NaN", "lone surrogate"):
        body = json.dumps({**chat, "seed": 0, "temperature": 0.5, "messages": [{"role": "user", "content": "X"}]})
        body = {"seed past 2**64": body.replace('"seed": 0', f'"seed": {2**64}'),
                "NaN": body.replace('"temperature": 0.5', '"temperature": NaN'),
                "lone surrogate": body.replace('"X"', '"\\ud800"')}[attack]
        r = await http.post("/v1/chat/completions", content=body, headers=json_headers)
    elif attack == "text/plain":
        r = await http.post("/v1/chat/completions", content=json.dumps(chat), headers={**headers, "Content-Type": "text/plain"})
    elif attack == "n x max_tokens":
        r = await http.post("/v1/chat/completions", json={**chat, "n": 16, "max_tokens": 10**6}, headers=headers)
    elif attack == "another tenant's salt":
        r = await http.post("/v1/chat/completions", json={**chat, "cache_salt": "tenant:ops"}, headers=headers)
    elif attack == "metrics":
        r = await http.get("/metrics", headers=headers)
    else:  # open the engine view's stream, read its first line, leave
        async with http.stream("GET", "/engine/events", headers=headers) as s:
            async for _ in s.aiter_lines():
                break
            return f"{s.status_code} {attack}"
    return f"{r.status_code} {attack}"


async def soak(url: str, duration: float, concurrency: int, seed: int, key: str | None, own: bool) -> Counter:
    import httpx

    outcomes = Counter()
    stop_at = time.monotonic() + duration
    kinds = KINDS if own else [k for k in KINDS if k != "limited"]

    async def client(i: int):
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while time.monotonic() < stop_at:
                kind = rng.choice(kinds)
                try:
                    outcome = await one(http, kind, rng, key)
                except httpx.HTTPError as e:
                    outcome = f"client error {type(e).__name__}"
                outcomes[f"{kind}: {outcome}"] += 1

    await asyncio.gather(*[client(i) for i in range(concurrency)])
    return outcomes


def idle_pool(url: str, key: str | None, timeout: float = 10.0) -> tuple[float, float]:
    """(requests running, KV usage) from /metrics once the server is idle (or as they are after `timeout`)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout
    while True:
        values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=headers).text)
                  for s in f.samples}
        running, usage = values["nanoserve:num_requests_running"], values["nanoserve:kv_cache_usage_perc"]
        if (running == 0 and usage == 0) or time.monotonic() > deadline:
            return running, usage
        time.sleep(0.1)


def report(outcomes: Counter, running: float, usage: float, rss: tuple) -> dict:
    fivexx = sum(n for k, n in outcomes.items() if k.split(": ")[1][:1] == "5" or "error event 5" in k)
    print(f"{sum(outcomes.values())} requests by outcome:")
    for k in sorted(outcomes):
        print(f"  {k:<32} {outcomes[k]}")
    print(f"5xx: {fivexx}   requests still running: {running:g}   KV pool in use when idle: {usage:.1%}")
    if rss[0] is not None:
        print(f"resident memory of the serving process: {rss[0]:.0f} MiB at start, {rss[1]:.0f} MiB at the end")
    return {"outcomes": dict(outcomes), "5xx": fivexx, "running": running, "kv_usage": usage, "rss_mib": rss}


def soak_engine(engine, tokenizer, duration: float, concurrency: int = 8, seed: int = 0) -> dict:
    """Serve `engine` here (with the soak's two keys) and soak it; the report's dict."""
    from nanoserve.server.limits import load_api_keys_dict
    from nanoserve.server.runner import serving

    with serving(engine, tokenizer, api_keys=load_api_keys_dict({"keys": OWN_KEYS}), request_timeout=30) as (url, _):
        start = rss_mib()
        outcomes = asyncio.run(soak(url, duration, concurrency, seed, "soak", own=True))
        running, usage = idle_pool(url, "soak-ops")
        return report(outcomes, running, usage, (start, rss_mib()))


def run(args):
    if args.duration <= 0 or args.concurrency < 1:
        print("error: --duration must be > 0 and --concurrency >= 1", flush=True)
        return 2
    if args.pairwise:
        return run_pairwise(args)
    if args.url is not None:
        url = args.url.rstrip("/").removesuffix("/v1")
        outcomes = asyncio.run(soak(url, args.duration, args.concurrency, args.seed, args.api_key, own=False))
        result = report(outcomes, *idle_pool(url, args.api_key), (None, None))
    else:
        from nanoserve.llm import LLM
        from nanoserve.model import load_gguf

        llm = LLM(load_gguf(), num_blocks=256, max_num_seqs=16)
        result = soak_engine(llm.engine, llm.tokenizer, args.duration, args.concurrency, args.seed)
    return 0 if result["5xx"] == 0 and result["running"] == 0 and result["kv_usage"] == 0 else 1


def run_pairwise(args) -> int:
    """`bench soak --pairwise`: the pairwise crossing against its own server on the embedded model (speculation and
    prefix caching on, the crossing's two keys), then the pool once idle. 0 when nothing was wrong."""
    if args.url is not None:
        print("error: --pairwise starts its own server (its keys and --default-max-tokens are the crossing's); "
              "drop --url", flush=True)
        return 2
    from nanoserve.bench import pairwise
    from nanoserve.llm import LLM
    from nanoserve.model import load_gguf
    from nanoserve.server.limits import Tenant
    from nanoserve.server.runner import serving

    llm = LLM(load_gguf(), num_blocks=256, max_num_seqs=16, speculative="ngram")
    default = 16  # chat without max_tokens: a short answer, so a minute serves many rows
    with serving(llm.engine, llm.tokenizer, api_key=pairwise.KEYS["plain"], default_max_tokens=default,
                 api_keys={pairwise.KEYS["tenant"]: Tenant("pairwise")}) as (url, server):
        result = pairwise.soak(url, server.state.config.model_name, args.duration, args.concurrency, default)
        running, usage = idle_pool(url, pairwise.KEYS["plain"])
    print(f"{result['requests']} requests ({result['rows']} rows of the crossing, round and round) by status:")
    for status, n in sorted(result["statuses"].items()):
        print(f"  {status:<24} {n}")
    print(f"5xx: {result['5xx']}   answers with a problem: {len(result['problems'])}   requests still running: "
          f"{running:g}   KV pool in use when idle: {usage:.1%}")
    for problem in result["problems"][:10]:
        print(f"  {problem[:300]}")
    return 0 if not result["problems"] and result["5xx"] == 0 and running == 0 and usage == 0 else 1
