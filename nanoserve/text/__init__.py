"""Text <-> token ids (chapter 03): the tokenizer, the chat template, the incremental detokenizer and stop
strings. The server uses it on the way in (template, tokenize); `LLMEngine`'s output step uses it on the way
out (detokenize, stop strings), as vLLM v1's output processor does. The engine core (scheduler, block manager,
model runner) never imports it: it sees token ids only."""
