"""`python -m nanoserve lora-train`: two small LoRA adapters for SmolLM2, trained with PEFT (chapter 19).

    python -m nanoserve lora-train --out adapters          # adapters/upper, adapters/reverse
    python -m nanoserve serve --weights fp32 --lora-modules upper=adapters/upper reverse=adapters/reverse
"""

from nanoserve.cli import checks


def register(sub):
    p = sub.add_parser("lora-train", help="train two toy LoRA adapters for SmolLM2 with PEFT (chapter 19)")
    p.add_argument("--out", required=True, help="the folder to write the adapters' directories into")
    p.add_argument("--steps", type=checks.positive_int, default=60, help="AdamW steps per adapter (batch 8)")
    p.add_argument("--rank", type=checks.positive_int, default=8, help="the adapters' rank r")
    p.set_defaults(func=run)


def run(args):
    from nanoserve.lora.train import train_smollm2_adapters

    train_smollm2_adapters(args.out, args.steps, args.rank)
    return 0
