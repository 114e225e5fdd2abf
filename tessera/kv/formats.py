"""The names of the quantized KV cache formats, importable without torch (the CLI's parser lists them); their
definitions are in :mod:`tessera.kv.quantized`."""

#: ``kv_cache_dtype`` values besides None (pages in the model's dtype)
KV_CACHE_DTYPES: tuple[str, ...] = ("int8", "fp8_e4m3")
