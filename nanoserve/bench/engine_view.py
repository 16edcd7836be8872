"""`python -m nanoserve bench engine-view`: what the live page (chapter 12) costs the engine, side by side.

One seeded workload (random prompt ids, EOS ignored) through the same engine three ways, interleaved
round by round in rotating order so the machine's drift hits all three alike. One warm-up run of the whole
workload comes before all the rounds, so every measured run finds the prompts' full blocks in the prefix cache
(mostly decode steps, short ones: the worst case for the feed's share) and none is the cold first run:

  no feed     the bare loop: step(), step(), ...                       (the engine before chapter 12)
  page closed the loop AsyncLLMEngine runs: each step timed and handed to EventFeed.record, nobody subscribed
              (the feed keeps each step's record for the next viewer, and builds nothing else)
  page open   the same with one viewer that takes every snapshot and JSON-encodes it, as /engine/events does

Reported: output tokens/s of each (best of --rounds) and its ratio to "no feed"; and, timed directly (on a
shared machine the tokens/s of whole runs wander by more than the feed costs), the time spent inside the feed:
per step with the page closed, per snapshot (built and encoded, with the records of the steps it covers) with it
open, and as a share of the run.
"""

import json
import statistics
import sys
import time

import torch

from nanoserve.bench.offline import make_workload, params
from nanoserve.cli.checks import UsageError, add_pool_size_args, context_length, positive_int


def register(sub):
    p = sub.add_parser("engine-view", help="the engine event feed's cost: page closed vs open vs no feed (chapter 12)")
    p.add_argument("--num-requests", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=positive_int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="default 16 48; 300 400 with --tiny, whose steps are so short that a whole run of 16-48 "
                        "tokens is over in a few snapshots")
    p.add_argument("--rounds", type=positive_int, default=3, help="each system runs the workload this many times, interleaved")
    add_pool_size_args(p)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random-weight model instead of SmolLM2: the shortest steps, the worst case for the feed's share")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.set_defaults(func=run)


def run_once(engine, workload, feed=None, viewer=None) -> tuple[float, int, list[float], int, int]:
    """(seconds, output tokens, seconds inside the feed at each step, snapshots encoded, steps) for the whole
    workload."""
    for i, (prompt, n) in enumerate(workload):
        engine.add_request(str(i), prompt, params(n))
    tokens, in_feed, encoded, steps = 0, [], 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if feed is None:
            outputs = engine.step()
        else:
            s0 = time.perf_counter()
            outputs = engine.step()
            f0 = time.perf_counter()
            feed.record(engine, engine.last_scheduler_output, outputs, f0 - s0)
            if viewer is not None and (snap := viewer.take()) is not None:
                json.dumps(snap, separators=(",", ":"))
                encoded += 1
            in_feed.append(time.perf_counter() - f0)
        tokens += sum(len(o.new_token_ids) for o in outputs)
        steps += 1
    return time.perf_counter() - t0, tokens, in_feed, encoded, steps


@torch.inference_mode()
def check_args(args) -> None:
    """What the flags' types cannot see, refused before the model loads: a range upside down, or a workload longer
    than the model's context (the tiny model's 512 positions, SmolLM2's 8192)."""
    from nanoserve.model import LlamaConfig

    args.output_len = output_len = args.output_len or ([300, 400] if args.tiny else [16, 48])  # the default, once
    for flag, (low, high) in (("--prompt-len", args.prompt_len), ("--output-len", output_len)):
        if low > high:
            raise UsageError(f"{flag} {low} {high}: MIN is larger than MAX")
    context = LlamaConfig.tiny().max_position_embeddings if args.tiny else context_length(None)
    if args.prompt_len[1] + output_len[1] > context:
        raise UsageError(f"--prompt-len up to {args.prompt_len[1]} and --output-len up to {output_len[1]} exceed the "
                         f"{'tiny ' if args.tiny else ''}model's context of {context} tokens")


def run(args):
    from nanoserve.engine.event_feed import EventFeed
    from nanoserve.engine.config import CacheConfig, EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.memory import kv_bytes_per_token
    from nanoserve.model import Llama, LlamaConfig, load_gguf

    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    num_blocks = args.num_blocks
    if args.tiny:
        torch.manual_seed(0)
        model = Llama(LlamaConfig.tiny()).eval()  # 512 positions: a 96-token prompt and 400 tokens fit
        # the pool SmolLM2 would get from the same bytes: the snapshot's size depends on the number of blocks
        num_blocks = num_blocks or int((args.kv_cache_mib << 20) // (kv_bytes_per_token(LlamaConfig(), "fp32")
                                                                     * args.block_size))
    else:
        model = load_gguf()
    config = EngineConfig(cache_config=CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                                                   kv_cache_memory=args.kv_cache_mib << 20))
    engine = LLMEngine(model, config)
    workload = make_workload(args.num_requests, args.prompt_len, args.output_len, 0, model.config.vocab_size)
    closed, open_feed = EventFeed(), EventFeed()
    viewer = open_feed.subscribe()
    systems = {"no feed": {}, "page closed": {"feed": closed}, "page open": {"feed": open_feed, "viewer": viewer}}
    best = {name: None for name in systems}
    names = list(systems)
    # warm-up: the whole workload once, so that every measured run finds the same prefix cache (its prompts' full
    # blocks cached by the run before), the first one included: none is a cold run
    run_once(engine, workload)
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:  # rotate the order: none always goes first
            result = run_once(engine, workload, **systems[name])
            print(f"  round {r + 1} {name:12s} {result[1] / result[0]:9.1f} tok/s", flush=True)
            if best[name] is None or result[0] < best[name][0]:
                best[name] = result
    which = "a tiny random model" if args.tiny else "SmolLM2-135M"
    print(f"{args.num_requests} requests on {which}, {engine.block_manager.num_blocks} KV blocks, "
          f"best of {args.rounds} interleaved rounds (torch threads: {torch.get_num_threads()})")
    base = best["no feed"][1] / best["no feed"][0]
    for name, (seconds, tokens, per_step, encoded, steps) in best.items():
        line = (f"  {name:12s} {tokens / seconds:9.1f} tok/s   x{tokens / seconds / base:.3f} of no feed   "
                f"{1000 * seconds / steps:.1f} ms per step")
        in_feed = sum(per_step)
        # the feed's median time over the steps: a mean also charges it with whatever else ran then (the collector,
        # another process)
        median = f"median over the steps {1e6 * statistics.median(per_step):.1f} µs" if per_step else ""
        if name == "page closed":
            line += (f"   {1e6 * in_feed / steps:.2f} µs per step in the feed ({median}), "
                     f"{100 * in_feed / seconds:.4f} % of the run")
        if name == "page open":
            line += (f"   {encoded} snapshots, {1000 * in_feed / max(encoded, 1):.2f} ms of feed each "
                     f"(its steps' records included; {median}), {100 * in_feed / seconds:.2f} % of the run")
        print(line)
    print("reproduce: python -m nanoserve " + " ".join(sys.argv[1:]))
    return 0
