"""nanoserve: an LLM inference server, built chapter by chapter.

    from nanoserve import LLM, SamplingParams      # the offline API (chapter 06)

The exports load lazily, so `import nanoserve` stays cheap (no torch until you ask for them).
"""


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module-level __getattr__ that imports `exports[name]` (a module) on first use of `name`."""

    def __getattr__(name: str):
        if name in exports:
            import importlib

            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


_EXPORTS = {"LLM": "nanoserve.llm", "SamplingParams": "nanoserve.sampling"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports("nanoserve", _EXPORTS)
