"""`python -m nanoserve bench experiment prefix-isolation`: chapter 08's per-tenant prefix cache, as a tenant sees it.

With --api-keys every tenant's requests hash their blocks from a salt of their own (limits.prefix_cache_salt), so
tenant B cannot learn from its TTFT whether tenant A sent a prompt: B's first request for A's prefix must cost
what a miss costs. SmolLM2 (float32) behind the HTTP server, two tenants, a ~1,200-token prefix of random words
per trial (a new one each time: no trial hits another's blocks), 1 output token, greedy. Per trial, TTFT of:

    cold          B sends a prefix nobody sent                                  a miss: the reference
    cross-tenant  A sends prefix P, then B sends P (another question after it)  = cold if isolated
    own hit       B sends P again                                               B's own cache: a hit
    shared        A, then B, send prefix S with the same explicit cache_salt    the documented way to share

cold and cross-tenant alternate in order from trial to trial (this machine drifts); medians over the trials.
"""

import asyncio
import random
import statistics

import httpx

PREFIX_TOKENS = 1200
KEYS = {"keys": {"sk-tenant-a": {"tenant": "a"}, "sk-tenant-b": {"tenant": "b"}}}


def words_prefix(tokenizer, rng: random.Random, n_tokens: int) -> str:
    """Random dictionary-ish words, one at a time, until the text is n_tokens long (SmolLM2's tokenizer), give or
    take the last word's few tokens. Every prefix of a trial must be as long as the others: a prefill's time grows
    with its length, so a cross-tenant prefix 50 tokens longer than the cold one would look like a slower miss."""
    syllables = ["ka", "lo", "mi", "ter", "san", "vo", "ri", "pel", "du", "nax", "or", "bes"]
    words = []
    while len(tokenizer.encode(" ".join(words))) < n_tokens:
        words.append("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
    return " ".join(words) + " "


def ttft_ms(url: str, key: str, prompt: str, cache_salt: str | None = None) -> float:
    """One streamed completion of 1 token through the benchmark client; its TTFT in ms."""
    from nanoserve.bench.client import send
    from nanoserve.metrics import ttft

    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt

    async def one():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
            return await send(client, url, body)

    record, _ = asyncio.run(one())
    if not record.success:
        raise RuntimeError(f"request failed: {record.error}")
    return ttft(record.start, record.chunk_times) * 1000


def prefix_isolation(args, model, tokenizer):
    from nanoserve.bench.experiment import engine_for
    from nanoserve.server.limits import load_api_keys_dict
    from nanoserve.server.runner import serving

    rng = random.Random(32)
    trials = 3 * args.rounds
    a, b = "sk-tenant-a", "sk-tenant-b"
    rows = []
    engine = engine_for(model, tokenizer, num_blocks=512)
    with serving(engine, tokenizer, api_keys=load_api_keys_dict(KEYS)) as (url, _):
        ttft_ms(url, a, "Hello")  # warm-up: the first request's one-off costs are nobody's prefix
        for t in range(trials):
            prefix, cold_prefix, public = (words_prefix(tokenizer, rng, PREFIX_TOKENS) for _ in range(3))
            row = {}
            ttft_ms(url, a, prefix + "\nQuestion from A: what comes next?")  # A fills its cache with P
            order = ["cross-tenant", "cold"] if t % 2 == 0 else ["cold", "cross-tenant"]
            for kind in order:
                text = prefix if kind == "cross-tenant" else cold_prefix
                row[kind] = ttft_ms(url, b, text + "\nQuestion from B: what comes next?")
            row["own hit"] = ttft_ms(url, b, prefix + "\nAnother question from B: and then?")
            ttft_ms(url, a, public + "\nQuestion from A: what comes next?", f"public-{t}")
            row["shared"] = ttft_ms(url, b, public + "\nQuestion from B: what comes next?", f"public-{t}")
            rows.append(row)
            print("  trial " + str(t + 1) + ": " + ", ".join(f"{k} {v:.0f} ms" for k, v in row.items()), flush=True)
    kinds = ["cold", "cross-tenant", "own hit", "shared"]
    median = {k: statistics.median(r[k] for r in rows) for k in kinds}
    prompt_len = len(tokenizer.encode(prefix))
    print(f"tenant B's TTFT, SmolLM2 fp32, a {prompt_len}-token prefix, median of {trials} trials:")
    for k in kinds:
        print(f"  {k:13s} {median[k]:8.0f} ms   ({median[k] / median['cold']:.2f} x cold)")

    def figure(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(kinds, [median[k] for k in kinds], color=["tab:gray", "tab:red", "tab:green", "tab:blue"])
        ax.set(ylabel="median TTFT (ms)", title=f"tenant B's TTFT, a {prompt_len}-token prefix (SmolLM2)")
        return fig

    return {"prefix_tokens": prompt_len, "trials": rows, "median_ttft_ms": median}, figure
