"""Chapter 09 — the prompt set `bench mlperf` plays: 64 requests, each with the float32 oracle's greedy answer.

MLPerf ships a data set with its reference answers (for Llama 3.1 8B, news articles to summarise, scored
by ROUGE against the answers); its LoadGen then only ever says "sample 17", and the query sample library
(QSL) knows what sample 17 is. Ours is written once by this script and committed beside it:

    .venv/bin/python -m nanoserve.bench.mlperf_data          # rewrites nanoserve/bench/mlperf_prompts.jsonl

Each line:

    {"index": 0, "kind": "chat", "messages": [...], "max_tokens": 48,
     "reference_token_ids": [504, 3214, ...], "reference_text": "The moon is ..."}

The prompts are the course's mix (nanoserve/bench/prompts.py: chat turns, long documents, a shared system
prompt: 34 to 844 tokens in SmolLM2's chat template), answers capped at 64 tokens so a CPU run of a few hundred queries fits in
minutes. The reference is the embedded SmolLM2 in float32 (the course's oracle path), greedy, stopping at
end-of-sequence or max_tokens, as a server would.
"""

import functools
import json
import os

PATH = os.path.join(os.path.dirname(__file__), "mlperf_prompts.jsonl")
NUM_SAMPLES, SEED, MAX_OUTPUT = 64, 9, 64


def build(path: str = PATH) -> None:
    """Draw the prompts, generate the references, write the JSONL."""
    from nanoserve.bench.prompts import course_prompts
    from nanoserve.llm import LLM
    from nanoserve.sampling import SamplingParams

    items = course_prompts(NUM_SAMPLES, SEED)
    params = [SamplingParams(temperature=0, max_tokens=min(item["output_len"], MAX_OUTPUT)) for item in items]
    with LLM(weights="fp32") as llm:
        outputs = llm.generate([item["messages"] for item in items], params)
    with open(path, "w") as f:
        for i, (item, p, out) in enumerate(zip(items, params, outputs)):
            f.write(json.dumps({"index": i, "kind": item["kind"], "messages": item["messages"], "max_tokens": p.max_tokens,
                                "reference_token_ids": out.token_ids, "reference_text": out.text}) + "\n")
    print(f"wrote {path}: {len(items)} prompts, {sum(len(o.token_ids) for o in outputs)} reference tokens")


@functools.cache
def load_samples(path: str = PATH) -> tuple[dict, ...]:
    """The prompt set, each item with its "prompt_token_ids" (the chat template rendered by the model's tokenizer)."""
    from nanoserve.bench.serve import model_tokenizer

    tokenizer = model_tokenizer()
    with open(path) as f:
        items = [json.loads(line) for line in f if line.strip()]
    return tuple({**item, "prompt_token_ids": tokenizer.encode_chat(item["messages"])} for item in items)


if __name__ == "__main__":
    build()
