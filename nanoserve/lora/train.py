"""Chapter 19 — training small LoRA adapters with PEFT, to have real adapters to serve.

    python -m nanoserve lora-train --out adapters     # adapters/upper and adapters/reverse, SmolLM2

Two toy tasks, each a few hundred prompt/answer pairs made up on the spot, each learnt by its own adapter
(rank 8 on q, k, v, o, gate, up, down) with transformers + PEFT in float32 on the CPU:

    upper     "Repeat in capitals: blue river"  -> "BLUE RIVER"
    reverse   "Reverse the words: blue river"   -> "river blue"

The tests train adapters the same way on the tiny random model, a few AdamW steps each (`train_adapter`).
"""

import copy
import random

import torch

WORDS = ("blue red green river stone cloud apple light tower music paper glass night summer forest bird "
         "silver ocean window garden").split()
TASKS = {
    "upper": ("Repeat in capitals: {}", lambda ws: " ".join(w.upper() for w in ws)),
    "reverse": ("Reverse the words: {}", lambda ws: " ".join(reversed(ws))),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def task_examples(task: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs of a toy task, 2 to 4 words each."""
    template, answer = TASKS[task]
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        ws = rng.sample(WORDS, rng.randint(2, 4))
        pairs.append((template.format(" ".join(ws)), answer(ws)))
    return pairs


def train_adapter(hf_model, sequences: list[list[int]], out_dir, rank: int = 8, alpha: int = 16, steps: int = 30,
                  lr: float = 1e-3, batch_size: int = 8, targets=TARGETS, seed: int = 0) -> str:
    """Train a LoRA adapter on a copy of `hf_model` (a transformers causal LM; left untouched) with a causal-LM
    loss on token id `sequences`; save it in PEFT's format to out_dir; returns out_dir."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(hf_model).train(),  # float32 (the callers load it so)
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(sequences, min(batch_size, len(sequences)))
        width = max(map(len, batch))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in batch])
        labels = torch.tensor([s + [-100] * (width - len(s)) for s in batch])  # padding scores nothing
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def train_smollm2_adapters(out: str, steps: int, rank: int) -> dict[str, str]:
    """The two toy adapters for SmolLM2 (transformers loads the embedded GGUF itself): {task: directory}."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nanoserve.model import embedded_gguf_path

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    done = {}
    for task in TASKS:
        seqs = [tokenizer.encode(f"{p}\n{a}") + [tokenizer.eos_token_id] for p, a in task_examples(task, 400)]
        done[task] = train_adapter(model, seqs, Path(out) / task, rank=rank, alpha=2 * rank, steps=steps)
        print(f"{task}: {done[task]}")
    return done
