"""How long the cpu backend's kernels take to compile from an empty cache, per compiled function.

A user's first prompt on a fresh machine (and a CI run on a clean one) pays for every Numba kernel the request needs.
This runs a tiny random-weight Llama (float32, or with ``--packed`` int4 projections) through a prefill and one
fused decode step (serial, then, with ``--parallel``, the parallel layer) in a fresh, temporary kernel cache, and
prints the compile time of each function Numba compiled, inclusive of the functions it compiled for it (``depth``:
how deep in that nesting; a time at depth 0 is wall time the caller waited).

Usage::

    python benchmarks/compile_times.py [--packed int4_min] [--parallel] [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

if __name__ == "__main__" and "TESSERA_CACHE_DIR" not in os.environ:  # before tessera configures Numba's cache
    os.environ["TESSERA_CACHE_DIR"] = tempfile.mkdtemp(prefix="tessera-cold-")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from numba.core import event  # noqa: E402


class _Recorder(event.Listener):
    """Inclusive time per ``numba:compile`` event, with its nesting depth."""

    def __init__(self) -> None:
        self.stack: list[float] = []
        self.times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)

    def on_start(self, ev) -> None:
        self.stack.append(time.perf_counter())

    def on_end(self, ev) -> None:
        start = self.stack.pop()
        dispatcher = (ev.data or {}).get("dispatcher")
        name = getattr(dispatcher, "__qualname__", None) or str(dispatcher)
        self.times[(name, len(self.stack))].append(time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", choices=("int4", "int4_min", "int8"), help="quantize the four projections")
    ap.add_argument("--parallel", action="store_true", help="also run the fused layer as two workers")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)

    import tessera.backends.cpu.ops.fused_decode as fused_decode
    from tessera.bench.machine import fingerprint
    from tessera.kernels import quantize
    from tessera.models import load_model
    from tessera.models.paged import StepBatch, forward_step, new_cache

    directory = tempfile.mkdtemp(prefix="tessera-tiny-")
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    model = load_model(directory)
    if args.packed:
        for name in [n for n in model.weights if n.endswith(("qkv.weight", "o.weight", "gate_up.weight",
                                                               "down.weight"))]:
            model.weights[name] = quantize(model.weights[name], args.packed, 32)
    recorder = _Recorder()
    event.register("numba:compile", recorder)
    cache = new_cache(model, num_pages=8, page_size=4)
    tokens = [5, 17, 3, 99, 42]

    def step(n_new: int) -> StepBatch:
        n = len(tokens)
        return StepBatch(torch.tensor(tokens[n - n_new:]), [n_new], [n], torch.tensor([[0, 1, 2]], dtype=torch.int32),
                         torch.arange(n - n_new, n))

    walls = {}
    t0 = time.perf_counter()
    forward_step(model, cache, step(len(tokens)))
    walls["prefill"] = time.perf_counter() - t0
    phases = [("decode step (serial layer)", 1)] + ([("decode step (parallel layer)", 2)] if args.parallel else [])
    for label, workers in phases:
        fused_decode._workers = lambda work, w=workers: w
        tokens.append(7 + workers)
        t0 = time.perf_counter()
        forward_step(model, cache, step(1))
        walls[label] = time.perf_counter() - t0
    machine = fingerprint()
    print(f"{machine['cpu_model']}, {machine['num_cores']} cores; cache {os.environ['TESSERA_CACHE_DIR']}")
    for label, seconds in walls.items():
        print(f"{label:32s} {seconds:7.1f} s")
    rows = sorted(((sum(ts), len(ts), name, depth) for (name, depth), ts in recorder.times.items()), reverse=True)
    print(f"\n{'seconds':>8s} {'times':>5s} depth  function")
    for seconds, count, name, depth in rows[:args.top]:
        print(f"{seconds:8.1f} {count:5d} {depth:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
