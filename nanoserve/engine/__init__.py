"""Chapter 06 — the engine: sequences, the scheduler, the executor and its worker, the model runner,
and LLMEngine.step() that ties them together. It sees token ids only; the tokenizer lives above it."""
