"""`python -m nanoserve bench spec`: chapter 14's speculative decoding, measured side by side in one run.

Part 1, batch 1: each prompt alone through engines without speculation and with each proposer at each k,
greedy: on float32 weights and a float32 pool every engine must produce the same tokens and the run checks it;
elsewhere the `same` column counts the prompts whose output matches "off". The prompts are the course set's
"grounded" kind (rewrite / extract / repeat a given text: the answer copies its input) and its open
"chat" kind. Every engine is warmed up on a prompt of its own first; then engines take turns prompt by
prompt, the order reversed every other prompt (counted over both kinds, so that with --prompts 1 the grounded
prompt runs in one order and the chat prompt in the other), so the machine's drift hits all of them alike.

Per engine: output tokens per second of wall time and the speedup over no speculation; the two numbers the
chapter's model needs, measured:
  α       the chance that a proposed token is accepted given the ones before it were (SpecDecodeStats.alpha)
  r_k     the step-cost ratio: the median wall time of a batch-1 step that verified k proposals (drafting
          included) over the median of a plain decode step of the "off" engine, in the same run;
          c = (r_k - 1) / k, the cost of one more verified token as a fraction of a decode step
and the model's predictions next to what was measured: E = (1 - α^(k+1)) / (1 - α) against the mean
accepted length, E / r_k the speedup of the decode steps, and the k that maximises E(α, k) / (1 + k·c) ("off":
k = 0, no speculation, S = 1, beats every k).

Part 2, load: 1, 4, 16 grounded requests at once through the engine, without speculation and with n-gram
at --load-k (the batch-size policy switched off, to see where speculation itself stops paying), both warmed
up first, over --rounds interleaved rounds (the order reversed from one round or N to the next), each system's
best round kept (bench experiment's harness).

--weights, --kv-cache-dtype and --native-decode load the model the way `serve` would (its default is q4 weights on
a bf16 pool, one-token steps in kernels/cpu_decode.c: chapter 09's native step), through LLM, which refuses what
it cannot honour. Every engine of the run shares that model, so the "off" engine's plain steps and the
speculative engines' steps that verify nothing (no n-gram match) take the same path; a step verifying k
proposals (k + 1 query tokens) always runs the model's forward.
"""

import statistics
import time
from collections import defaultdict

import torch

from nanoserve.bench.experiment import interleaved
from nanoserve.cli.checks import AUTO_ON_OFF, UsageError, positive_int, weight_format


def register(sub):
    p = sub.add_parser("spec", help="speculative decoding: α, step cost and tok/s at batch 1 and under load (chapter 14)")
    p.add_argument("--prompts", type=positive_int, default=3, help="prompts of each kind (grounded, chat) at batch 1")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="greedy output tokens per request (at most)")
    p.add_argument("-k", type=positive_int, nargs="+", default=[2, 4, 8], help="num_speculative_tokens to try")
    p.add_argument("--proposers", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"])
    p.add_argument("--draft-layers", type=positive_int, default=None, help="the draft's layers (default: a quarter)")
    p.add_argument("--load", type=positive_int, nargs="*", default=[1, 4, 16],
                   help="concurrent requests in part 2 (none: skip)")
    p.add_argument("--load-k", type=positive_int, default=4, help="n-gram's k in part 2")
    p.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds of part 2 (the best is kept)")
    p.add_argument("--seed", type=int, default=0, help="of the prompts (bench/prompts.py course_prompts)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: the cores; on a busy machine use 1, as bench weights --help says)")
    p.add_argument("--weights", default="fp32", type=weight_format,
                   help="fp32 (default, the chapter's reference), bf16, int8 or q4 (serve's default; chapter 10)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "fp8"],
                   help="the KV pool's dtype (auto: float32; serve's default with q4 is bf16)")
    p.add_argument("--native-decode", default="auto", choices=list(AUTO_ON_OFF),
                   help="q4: one-token steps (every plain step, and a speculative step that verifies nothing) in "
                        "kernels/cpu_decode.c (chapter 09) or the model's forward; auto: native where it can run; "
                        "on: refused where it cannot")
    p.set_defaults(func=run)


def check_args(args) -> None:
    """A UsageError for what LLM would refuse (--native-decode on where the native step cannot run), before the
    model loads; what LLM and serve accept (--native-decode off on any weights: the forward runs) is accepted."""
    from nanoserve.kernels.cpu_decode import native_decode_blocker

    reason = native_decode_blocker(args.weights, None, 1, False, args.kv_cache_dtype)
    if args.native_decode == "on" and reason:
        raise UsageError(f"--native-decode on: {reason}")


def generate(engine, prompts: list[list[int]], max_tokens: int, steps: dict | None = None):
    """Every prompt at once, greedy; (outputs in order, wall seconds). steps: {query tokens: [seconds]} gets the
    wall time of every step that ran one decoding sequence alone (1 query token, or 1 + k when verifying)."""
    from nanoserve.sampling import SamplingParams

    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    outputs = {}
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        step_outputs = engine.step()
        seconds, out = time.perf_counter() - before, engine.last_scheduler_output
        for o in step_outputs:
            if o.finished:
                outputs[int(o.request_id)] = o.token_ids
        if steps is not None and len(out.scheduled_seqs) == 1 and out.scheduled_seqs[0].num_output_tokens > 1:
            steps[out.num_scheduled_tokens[out.scheduled_seqs[0].seq_id]].append(seconds)  # a decode or a verify
    return [outputs[i] for i in range(len(prompts))], time.perf_counter() - t0


def warm_up(engines, tokenizer, seed: int) -> None:
    """8 tokens of a prompt of its own through each engine: its first steps pay one-time costs (allocations,
    first touches of the weights) that are not what the run measures."""
    from nanoserve.bench.prompts import course_prompts

    warmup = tokenizer.encode_chat(course_prompts(1, seed + 100, ["grounded"])[0]["messages"])
    for e in engines:
        generate(e, [warmup], 8)


def expected_length(alpha: float, k: int) -> float:
    """E = 1 + α + α² + … + α^k = (1 - α^(k+1)) / (1 - α): tokens a verifying step emits, if each proposed
    token is accepted with chance α given the ones before it were."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def best_k(alpha: float, c: float, k_max: int = 16) -> int:
    """The k that maximises the modelled speedup E(α, k) / (1 + k·c); 0 (no speculation: S = 1) when no k
    beats it, e.g. best_k(0.0, 0.39) = 0: nothing is ever accepted, every verified row is pure cost."""
    return max(range(k_max + 1), key=lambda k: expected_length(alpha, k) / (1 + k * c))


class Measured:
    """One engine's totals over the run."""

    def __init__(self, engine, k: int = 0):
        self.engine, self.k, self.tokens, self.seconds = engine, k, 0, 0.0
        self.steps: dict[int, list[float]] = defaultdict(list)  # query tokens -> step seconds
        self.same, self.runs = 0, 0  # outputs identical to the "off" engine's, of all

    def add(self, outputs, seconds, same: bool = True):
        self.tokens += sum(map(len, outputs))
        self.seconds += seconds
        self.same, self.runs = self.same + same, self.runs + 1

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def step_cost(self, base: "Measured") -> float | None:
        """r_k: the median step that verified all k proposals over the median plain decode step of `base`."""
        full, plain = self.steps.get(self.k + 1), base.steps.get(1)
        return statistics.median(full) / statistics.median(plain) if full and plain else None

    def row(self, name: str, base: "Measured") -> str:
        s, r = self.engine.spec_stats, self.step_cost(base)
        head = f"  {name:<12} {f'{self.same}/{self.runs}':>5} {self.tok_s:7.2f} {self.tok_s / base.tok_s:7.2f}x"
        if not s.num_drafts or r is None:
            return head
        c, e_model = (r - 1) / self.k, expected_length(s.alpha, self.k)
        best = best_k(s.alpha, max(c, 1e-3)) or "off"
        return (head + f" {s.alpha:6.2f} {s.mean_accepted_length:6.2f} {e_model:7.2f} {r:6.2f} {c:6.2f}"
                f" {s.mean_accepted_length / r:8.2f}x {best:>6}")


HEADER = (f"  {'engine':<12} {'same':>5} {'tok/s':>7} {'speedup':>8} {'α':>6} {'E meas':>6} {'E(α,k)':>7} {'r_k':>6} {'c':>6}"
          f" {'E/r_k':>9} {'best k':>6}")


@torch.inference_mode()
def run(args):
    from nanoserve.bench.prompts import course_prompts
    from nanoserve.engine.config import CacheConfig, EngineConfig, SpeculativeConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.llm import LLM

    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    # the model as LLM loads it (weights, and whether its one-token steps run natively); every engine below shares it
    loaded = LLM(weights=args.weights, kv_cache_dtype=args.kv_cache_dtype, native_decode=AUTO_ON_OFF[args.native_decode],
                 num_blocks=1)
    model, tokenizer = loaded.model, loaded.tokenizer

    def engine(speculative=None, k=4):
        spec = (SpeculativeConfig(method=speculative, num_speculative_tokens=k, disable_by_batch_size=None,
                                  draft_num_layers=args.draft_layers) if speculative else None)
        config = EngineConfig(cache_config=CacheConfig(kv_cache_memory=256 << 20, kv_cache_dtype=args.kv_cache_dtype),
                              speculative_config=spec)
        return LLMEngine(model, config, tokenizer)

    configs = {"off": (engine(), 0)} | {f"{p} k={k}": (engine(p, k), k) for p in args.proposers for k in args.k}
    draft = next((e.proposer for e, _ in configs.values() if getattr(e.proposer, "num_layers", None)), None)
    print(f"batch 1, greedy, up to {args.max_tokens} tokens, {torch.get_num_threads()} thread(s); {args.weights} weights, "
          f"{args.kv_cache_dtype} KV pool, one-token steps in "
          + ("kernels/cpu_decode.c" if getattr(model, "native_decode", False) else "the model's forward")
          + (f"; the draft: {draft.num_layers} of {model.config.num_hidden_layers} layers" if draft else ""))
    warm_up([e for e, _ in configs.values()], tokenizer, args.seed)
    # float32 weights on a float32 pool: speculation must reproduce "off" token for token (the chapter's parity tests
    # hold it to that). Elsewhere a step verifying k proposals is rounded unlike a one-token step (the native step's
    # own arithmetic, the bf16 pool's attention over k + 1 rows), so greedy outputs can part at a near-tie: counted
    exact = args.weights == "fp32" and args.kv_cache_dtype in ("auto", "fp32")
    turn = 0
    for kind in ("grounded", "chat"):
        prompts = [tokenizer.encode_chat(p["messages"]) for p in course_prompts(args.prompts, args.seed, [kind])]
        totals = {name: Measured(e, k) for name, (e, k) in configs.items()}
        for e, _ in configs.values():
            e.spec_stats.__init__()
        for i, ids in enumerate(prompts):
            turn += 1  # alternate who goes first, counting over both kinds
            names = list(configs) if turn % 2 else list(configs)[::-1]
            outs = {name: generate(configs[name][0], [ids], args.max_tokens, totals[name].steps) for name in names}
            for name, (out, seconds) in outs.items():
                totals[name].add(out, seconds, same=out == outs["off"][0])
                if exact and out != outs["off"][0]:
                    raise RuntimeError(f"{kind} prompt {i}: {name}'s greedy output differs from 'off'")
        print(f"\n{kind} prompts ({len(prompts)}):\n{HEADER}")
        for name, m in totals.items():
            print(m.row(name, totals["off"]))
    if args.load:
        load_table(args, engine, tokenizer, course_prompts)
    print("\nsame: outputs identical to 'off' (greedy), of the prompts; α: accepted / tested proposals; E meas: tokens a verifying step emitted; E(α,k) = (1 - α^(k+1)) / (1 - α);"
          "\nr_k: a step verifying k proposals / a plain decode step (medians, this run); c = (r_k - 1) / k;"
          "\nE/r_k: the modelled speedup of the decode steps; best k: argmax E(α,k) / (1 + k·c), off: k = 0."
          "\nshared machine: compare the ratios of one run, not tok/s across runs. Reproduce:\n"
          f"  python -m nanoserve bench spec --prompts {args.prompts} --max-tokens {args.max_tokens} "
          f"-k {' '.join(map(str, args.k))} --proposers {' '.join(args.proposers)} "
          f"--load {' '.join(map(str, args.load))} --rounds {args.rounds} --weights {args.weights} "
          f"--kv-cache-dtype {args.kv_cache_dtype} --native-decode {args.native_decode}"
          + (f" --threads {args.threads}" if args.threads else ""))
    return 0


def load_table(args, engine, tokenizer, course_prompts) -> None:
    """Part 2: N grounded requests at once, off vs n-gram, interleaved rounds, each system's best round."""
    systems = {"off": engine(), f"ngram k={args.load_k}": engine("ngram", args.load_k)}
    prompts = [tokenizer.encode_chat(p["messages"]) for p in course_prompts(max(args.load), args.seed + 1, ["grounded"])]
    warm_up(list(systems.values()), tokenizer, args.seed)
    print(f"\nload: N grounded requests at once, n-gram k={args.load_k} without the batch-size policy, "
          f"best of {args.rounds} interleaved round(s)\n"
          f"  {'N':>3} {'off tok/s':>10} {'ngram tok/s':>12} {'speedup':>8} {'α':>6}")
    for j, n in enumerate(args.load):
        def measure(name, e, r):
            e.spec_stats.__init__()
            outputs, seconds = generate(e, prompts[:n], args.max_tokens)
            return sum(map(len, outputs)) / seconds, e.spec_stats.alpha

        results = {name: [] for name in systems}
        for r in range(args.rounds):  # one round at a time, the order reversed from one round (or N) to the next
            for name, got in interleaved(1, dict(list(systems.items())[::1 if (j + r) % 2 == 0 else -1]), measure, first=r).items():
                results[name] += got
        (off, _), (spec, alpha) = (max(runs) for runs in results.values())
        print(f"  {n:>3} {off:10.2f} {spec:12.2f} {spec / off:7.2f}x {alpha:6.2f}")
