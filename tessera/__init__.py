"""Tessera: declarative attention kernels and LLM bring-up.

The engine's entry points are importable from the top level (loaded on first use, so ``import tessera`` stays light):

>>> import tessera
>>> llm = tessera.LLM()                       # SmolLM2-135M-Instruct
>>> llm.generate(["Hello"], tessera.SamplingParams(temperature=0.0, max_tokens=8))[0].text
"""

__version__ = "0.1.0"

#: top-level name -> the module that defines it
_LAZY = {
    "LLM": "tessera.engine.llm",
    "SamplingParams": "tessera.engine.params",
    "RequestOutput": "tessera.engine.params",
    "CompletionOutput": "tessera.engine.params",
    "load_model": "tessera.models",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
