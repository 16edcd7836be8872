"""The model layer: attention (chapter 01) and the Llama model loaded from GGUF (chapter 02).

It knows nothing about requests, caches or schedulers: callers hand it token ids, positions
and an attention function.
"""

from nanoserve.model.config import LlamaConfig
from nanoserve.model.gguf_loader import embedded_gguf_path, load_gguf
from nanoserve.model.llama import Llama

__all__ = ["Llama", "LlamaConfig", "load_gguf", "embedded_gguf_path"]
