"""`python -m nanoserve bench tp`: tensor parallelism measured here, and modelled on real GPUs (chapter 11).

  1. Measured on this CPU machine: the decode step time of a batch at TP 1, 2, 3 (rounds interleaved,
     each TP size a fresh group), rank 0's time inside all_reduce (waiting for the slowest rank
     included) and the bytes all-reduced per layer per token. The model is SmolLM2-135M-sized with
     12 query / 6 KV heads and random weights, because SmolLM2's own 9 heads do not split 2 ways
     (`--real` measures the real SmolLM2 at TP 1 and 3). With every rank on the same core (`taskset -c 0`)
     the arithmetic is the same at every TP size and the all-reduces come on top (chapter 11, section 5).
  2. Modelled: nanoserve.distributed.cost_model for Llama-3-8B / 70B at TP 1, 2, 4, 8 on H100s with
     NVLink or PCIe; `--plot FILE` draws the step times.
"""

import statistics
import time

import torch

from nanoserve.cli.checks import UsageError, positive_int
from nanoserve.distributed.cost_model import H100_NVLINK, H100_PCIE, tp_decode_step
from nanoserve.model.config import LlamaConfig
from nanoserve.model.known_configs import KNOWN_CONFIGS

BLOCK_SIZE = 16
# the measurement's flags and their defaults (None: the default depends on --real, or is torch's thread count);
# they default to None on the command line so that --model-only can refuse them when given
MEASURED = {"sizes": None, "batch": 8, "prompt_len": 64, "steps": 8, "rounds": 2, "threads": None}


def register(sub):
    p = sub.add_parser("tp", help="ch11: step time and all_reduce share at TP 1/2/3 here; a model of TP on GPUs")
    p.add_argument("--sizes", type=positive_int, nargs="+",
                   help="the TP sizes to measure, each one that splits the model's heads and MLP (default: 1 2 3; "
                        "with --real 1 3)")
    p.add_argument("--batch", type=positive_int, help="sequences decoding together (default: 8)")
    p.add_argument("--prompt-len", type=positive_int, help="tokens of each random prompt (default: 64)")
    p.add_argument("--steps", type=positive_int, help="decode steps timed per round (default: 8)")
    p.add_argument("--rounds", type=positive_int, help="rounds, the order of the TP sizes reversed in every other "
                                                       "(default: 2)")
    p.add_argument("--threads", type=positive_int,
                   help="torch threads in all, split over the ranks (at least 1 each); 1 gives every rank, at every "
                        f"TP size, one thread (chapter 11, section 5) (default: torch's, {torch.get_num_threads()} here)")
    p.add_argument("--real", action="store_true",
                   help="the real SmolLM2: its 9 query heads and 1536 MLP features split 1 or 3 ways")
    p.add_argument("--model-only", action="store_true", help="skip the measurement, print the GPU model")
    p.add_argument("--context", type=positive_int, default=4096, help="GPU model: tokens of context per sequence")
    p.add_argument("--plot", help="GPU model: write a PNG of step time vs TP here")
    p.set_defaults(func=run)


def smollm2_sized() -> LlamaConfig:
    return LlamaConfig(num_attention_heads=12, num_key_value_heads=6)  # head_dim 48; 576 hidden, 30 layers


def check_measured(args) -> LlamaConfig | None:
    """Fill in the measurement's defaults and refuse what it cannot honour (UsageError: one `error:` line, exit 2);
    the config measured, or None under --model-only."""
    from nanoserve.distributed.shard import check_tp_size

    given = [f"--{name.replace('_', '-')}" for name in MEASURED if getattr(args, name) is not None]
    if args.model_only:
        if given or args.real:
            raise UsageError(f"--model-only skips the measurement: drop {', '.join(given + ['--real'] * args.real)}")
        return None
    for name, default in MEASURED.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.sizes = args.sizes or ([1, 3] if args.real else [1, 2, 3])
    args.threads = args.threads or torch.get_num_threads()
    config = LlamaConfig() if args.real else smollm2_sized()
    for n in args.sizes:
        try:
            check_tp_size(config, n)
        except ValueError as e:
            raise UsageError(f"--sizes {n}: {e}") from None
    if len(set(args.sizes)) != len(args.sizes):
        raise UsageError(f"--sizes {' '.join(map(str, args.sizes))}: each size once")
    length = args.prompt_len + args.steps + 2  # the prompt, a first token (prefill) and one untimed decode, the steps
    if length > config.max_position_embeddings:
        raise UsageError(f"--prompt-len {args.prompt_len} + --steps {args.steps} + 2 = {length} tokens exceed the "
                         f"model's context of {config.max_position_embeddings}")
    return config


def measure(model, tp: int, batch: int, prompt_len: int, steps: int) -> dict:
    from nanoserve.llm import LLM
    from nanoserve.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    vocab = (model.config if model is not None else LlamaConfig()).vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    # every TP size gets the same pool, which holds every sequence whole: nothing preempts; and a step's token budget
    # that holds every prompt, so the prefill is one step and the timed steps are pure decode
    blocks = batch * -(-(prompt_len + steps + 2) // BLOCK_SIZE)
    with LLM(model, tensor_parallel_size=tp, block_size=BLOCK_SIZE, num_blocks=blocks, max_num_seqs=batch,
             max_num_batched_tokens=max(2048, batch * prompt_len)) as llm:
        group = llm.engine.executor.tp_group
        for _ in range(batch):
            llm.add_request({"prompt_token_ids": torch.randint(0, vocab, (prompt_len,), generator=g).tolist()}, params)
        llm.engine.step()  # the prefill of all prompts
        llm.engine.step()  # a first decode, untimed
        times, reduce_times = [], []
        for _ in range(steps):
            group.all_reduce_seconds, group.all_reduce_bytes, group.num_all_reduces = 0.0, 0, 0
            t = time.perf_counter()
            llm.engine.step()
            times.append(time.perf_counter() - t)
            reduce_times.append(group.all_reduce_seconds)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return {"step": statistics.median(times), "all_reduce": statistics.median(reduce_times),
            "bytes": group.all_reduce_bytes, "calls": group.num_all_reduces}  # of the last timed step


def run_measured(args, config: LlamaConfig) -> None:
    from nanoserve.model import Llama

    if args.real:
        model, label = None, "SmolLM2-135M (real weights)"
    else:
        torch.manual_seed(0)
        model, label = Llama(config).eval(), "SmolLM2-sized, 12 / 6 heads, random weights"
    sizes = args.sizes
    torch.set_num_threads(args.threads)  # start_workers gives each of n ranks max(1, threads // n)
    print(f"measured: {label}; a decode step of {args.batch} sequences after {args.prompt_len}-token prompts; "
          f"torch threads per rank at TP n: max(1, {args.threads} // n); {args.rounds} rounds, each TP size in turn, "
          f"the order reversed every other round (medians over the rounds)")
    results = {n: [] for n in sizes}
    for r in range(args.rounds):
        for n in sizes if r % 2 == 0 else sizes[::-1]:  # no size always first (cold) or last
            results[n].append(measure(model, n, args.batch, args.prompt_len, args.steps))
    base = statistics.median(m["step"] for m in results[sizes[0]])
    per_layer_token = 2 * config.hidden_size * 4  # two all-reduces of one fp32 hidden vector
    print(f"{'TP':>3} {'step ms':>9} {'time/TP' + str(sizes[0]):>9} {'all_reduce ms':>14} {'share':>6} "
          f"{'all_reduces/step':>17} {'bytes/step':>11}")
    for n in sizes:
        step = statistics.median(m["step"] for m in results[n])
        ar = statistics.median(m["all_reduce"] for m in results[n])
        last = results[n][-1]
        print(f"{n:>3} {step * 1e3:>9.1f} {step / base:>8.2f}x {ar * 1e3:>14.1f} {ar / step:>6.0%} "
              f"{last['calls']:>17} {last['bytes']:>11,}")
    print(f"all-reduced per layer per token: 2 x hidden {config.hidden_size} x 4 B = {per_layer_token:,} B "
          f"(+ one for the embedding per step; rank 0 also receives (n - 1)/n of the {config.vocab_size:,} x 4 B of "
          f"logits of each sequence)")


def run_model(args) -> list:
    rows = []
    print(f"\nmodelled: one decode step on H100s, bf16, context {args.context} tokens per sequence "
          f"(nanoserve/distributed/cost_model.py; link latency per ring hop assumed: NVLink "
          f"{H100_NVLINK.link_latency_s * 1e6:g} us, PCIe {H100_PCIE.link_latency_s * 1e6:g} us)")
    print(f"{'model':>12} {'B':>3} {'TP':>3} {'read/GPU':>12} {'KV/GPU':>8} {'memory ms':>10} {'compute ms':>11} "
          f"{'AR NVLink ms':>13} {'AR PCIe ms':>11} {'step NVLink':>12} {'step PCIe':>10} {'fits 80GB':>9}")
    for name in ("llama-3-8b", "llama-3-70b"):
        for batch in (1, 64):
            for tp in (1, 2, 4, 8):
                nv, pc = (tp_decode_step(KNOWN_CONFIGS[name], tp, batch, args.context, hw) for hw in (H100_NVLINK, H100_PCIE))
                rows.append((name, batch, tp, nv, pc))
                print(f"{name:>12} {batch:>3} {tp:>3} {nv.weight_bytes / 1e9:>10.2f}GB {nv.kv_bytes / 1e9:>6.2f}GB "
                      f"{nv.memory_s * 1e3:>10.2f} {nv.compute_s * 1e3:>11.3f} {nv.all_reduce_s * 1e3:>13.2f} "
                      f"{pc.all_reduce_s * 1e3:>11.2f} {nv.step_s * 1e3:>10.2f}ms {pc.step_s * 1e3:>8.2f}ms "
                      f"{'yes' if nv.fits else 'no':>9}")
    return rows


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, name in zip(axes, ("llama-3-8b", "llama-3-70b")):
        for batch, style in ((1, ":"), (64, "-")):
            sel = [r for r in rows if r[0] == name and r[1] == batch]
            tps = [r[2] for r in sel]
            ax.plot(tps, [r[3].step_s * 1e3 for r in sel], "o" + style, color="C0", label=f"NVLink, B={batch}")
            ax.plot(tps, [r[4].step_s * 1e3 for r in sel], "s" + style, color="C3", label=f"PCIe, B={batch}")
            ax.plot(tps, [max(r[3].memory_s, r[3].compute_s) * 1e3 for r in sel], style, color="gray", lw=1,
                    label=f"no all-reduce, B={batch}")
            # a configuration whose weights + KV do not fit in one GPU's 80 GB is modelled, not possible: crossed
            over = [r for r in sel if not r[3].fits]
            ax.plot([r[2] for r in over for _ in (3, 4)], [r[i].step_s * 1e3 for r in over for i in (3, 4)], "x",
                    color="black", ms=10, label="does not fit in 80 GB" if batch == 64 and over else None)
        ax.set(title=f"{name}: one decode step", xlabel="tensor-parallel size", ylabel="ms", xscale="log",
               yscale="log", xticks=[1, 2, 4, 8], xticklabels=["1", "2", "4", "8"])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 60, not 6 x 10^1
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def run(args):
    config = check_measured(args)
    cmd = "python -m nanoserve bench tp" + (" --real" if args.real else "")
    if config is None:
        print(f"command: {cmd} --model-only --context {args.context}")
    else:
        print(f"command: {cmd} --sizes {' '.join(map(str, args.sizes))} --batch {args.batch} --prompt-len "
              f"{args.prompt_len} --steps {args.steps} --rounds {args.rounds} --threads {args.threads} --context "
              f"{args.context}")
        run_measured(args, config)
    rows = run_model(args)
    if args.plot:
        plot(rows, args.plot)
    return 0
