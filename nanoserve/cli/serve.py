"""`python -m nanoserve serve` (what `make serve` runs).

The HTTP server arrives with chapter 08; until then the command prints the model card.
"""

from nanoserve.cli import info


def register(sub):
    p = sub.add_parser("serve", help="serve the embedded model")
    p.add_argument("--gguf", help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.set_defaults(func=run)


def run(args):
    info.run(args)
