"""`python -m nanoserve info`: the embedded model's config, parameter count and weight bytes per dtype.

    python -m nanoserve info --weights fp32 int8 q4     # chapter 10: bytes per weight and per decoded token
"""

from nanoserve.cli.checks import UsageError, input_file, weight_format
from nanoserve.memory import DTYPE_BYTES, format_bytes, parameter_counts, weight_bytes


def register(sub):
    p = sub.add_parser("info", help="print the model's config, parameter count and weight bytes per dtype")
    p.add_argument("--gguf", type=input_file, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--weights", nargs="+", default=[], type=weight_format,
                   help="fp32, int8, q4, bf16: also print what nanoserve's weight formats cost (chapter 10)")
    p.set_defaults(func=run)


def run(args):
    from nanoserve.model.gguf_loader import config_from_gguf, embedded_gguf_path, open_gguf
    formats = args.weights

    path = args.gguf or embedded_gguf_path()
    try:
        config = config_from_gguf(open_gguf(path))
    except ValueError as e:  # not a GGUF file, or not a Llama
        raise UsageError(str(e)) from None
    print(f"model file: {path}")
    for field, value in vars(config).items():
        print(f"  {field:26s} {value}")
    print(f"  {'head_dim':26s} {config.head_dim}")
    counts = parameter_counts(config)
    print("\nparameters:")
    for part, n in counts.items():
        print(f"  {part:26s} {n:>13,}")
    print("\nweight bytes:")
    for dtype, nbytes in DTYPE_BYTES.items():
        print(f"  {dtype:6s} {format_bytes(counts['total'] * nbytes):>10s}")
    if formats:
        print("\nweight formats (scales and zeros included; a batch-1 decode step reads all of it once per token,")
        print("a batch of B decodes reads it once for B tokens):")
        print(f"  {'weights':8s} {'bytes':>10s} {'bytes/weight':>13s} {'per token, batch 1':>19s} {'batch 16':>10s}")
        for w in formats:
            n = weight_bytes(config, w)
            print(f"  {w:8s} {format_bytes(n):>10s} {n / counts['total']:13.3f} {format_bytes(n):>19s} "
                  f"{format_bytes(n / 16):>10s}")
    from nanoserve.model.quant import KERNEL_CROSSOVER_TOKENS, LARGE_STEP_DTYPE, QUANT_MAX_TOKENS, default_integer_dot

    dtype = str(LARGE_STEP_DTYPE).removeprefix("torch.")
    why = "this CPU multiplies bf16 natively" if dtype == "bfloat16" else "no bf16 instructions on this CPU"
    print(f"\nkernel crossover: int8 / q4 layers run their integer kernel on steps of up to {KERNEL_CROSSOVER_TOKENS} "
          f"tokens and a {dtype} GEMM beyond ({why}), on a kept {dtype} copy\n  (KERNEL_CROSSOVER_TOKENS; LLM(kernel_crossover_tokens"
          f"=..., large_step_weights='copy'); {QUANT_MAX_TOKENS} when the weight is dequantized per step instead;\n"
          f"  a default: this CPU's crossover is what `python -m nanoserve bench linear --formats fp32 bf16 q4` shows)")
    print("  the integer kernel: " + ("cpu_dot.c, llama.cpp's integer dot products (activations rounded to int8 "
                                      "in blocks of 32; no native bf16 here)" if default_integer_dot()
                                      else "torch's int8 / int4 kernels, bf16 activations"))
    from nanoserve.kernels import cpu_decode

    rows = (f"up to {cpu_decode.NATIVE_DECODE_MAX_ROWS} sequences" if default_integer_dot()
            else "one sequence: this CPU's layers multiply batches in torch's int4 kernel")  # cpu_decode.max_rows
    print(f"  q4's steps of one token per sequence ({rows}): " + (
        "by default kernels/cpu_decode.c, chapter 09's native step\n"
        "  (cpu_dot.c's products, activations rounded to int8, whatever the integer kernel above; "
        "--native-decode off: the model's forward)"
        if cpu_decode.available() else
        f"the model's forward, with the kernel above (the native step does not build here: {cpu_decode.build_error()})"))
