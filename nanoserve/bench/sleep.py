"""Chapter 19's sleep-mode measurement, run through `python -m nanoserve bench experiment sleep` (experiment.py's
harness).

  sleep   SmolLM2 served in this process (an admin key on), once per --weights format as `serve` serves it (q4
          weights on a bf16 KV pool, fp32 on float32): a greedy request, then for level 1 and level 2 in turn
          POST /sleep?level=L, POST /wake_up and the same request again. Per level: the process' resident set
          (VmRSS) awake, asleep and after wake; the bytes the engine released, counted from its tensors (weights,
          KV pool); the wake time (the /wake_up call, end to end); whether the text after wake is the text before.

Before each "awake" reading the freed heap goes back to the OS (malloc_trim, as the sleep itself does), so that
the drop is the sleep's own and not the model load's leftover temporaries. Read the drop and the wake time: the
absolute figures of a format measured later also hold what earlier ones left in this process.
"""

import argparse
import time

ADMIN_KEY = "bench-admin"
PROMPT = "The capital of France is"


def sleep_cycles(engine, tokenizer, max_tokens: int = 16, prompt: str | list[int] = PROMPT) -> dict:
    """Serve `engine` (an LLMEngine) over HTTP in this process; sleep and wake it at each level, `prompt` (text or
    token ids) completed greedily before and after. {level: row}."""
    import httpx

    from nanoserve.bench.bluegreen import rss_mib
    from nanoserve.engine.worker import release_memory
    from nanoserve.server.runner import serving

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    rows = {}
    with serving(engine, tokenizer, admin_key=ADMIN_KEY) as (url, _), httpx.Client(base_url=url, timeout=600) as http:
        del engine  # the server holds the only reference

        def complete() -> str:
            r = http.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        text = complete()
        for level in (1, 2):
            release_memory()
            awake = rss_mib()
            slept = http.post("/sleep", params={"level": level}, headers=admin)
            slept.raise_for_status()
            asleep = rss_mib()
            start = time.perf_counter()
            woke = http.post("/wake_up", headers=admin)
            wake_s = time.perf_counter() - start
            woke.raise_for_status()
            after = rss_mib()
            released = slept.json()["released_bytes"]
            rows[level] = {"rss_awake_mib": awake, "rss_asleep_mib": asleep, "rss_after_wake_mib": after,
                           "released_weights_mib": released["weights"] / 2**20,
                           "released_kv_cache_mib": released["kv_cache"] / 2**20,
                           "wake_s": wake_s, "engine_wake_s": woke.json()["wake_s"], "same_text": complete() == text}
    return rows


def served_kv_dtype(weights: str) -> str:
    """The KV pool's dtype `serve --weights WEIGHTS` pairs with these weights (serving_format, on serve's own
    defaults for every other flag): the model's ("auto") for any explicit --weights (serve's bf16 pool comes with
    q4 only where no --weights is given)."""
    from nanoserve.cli import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    flags = parser.parse_args(["serve", "--weights", weights])
    serve.serving_format(flags)
    return flags.kv_cache_dtype


def sleep_mode(args, model, tokenizer) -> dict:
    from nanoserve.bench.experiment import interleaved
    from nanoserve.engine.worker import release_memory
    from nanoserve.llm import LLM

    formats, kv_mib = args.weights or ["fp32", "q4"], args.kv_cache_mib or 1024

    def measure(weights, _, r):
        llm = LLM(weights=weights, kv_cache_memory=kv_mib << 20, kv_cache_dtype=served_kv_dtype(weights),
                  tokenizer=tokenizer)
        engine, llm = llm.engine, None
        rows = sleep_cycles(engine, tokenizer)
        del engine
        release_memory()
        return rows

    results = interleaved(args.rounds, {w: w for w in formats}, measure)
    # per format and level, the round whose wake was quickest (this machine drifts; memory figures are steady)
    best = {w: {level: min((run[level] for run in runs), key=lambda x: x["wake_s"]) for level in (1, 2)}
            for w, runs in results.items()}
    print(f"KV pool {kv_mib} MiB; resident set (VmRSS) in MiB; released: counted from the engine's tensors")
    print(f"{'weights':8s} {'level':>5s} {'awake':>7s} {'asleep':>7s} {'woken':>7s} {'drop':>7s} {'weights':>8s} "
          f"{'KV pool':>8s} {'wake s':>7s}  same text")
    for w, levels in best.items():
        for level, x in levels.items():
            print(f"{w:8s} {level:5d} {x['rss_awake_mib']:7.0f} {x['rss_asleep_mib']:7.0f} {x['rss_after_wake_mib']:7.0f} "
                  f"{x['rss_awake_mib'] - x['rss_asleep_mib']:7.0f} {x['released_weights_mib']:8.1f} "
                  f"{x['released_kv_cache_mib']:8.1f} {x['wake_s']:7.2f}  {x['same_text']}")

    def figure(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        names = [f"{w} L{level}" for w in best for level in best[w]]
        rows = [x for levels in best.values() for x in levels.values()]
        for k, (key, label) in enumerate((("rss_awake_mib", "awake"), ("rss_asleep_mib", "asleep"),
                                          ("rss_after_wake_mib", "after wake"))):
            a.bar([i + 0.27 * k for i in range(len(rows))], [x[key] for x in rows], 0.27, label=label)
        a.set_xticks([i + 0.27 for i in range(len(rows))], names)
        a.set(ylabel="resident set (MiB)", title="memory awake, asleep, after wake"), a.legend()
        b.bar(names, [x["wake_s"] for x in rows])
        b.set(ylabel="seconds", title="POST /wake_up, end to end")
        return fig

    return {"results": results, "best": best, "kv_cache_mib": kv_mib}, figure
