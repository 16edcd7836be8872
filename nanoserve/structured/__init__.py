"""Chapter 13 — structured outputs: the sampler may only pick tokens that keep the output inside a grammar.

    request  response_format {"type": "json_schema", ...}  ->  StructuredOutputsParams (params.py)
    server   GrammarCache.compile_async: schema -> CompiledGrammar, cached, in a thread (compiler.py)
             over our own GGUF vocabulary (tokenizer_info.py)
    engine   StructuredOutputManager (manager.py): one SequenceMatcher per completion (matcher.py), synced
             to its output tokens before each step; each constrained row's packed bitmask filled
    sampler  ModelRunner.sample -> GrammarBitmask.apply -> apply_token_bitmask (bitmask.py): -inf on the
             disallowed tokens of the constrained rows only, before temperature / top-k / top-p
    by hand  choice.py: the mask of a choice list from a trie, what xgrammar computes for any grammar; the
             engine serves choice lists with it (trie_grammar.py: the trie compiled, each node's mask kept)
    tools    tools.py: OpenAI's tools + tool_choice as one of these grammars (the server reads the calls
             back: nanoserve/server/tool_calls.py)

xgrammar (Dong et al., MLSys 2025) does the grammar work: a pushdown automaton over bytes, and a mask
cache that decides most of the vocabulary per automaton state ahead of time.
"""

from nanoserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
