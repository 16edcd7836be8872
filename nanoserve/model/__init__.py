"""The model layer: attention (chapter 01) and the Llama model loaded from GGUF (chapter 02).

It knows nothing about requests, caches or schedulers: callers hand it token ids, positions
and an attention function.

The exports load lazily, as nanoserve's own do: `nanoserve.model.config` (a dataclass, what the CLI's `memory`
and `info` read) imports without torch, so `python -m nanoserve --help` answers at once.
"""

from nanoserve import lazy_exports

_EXPORTS = {"Llama": "nanoserve.model.llama", "LlamaConfig": "nanoserve.model.config",
            "load_gguf": "nanoserve.model.gguf_loader", "embedded_gguf_path": "nanoserve.model.gguf_loader"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports("nanoserve.model", _EXPORTS)
