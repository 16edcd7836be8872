"""nanoserve: an LLM inference server, built chapter by chapter.

    from nanoserve import LLM, SamplingParams      # the offline API (chapter 06)

The exports load lazily, so `import nanoserve` stays cheap (no torch until you ask for them).
"""

_EXPORTS = {"LLM": "nanoserve.llm", "SamplingParams": "nanoserve.sampling"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
