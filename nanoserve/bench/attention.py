"""`python -m nanoserve bench attention`: the Triton paged attention kernel vs the torch paged path vs SDPA.

On a CUDA device — decode steps (one query per sequence) over batch x context, SmolLM2's heads
(9 query / 3 kv heads, head_dim 64), block size 16, block tables dealt from a shuffled pool:

  triton   nanoserve.kernels.triton_paged_attention: walks the block table, reads K/V in place
  torch    chapter 05's paged path: index_select the blocks into a padded batch, then SDPA
  sdpa     F.scaled_dot_product_attention on contiguous (B, Hkv, S, D) K/V: no paging at all

Achieved bandwidth = bytes that must move (every sequence's K and V, the queries, the output) / kernel
time, against the device's peak (a table below, or --peak-gbs). The systems are timed alternately, each
with triton.testing.do_bench (the L2 cache flushed before every run), in 3 rounds, the second in the
reverse order; each system keeps its fastest round (do_bench's median of the round). Before the table, one
mixed step (decodes, a whole prompt, chunks on cached prefixes) checks both paged paths on the GPU against
chapter 05's path in float32 on the CPU — the kernel under each launch configuration of a sweep (below), one
error each, so that a swept configuration (split-KV's included) is checked on prompts and chunks, not only on
the sweep's decodes.

The kernel's launch parameters — --tile, --block-m, --num-warps, --num-stages, --partition-size (split-KV's
partition, or `none`: the one-pass kernel), each one or more values — sweep
their grid (a flag not given keeps paged_attention's default) at each batch x context: one row per configuration,
paged_attention's default first, each with its max err against SDPA, timed in the same alternating rounds; a
configuration Triton cannot build is a row saying why. --cuda-graph adds a column of the same timing of the call
replayed from a CUDA graph, which launches the kernel without paged_attention's Python and Triton's launcher: what
the graph saves is host time the GPU waited for. Any of these flags prints the sweep's table (with a "host us"
column: the host's time to issue one call, not waited for) in place of the chapter's.

On a CPU there is no bandwidth to measure: with TRITON_INTERPRET=1 it runs the kernels on the chapter's
test shapes in the interpreter instead — a sanity check (parity with torch) and the interpreter's time
per call, which says nothing about GPU speed. Without it, it refuses.

Every input (the pool, the queries, the mixed step's tokens) is drawn with seed 0, so a max err is the same from
run to run on one machine.
"""

import inspect
import itertools
import os
import random
import sys
import time

import torch

from nanoserve.bench.model import timed

# HBM peak by device name (vendor data sheets), GB/s; --peak-gbs overrides
PEAK_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
            "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "RTX 4090": 1008, "T4": 320}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# a GPU run's flags and their defaults: argparse leaves them None, so a flag the user gave is known as given
# (the interpreter refuses it whatever its value) and run_gpu fills in the rest
GPU_ONLY_DEFAULTS = {"batch": [1, 4, 16, 64, 256], "context": [128, 512, 2048, 8192], "dtype": "fp16", "block_size": 16,
                     "peak_gbs": None}
# paged_attention's launch parameters, swept by the flags of the same names (GPU only too: the interpreter drops
# num_warps and num_stages, and runs fixed tiles); a flag not given keeps paged_attention's default
TUNING = ("tile", "block_m", "num_warps", "num_stages", "partition_size")


def partition_value(text: str) -> int | None:
    """--partition-size's values: a number of keys, or `none` (no split: the one-pass kernel)."""
    return None if text.lower() == "none" else int(text)


def flag_value(value) -> str:
    return "none" if value is None else str(value)


def register(sub):
    p = sub.add_parser("attention", help="Triton paged attention vs torch paged vs SDPA: time and bandwidth (chapter 07)")
    defaults = {name: " ".join(map(str, v)) if isinstance(v, list) else v for name, v in GPU_ONLY_DEFAULTS.items()}
    p.add_argument("--batch", type=int, nargs="+", help=f"GPU only (default: {defaults['batch']})")
    p.add_argument("--context", type=int, nargs="+", help=f"GPU only (default: {defaults['context']})")
    # fp16 by default: the dtype the interpreter tests (test_ch07_kernels); bf16 is checked only by the GPU run's own
    # mixed step and max err column
    p.add_argument("--dtype", choices=sorted(DTYPES), help=f"GPU only (default: {defaults['dtype']})")
    p.add_argument("--block-size", type=int, help=f"GPU only (default: {defaults['block_size']})")
    p.add_argument("--peak-gbs", type=float, help="GPU only: the device's memory bandwidth (default: from its name)")
    for name, what in (("tile", "keys per loop iteration"), ("block_m", "rows (query token, head) per program"),
                       ("num_warps", "warps per program"), ("num_stages", "software-pipeline depth")):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+",
                       help=f"GPU only: sweep the kernel's {what} over these values (default: paged_attention's)")
    p.add_argument("--partition-size", type=partition_value, nargs="+",
                   help="GPU only: sweep split-KV's keys per partition over these values, `none` for the one-pass "
                        "kernel (default: paged_attention's, none)")
    p.add_argument("--cuda-graph", action="store_true", default=None,
                   help="GPU only: also time each configuration replayed from a CUDA graph (no host launch cost)")
    p.set_defaults(func=run)


def decode_step(batch: int, context: int, block_size: int, dtype, device, H: int = 9, Hkv: int = 3, D: int = 64):
    """A pool holding `batch` sequences of `context` tokens in shuffled blocks, one query each, drawn with seed 0.
    Returns (cache, metadata, q (batch, H, D), contiguous k, v (batch, Hkv, context, D))."""
    from nanoserve.kv.paged_attention import AttentionMetadata, PagedKVCache

    per_seq = -(-context // block_size)
    blocks = list(range(batch * per_seq))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    cache = PagedKVCache(1, batch * per_seq, block_size, Hkv, D, dtype, device)
    g = torch.Generator(device).manual_seed(0)
    cache.k_cache[0].normal_(generator=g)
    cache.v_cache[0].normal_(generator=g)
    meta = AttentionMetadata.build(tables, [context] * batch, [1] * batch, block_size)
    index = torch.tensor(tables, device=device)  # (batch, per_seq)

    def contiguous(pool):  # (Hkv, blocks, bs, D) -> (batch, Hkv, context, D), position order
        return pool[:, index].flatten(2, 3)[:, :, :context].transpose(0, 1).contiguous()

    q = torch.randn(batch, H, D, dtype=dtype, device=device, generator=g)
    return cache, meta, q, contiguous(cache.k_cache[0]), contiguous(cache.v_cache[0])


def run(args):
    if torch.cuda.is_available():
        for name, default in GPU_ONLY_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
        error = check_tuning(args)
        if error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return run_gpu(args)
    if os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter runs fixed test shapes in float32: a GPU run's shape, device and launch flags would do
        # nothing, whatever their values (the GPU's defaults included)
        given = [f"--{name.replace('_', '-')}" for name in (*GPU_ONLY_DEFAULTS, *TUNING, "cuda_graph")
                 if getattr(args, name) is not None]
        if given:
            print(f"error: {', '.join(given)}: a GPU run's flag{'s' * (len(given) > 1)}; in Triton's interpreter "
                  "bench attention runs the chapter's test shapes in float32 and takes none", file=sys.stderr)
            return 2
        return run_interpreter()
    print("error: bench attention measures the Triton kernels on a CUDA GPU, and there is none here. For a sanity run "
          "of the kernels in Triton's interpreter (times per call, no bandwidth): "
          "TRITON_INTERPRET=1 python -m nanoserve bench attention", file=sys.stderr)
    return 2


def check_tuning(args) -> str | None:
    """What is wrong with a launch flag's value on this GPU run (the kernel's own checks, before anything runs)."""
    from nanoserve.kernels.triton_paged_attention import (check_dot_sizes, check_partition_size,
                                                          check_warps_and_stages, launch_config)

    for name in TUNING:
        for value in getattr(args, name) or ():
            try:
                if name in ("tile", "block_m"):
                    cfg = launch_config(9, 3, 64, **{name: value})
                    check_dot_sizes(cfg, DTYPES[args.dtype], torch.device("cuda"))
                elif name == "partition_size":  # against the tiles: a row of the sweep says "failed", not here
                    check_partition_size(value, 1)
                else:
                    check_warps_and_stages(**({"num_warps": 4, "num_stages": 2} | {name: value}))
            except ValueError as e:
                return f"--{name.replace('_', '-')} {value}: {str(e).removeprefix('paged_attention: ')}"
    return None


def launch_grid(args) -> list[dict] | None:
    """The launch configurations to time: paged_attention's default first, then the product of the values given
    (a flag not given keeps the default's), each once. block_m as launch_config rounds it (at least the padded
    group), so that a row's values, given back as flags, launch the same kernel. None: no launch flag given."""
    from nanoserve.kernels.triton_paged_attention import launch_config, paged_attention

    if all(getattr(args, name) is None for name in TUNING) and not args.cuda_graph:
        return None
    default = {name: inspect.signature(paged_attention).parameters[name].default for name in TUNING}
    grid = [default] + [dict(zip(TUNING, values)) for values in itertools.product(
        *(getattr(args, name) or [default[name]] for name in TUNING))]
    configs = {}
    for c in grid:
        cfg = launch_config(9, 3, 64, c["block_m"], c["tile"])
        c = c | {"block_m": cfg["BLOCK_Q"] * cfg["G_PAD"]}
        configs.setdefault(tuple(c.values()), c)
    return list(configs.values())


def fastest(fns: dict, bench, rounds: int = 3) -> dict:
    """Each function's fastest time by `bench`, in alternating rounds: drifts in clock or neighbours hit every
    system alike, and no system is always the first (or the last) of a round."""
    times = dict.fromkeys(fns, float("inf"))
    for round_ in range(rounds):
        order = list(fns)
        for key in order[::-1] if round_ % 2 else order:
            times[key] = min(times[key], bench(fns[key]))
    return times


def host_us(fn, calls: int = 50) -> float:
    """The host's time to issue one call, in µs, not waiting for the GPU: paged_attention's Python and Triton's
    launcher (the GPU queues the kernels meanwhile)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def captured(fn):
    """`fn` captured in a CUDA graph: its replay launches the same kernel with the same arguments, without fn's
    Python or Triton's launcher. fn must have run once before (compiled: a capture records launches, not builds)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()  # its output tensor comes from the graph's own memory pool, written again by each replay
    return graph.replay


def within_bound(err: float, reference_err: float) -> bool:
    """An error no worse than 10x a reference's (or 1e-3): a launch changes the order of the sums, not the
    error's size."""
    return err <= max(10 * reference_err, 1e-3)


def sweep(configs: list[dict], kernel_call, reference: torch.Tensor, bench, graph: bool, host,
          others: dict) -> tuple[list, dict]:
    """Time the kernel under each launch configuration, and `others` (name -> fn), in the same rounds.
    kernel_call(config) -> a function running the kernel so; reference: the output to compare with; bench(fn)
    times fn (ms); host(fn) (None: not measured) the host's part of it (µs). Returns one row per configuration,
    {config, err, right, triton, graph, host} (graph None unless `graph`) or {config, failed: why}, and
    {name: ms} for the others. right: err within_bound of the first (default) configuration's."""
    rows, fns = [], dict(others)
    for i, c in enumerate(configs):
        try:  # the first call compiles: a configuration Triton cannot build is reported, and the sweep goes on
            fns[i, "triton"] = kernel_call(c)
            err = (fns[i, "triton"]().float() - reference.float()).abs().max().item()
            if graph:
                fns[i, "graph"] = captured(fns[i, "triton"])
        except Exception as e:  # OutOfResources (shared memory, registers), a compiler error, a failed capture
            rows.append({"config": c, "failed": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"})
            fns.pop((i, "triton"), None)
            continue
        rows.append({"config": c, "err": err, "key": i})
    times = fastest(fns, bench)
    for row in rows:
        if "key" in row:
            i = row.pop("key")
            row |= {"right": within_bound(row["err"], rows[0].get("err", 0.0)), "triton": times[i, "triton"], "graph": times.get((i, "graph")),
                    "host": host and min(host(fns[i, "triton"]) for _ in range(3))}
    return rows, {name: times[name] for name in others}


def run_gpu(args):
    import triton
    from torch.nn import functional as F

    from nanoserve.kernels.triton_paged_attention import launch_config, paged_attention, query_blocks
    from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention

    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    name = torch.cuda.get_device_name()
    peak = args.peak_gbs or next((v for k, v in PEAK_GBS.items() if k in name), None)
    if peak is None:
        print(f"error: no peak bandwidth known for {name!r}: pass --peak-gbs", file=sys.stderr)
        return 2
    configs = launch_grid(args)  # None: the chapter's table
    launch_flags = "".join(f" --{n.replace('_', '-')} {' '.join(map(flag_value, getattr(args, n)))}" for n in TUNING
                           if getattr(args, n) is not None) + " --cuda-graph" * bool(args.cuda_graph)
    print(f"command: python -m nanoserve bench attention --batch {' '.join(map(str, args.batch))} --context "
          f"{' '.join(map(str, args.context))} --dtype {args.dtype} --block-size {args.block_size}{launch_flags}")
    print(f"device: {name}, dtype: {args.dtype}, assumed peak {peak:.0f} GB/s; decode, 9/3 heads, head_dim 64")
    print(f"torch {torch.__version__}, triton {triton.__version__}")
    print_mixed_step(dtype, device, args.block_size, configs)
    if configs is None:
        print(f"{'batch':>6s} {'context':>8s} {'MB moved':>9s} | {'triton us':>10s} {'GB/s':>6s} {'% peak':>7s} | "
              f"{'torch us':>9s} {'sdpa us':>8s} | {'max err':>8s}")
    else:
        print(f"{len(configs)} launch configurations, paged_attention's default first; host us: the host's time to "
              "issue one call" + ("; graph: the call replayed from a CUDA graph" if args.cuda_graph else ""))
        print(f"{'batch':>6s} {'context':>8s} {'MB moved':>9s} | {'tile':>5s} {'block_m':>7s} {'warps':>5s} "
              f"{'stages':>6s} {'partition':>9s} | {'triton us':>10s} {'GB/s':>6s} {'% peak':>7s} | {'host us':>7s} | "
              + (f"{'graph us':>10s} {'GB/s':>6s} {'% peak':>7s} | " if args.cuda_graph else "") + f"{'max err':>8s}")

    def median_ms(fn):  # do_bench flushes the L2 cache before every run
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")

    for batch in args.batch:
        for context in args.context:
            cache, meta, q, k, v = decode_step(batch, context, args.block_size, dtype, device)
            meta = AttentionMetadata(*(t.to(device) for t in vars(meta).values()))
            attn = PagedAttention(cache, meta)

            def triton_paged(config: dict):
                """The kernel's call under `config` ({}: paged_attention's defaults). The grid's query blocks are
                built once, on the GPU, as the engine does once per step: the call reads nothing back to the host."""
                tiles = {n: config[n] for n in ("block_m", "tile") if n in config}
                block_q = launch_config(9, 3, 64, **tiles)["BLOCK_Q"]
                blocks = [t.to(device) for t in query_blocks([*range(batch + 1)], block_q)]
                return lambda: paged_attention(q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens,
                                               meta.cu_seqlens_q, blocks, **config)

            def torch_paged():  # chapter 05's decode path, without its store_kv
                return torch.cat([g.attend(q[g.tokens], cache.k_cache[0], cache.v_cache[0]) for g in attn.decode_groups])

            def sdpa():
                return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

            moved = 2 * k.nbytes + 2 * q.nbytes  # K, V read once; q read, out written
            shape = f"{batch:6d} {context:8d} {moved / 1e6:9.1f} |"

            def bandwidth(ms):
                return f"{ms * 1e3:10.1f} {moved / ms / 1e6:6.0f} {moved / ms / 1e6 / peak * 100:6.1f}%"

            if configs is None:
                triton_default = triton_paged({})
                err = (triton_default().float() - sdpa()[:, :, 0].float()).abs().max().item()
                times = fastest({"triton": triton_default, "torch": torch_paged, "sdpa": sdpa}, median_ms)
                print(f"{shape} {bandwidth(times['triton'])} | {times['torch'] * 1e3:9.1f} "
                      f"{times['sdpa'] * 1e3:8.1f} | {err:8.1e}")
            else:
                rows, times = sweep(configs, triton_paged, sdpa()[:, :, 0], median_ms, args.cuda_graph, host_us,
                                    {"torch": torch_paged, "sdpa": sdpa})
                print(f"{shape} torch paged {times['torch'] * 1e3:.1f} us, sdpa {times['sdpa'] * 1e3:.1f} us")
                for row in rows:
                    c = row["config"]
                    line = (f"{shape} {c['tile']:5d} {c['block_m']:7d} {c['num_warps']:5d} {c['num_stages']:6d} "
                            f"{flag_value(c['partition_size']):>9s} | ")
                    if "failed" in row:
                        print(f"{line}failed: {row['failed'][:160]}")
                        continue
                    graph = f"{bandwidth(row['graph'])} | " if args.cuda_graph else ""
                    print(f"{line}{bandwidth(row['triton'])} | {row['host']:7.1f} | {graph}{row['err']:8.1e}"
                          + "  default" * (c is configs[0]) + "  WRONG: max err" * (not row["right"]))
                right = [r for r in rows if r.get("right")]
                if right:
                    column = "graph" if args.cuda_graph else "triton"
                    best = min(right, key=lambda r: r[column])
                    flags = " ".join(f"--{n.replace('_', '-')} {flag_value(best['config'][n])}" for n in TUNING)
                    print(f"best at batch {batch} x context {context} by {column} us: {flags} "
                          f"({best[column] * 1e3:.1f} us, {moved / best[column] / 1e6 / peak * 100:.1f}% of peak)")
            del cache, attn, k, v
            torch.cuda.empty_cache()


# the GPU run's parity check: one engine step of every kind, SmolLM2's heads; seq_lens, query_lens
MIXED_STEP = ([1, 37, 200, 513, 94], [1, 37, 16, 1, 30])
MIXED_STEP_TEXT = "a decode, a 37-token prompt, a 16-token chunk on 184 cached, a decode at 513, a 30-token chunk on 64"


def print_mixed_step(dtype, device, block_size: int, configs: list[dict] | None) -> None:
    """The GPU run's parity line(s): MIXED_STEP's errors for chapter 05's torch path on `device` and for the kernel
    under paged_attention's default launch (configs None: the chapter's table) or under each of a sweep's launch
    configurations, one line each, a wrong one marked as the sweep marks its rows (within_bound of the torch path's
    own error), one that cannot be launched said so."""
    triton_errs, torch_err = mixed_step_errors(dtype, device, block_size, configs)
    head = f"mixed step ({MIXED_STEP_TEXT}), max err against chapter 05's torch path in float32 on the CPU: "
    if configs is None:
        print(f"{head}triton {triton_errs[0]:.1e}, torch paged path on {device.type} {torch_err:.1e}")
        return
    print(f"{head}torch paged path on {device.type} {torch_err:.1e}; triton under each launch configuration:")
    for c, err in zip(configs, triton_errs):
        line = (f"  tile {c['tile']} block_m {c['block_m']} warps {c['num_warps']} stages {c['num_stages']} "
                f"partition {flag_value(c['partition_size'])}: ")
        if isinstance(err, str):
            print(f"{line}failed: {err[:160]}")
            continue
        print(f"{line}triton {err:.1e}" + "  default" * (c is configs[0])
              + "  WRONG: max err" * (not within_bound(err, torch_err)))


def mixed_step_errors(dtype, device, block_size: int, launches: list[dict] | None = None, H: int = 9,
                      Hkv: int = 3, D: int = 64) -> tuple[list, float]:
    """MIXED_STEP on `device` in `dtype`, cached prefixes in shuffled blocks: the max abs difference from chapter
    05's path run in float32 on a CPU copy of the same pool, of the Triton kernel launched with each of `launches`
    (paged_attention's keywords; None: its defaults), all on the same pool and inputs (drawn with seed 0), and of
    chapter 05's torch path on `device`. Returns ([the kernel's error per launch, or why that launch failed], the
    torch path's)."""
    from nanoserve.kernels.triton_paged_attention import paged_attention
    from nanoserve.kv.block_manager import slot_mapping
    from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache

    seq_lens, query_lens = MIXED_STEP
    need = [-(-s // block_size) for s in seq_lens]
    blocks = list(range(sum(need)))
    random.Random(0).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(n)] for n in need]
    cache = PagedKVCache(1, sum(need), block_size, Hkv, D, dtype, device)
    g = torch.Generator(device).manual_seed(0)
    for table, s, n in zip(tables, seq_lens, query_lens):  # the cached prefixes
        slots = torch.tensor(slot_mapping(table, 0, s - n, block_size), dtype=torch.long, device=device)
        cache.store_kv(0, *(torch.randn(s - n, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2)),
                       slots)
    host = PagedKVCache(1, sum(need), block_size, Hkv, D)  # float32, CPU: the same values
    host.k_cache[0].copy_(cache.k_cache[0])
    host.v_cache[0].copy_(cache.v_cache[0])
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, block_size)
    N = sum(query_lens)
    q, k, v = (torch.randn(N, h, D, device=device, dtype=dtype, generator=g) for h in (H, Hkv, Hkv))
    expected = PagedAttention(host, meta)(0, q.float().cpu(), k.float().cpu(), v.float().cpu())
    meta = AttentionMetadata(*(t.to(device) for t in vars(meta).values()))
    torch_out = PagedAttention(cache, meta)(0, q, k, v)  # stores this step's k, v in the pool, then attends

    def error(out):
        return (out.float().cpu() - expected).abs().max().item()

    triton_errs = []
    for launch in launches or [{}]:
        try:  # a launch the kernel refuses (a partition smaller than a tile) or Triton cannot build: said, not fatal
            triton_errs.append(error(paged_attention(q, cache.k_cache[0], cache.v_cache[0], meta.block_tables,
                                                     meta.seq_lens, meta.cu_seqlens_q, **launch)))
        except Exception as e:
            triton_errs.append(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    return triton_errs, error(torch_out)


# the interpreter run's cases: name, (Hkv, G, D, block_size), seq_lens, query_lens
INTERPRETER_CASES = [
    ("tiny decodes (test_ch07_kernels)", (2, 3, 16, 4), [1, 4, 5, 16, 33, 70], [1] * 6),
    ("tiny mixed step", (2, 3, 16, 16), [13, 1, 48, 32, 20], [1, 1, 48, 16, 1]),
    ("SmolLM2 decodes, 2 seqs", (3, 3, 64, 16), [40, 38], [1, 1]),
    ("SmolLM2 prefill, 2 x ~36 tokens", (3, 3, 64, 16), [37, 34], [37, 34]),
]


def run_interpreter():
    """The kernels on the chapter's test shapes, in Triton's interpreter: parity with torch, seconds per call
    (best of 3). Each case's inputs are drawn with seed 0, so its max err is the same from run to run."""
    from nanoserve.kernels.triton_paged_attention import launch_config, paged_attention, query_blocks
    from nanoserve.kernels.triton_store_kv import store_kv
    from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache

    print("command: TRITON_INTERPRET=1 python -m nanoserve bench attention")
    print("device: CPU, Triton's interpreter (numpy, one program after another): a sanity run — interpreter "
          "seconds per call (best of 3), NOT GPU speed; float32")
    print("default tiles (interpreter: 64 rows x 64 keys per program); programs = query blocks x kv heads")
    print(f"{'case':34s} {'programs':>9s} {'attention s':>12s} {'store-KV s':>11s} {'max err':>8s}")
    for name, (Hkv, G, D, bs), seq_lens, query_lens in INTERPRETER_CASES:
        per_seq = [-(-s // bs) for s in seq_lens]
        tables, start = [], 0
        for n in per_seq:
            tables.append(list(range(start, start + n))[::-1])  # reversed: not in position order
            start += n
        cache = PagedKVCache(1, start, bs, Hkv, D)
        g = torch.Generator().manual_seed(0)
        cache.k_cache[0].normal_(generator=g)
        cache.v_cache[0].normal_(generator=g)
        meta = AttentionMetadata.build(tables, seq_lens, query_lens, bs)
        N = sum(query_lens)
        q, k, v = (torch.randn(N, h, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
        expected = PagedAttention(cache, meta)(0, q, k, v)  # stores k, v too
        args = (q, cache.k_cache[0], cache.v_cache[0], meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)
        out = paged_attention(*args)  # the first call also rewrites the kernel's AST: not timed
        store_kv(k, v, cache.k_cache[0], cache.v_cache[0], meta.slot_mapping)
        attn_s = timed(lambda: paged_attention(*args), repeats=3)
        store_s = timed(lambda: store_kv(k, v, cache.k_cache[0], cache.v_cache[0], meta.slot_mapping), repeats=3)
        programs = len(query_blocks(meta.cu_seqlens_q.tolist(), launch_config(Hkv * G, Hkv, D)["BLOCK_Q"])[0]) * Hkv
        print(f"{name:34s} {programs:9d} {attn_s:12.3f} {store_s:11.3f} {(out - expected).abs().max().item():8.1e}")
