"""`python -m nanoserve memory`: how many concurrent sequences of a given length fit on a device (chapter 04).

    python -m nanoserve memory --model llama-3-8b --device-gb 80 --seq-len 4096 --dtype bf16
    python -m nanoserve memory --model llama-3-8b --device-gb 24 --weights int8 q4   # chapter 10: smaller weights
    python -m nanoserve memory --model llama-3-8b --student 04    # the plan from YOUR exercises 4.2-4.3
"""

import sys

from nanoserve.cli.checks import UsageError, chapters, fraction, positive_float, positive_int, weight_format
from nanoserve.memory import (DTYPE_BYTES, GiB, RESERVE_FRACTION, format_bytes, paged_memory_plan, parameter_counts,
                              weight_bytes)
from nanoserve.model.known_configs import KNOWN_CONFIGS, SLIDING_WINDOWS
from nanoserve.student import StudentCode, parse_selection


def register(sub):
    p = sub.add_parser("memory", help="KV bytes per token and sequence, and how many sequences fit on a device")
    p.add_argument("--model", choices=sorted(KNOWN_CONFIGS), default="smollm2-135m", help="a known model config")
    p.add_argument("--device-gb", type=positive_float, default=80.0, help="device memory in GiB (2**30 bytes)")
    p.add_argument("--seq-len", type=positive_int, default=4096, help="tokens per sequence (prompt + output)")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bf16", help="of both weights and KV cache")
    p.add_argument("--reserve", type=fraction, default=RESERVE_FRACTION, help="fraction of the device kept free, in [0, 1)")
    p.add_argument("--weights", nargs="+", default=[], type=weight_format,
                   help="fp32, int8, q4, bf16: how many more sequences fit with the weights in these formats (chapter 10)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block of the paged pool (chapter 05)")
    p.add_argument("--kv-fill", type=float, default=None,
                   help="the share of used KV slots that held tokens in a real run (bench experiment overload "
                        "prints it), to see what the pool holds in practice")
    p.add_argument("--student", nargs="?", const=True, default=False, type=chapters, metavar="CHAPTERS",
                   help="compute the KV bytes and the plan with YOUR finished exercises 4.2-4.3 (exercises/04-kv-cache/"
                        "memory.py): --student 04, or alone; an unfinished rung falls back to the reference with a "
                        "warning")
    p.set_defaults(func=run)


def run(args):
    formats = args.weights
    if args.kv_fill is not None and not 0 < args.kv_fill <= 1:
        raise UsageError(f"--kv-fill must be in (0, 1], got {args.kv_fill}")
    if args.student is True:  # bare --student: the one chapter whose exercises this command runs
        args.student = "04"
    if parse_selection(args.student) - {"04"}:
        raise UsageError(f"--student {args.student}: memory runs chapter 04's exercises only (--student 04)")
    config = KNOWN_CONFIGS[args.model]
    code = StudentCode(args.student)
    memory = code.module("nanoserve.memory")  # the reference, or with --student 04 your exercises 4.2-4.3
    try:
        plan = memory.memory_plan(config, args.device_gb * GiB, args.seq_len, args.dtype, args.reserve)
    except ValueError as e:  # a sequence longer than the model's context
        raise UsageError(str(e)) from None
    L, Hkv, D, nbytes = config.num_hidden_layers, config.num_key_value_heads, config.head_dim, DTYPE_BYTES[args.dtype]

    def row(label: str, n: float) -> str:
        return f"  {label:34s} {n:>18,.0f} B  {format_bytes(n):>10s}"

    print(f"command: python -m nanoserve memory --model {args.model} --device-gb {args.device_gb:g} "
          f"--seq-len {args.seq_len} --dtype {args.dtype} --reserve {args.reserve:g}"
          + (f" --weights {' '.join(formats)}" if formats else ""))
    print(f"model {args.model}: {parameter_counts(config)['total']:,} parameters, {L} layers, "
          f"{Hkv} kv heads × head_dim {D}, context {config.max_position_embeddings}")
    per_token, per_sequence = memory.kv_bytes_per_token(config, args.dtype), \
        memory.kv_bytes_per_sequence(config, args.seq_len, args.dtype)
    print("\nKV cache")
    print(f"  per token    = 2 × {L} layers × {Hkv} kv_heads × {D} head_dim × {nbytes:g} B = {per_token:,.0f} B")
    print(f"  per sequence = {per_token:,.0f} B × {args.seq_len} tokens = {per_sequence:,.0f} B "
          f"({format_bytes(per_sequence)})")
    window = SLIDING_WINDOWS.get(args.model)
    if window and args.seq_len > window:  # the plan below counts full attention; say what the model needs
        in_window = per_token * window
        print(f"  {args.model}'s layers attend to the last {window} tokens only (a sliding window), but this plan\n"
              f"  keeps all {args.seq_len} of a sequence, as full attention does. A cache that keeps only the window:\n"
              f"  {window} tokens = {in_window:,.0f} B ({format_bytes(in_window)}) per sequence, "
              f"{max(0, int(plan.kv_budget // in_window))} sequences in the budget below")
    print("\ndevice memory")
    print(row(f"device ({args.device_gb:g} GiB)", plan.device))
    print(row(f"− reserve ({args.reserve:.0%})", plan.reserve))
    print(row(f"− weights ({args.dtype})", plan.weights))
    print(row(f"− activations ({args.seq_len}-token prefill)", plan.activations))
    print(row("= left for the KV cache", plan.kv_budget))
    if formats:
        print(f"\nsmaller weights (the KV cache and activations stay {args.dtype}):")
        print(f"  {'weights':8s} {'weight bytes':>13s} {'left for KV':>12s} {'sequences':>10s} {'vs ' + args.dtype:>8s}")
        for w in formats:
            budget = plan.kv_budget + plan.weights - weight_bytes(config, w)
            n = max(0, int(budget // plan.kv_per_sequence))
            print(f"  {w:8s} {format_bytes(weight_bytes(config, w)):>13s} {format_bytes(budget):>12s} {n:10d} "
                  f"{n - plan.num_sequences:+8d}")
    if code:  # whose plan this is (the paged lines below are chapter 09's, always the reference's)
        print("\n" + code.describe(runs="the memory plan runs") + "\n" + code.proof(), file=sys.stderr)
    if plan.num_sequences == 0:
        print(f"\nnot even one sequence of {args.seq_len} tokens fits: a smaller dtype, a bigger device, or more devices")
        return 1
    print(f"\nconcurrent sequences of {args.seq_len} tokens: {plan.num_sequences}"
          f"  (= {plan.kv_budget:,.0f} // {plan.kv_per_sequence:,.0f})")
    print(f"tokens in the KV cache at once: {plan.num_sequences * args.seq_len:,}")
    paged = paged_memory_plan(config, args.device_gb * GiB, args.seq_len, args.block_size, args.dtype, args.reserve)
    print(f"\npaged, blocks of {args.block_size} tokens ({format_bytes(paged.block_bytes)} each): {paged.num_blocks:,} blocks; "
          f"a sequence takes {paged.blocks_per_sequence} ({paged.wasted_slots_per_sequence} slots of its last block unused)")
    print(f"concurrent sequences of {args.seq_len} tokens in whole blocks: {paged.num_sequences}")
    if args.kv_fill is not None:
        live = int(paged.num_blocks * args.block_size * args.kv_fill)
        print(f"at the measured fill of {args.kv_fill:.0%} of used slots: {live:,} live tokens, "
              f"{live // args.seq_len} sequences of {args.seq_len} tokens")
