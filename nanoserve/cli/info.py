"""`python -m nanoserve info`: the embedded model's config, parameter count and weight bytes per dtype."""

from nanoserve.cli.checks import UsageError, input_file
from nanoserve.memory import DTYPE_BYTES, format_bytes, parameter_counts


def register(sub):
    p = sub.add_parser("info", help="print the model's config, parameter count and weight bytes per dtype")
    p.add_argument("--gguf", type=input_file, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.set_defaults(func=run)


def run(args):
    from nanoserve.model.gguf_loader import config_from_gguf, embedded_gguf_path, open_gguf

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
