"""A first run that does not wait for the compiler (:mod:`tessera.tools.first_run`): the warm marker, the one-at-a-time
lock, and `tessera generate` serving a request on the quick-start backend, then moving it to the compiled one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tessera.tools import first_run


def _backend(tmp_path, quick: str | None = "reference"):
    return SimpleNamespace(name="cpu", quick_start_backend=quick, warm_marker_dir=lambda: tmp_path / "warm")


def test_warm_marker_per_model_kind(tmp_path) -> None:
    backend = _backend(tmp_path)
    assert first_run.is_warm(backend, "kind-a") is False
    first_run.mark_warm(backend, "kind-a")
    assert first_run.is_warm(backend, "kind-a") is True
    assert first_run.is_warm(backend, "kind-b") is False
    # a backend that cannot say (no marker directory, or no quick start): None, and the caller compiles as before
    assert first_run.is_warm(SimpleNamespace(name="x"), "kind-a") is None
    assert first_run.is_warm(_backend(tmp_path, quick=None), "kind-a") is None


def test_model_kind_follows_what_the_kernels_specialize_on() -> None:
    import dataclasses

    import torch

    from tessera.kernels.quant import quantize
    from tessera.models.config import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {"family", "norm", "activation", "qk_norm", "post_norms"} <= fields

    def model(dtype, packed):
        w = torch.randn(64, 64)
        weights = {"embed": torch.randn(8, 64, dtype=dtype),
                   "layers.0.qkv.weight": quantize(w, "int4", 32) if packed else w.to(dtype)}
        config = SimpleNamespace(family="llama", norm="rms", activation="silu", qk_norm=False, post_norms=False)
        return SimpleNamespace(weights=weights, config=config, dtype=dtype)

    kinds = {first_run.model_kind(model(d, p)) for d in (torch.float32, torch.bfloat16) for p in (False, True)}
    assert len(kinds) == 4
    assert first_run.model_kind(model(torch.float32, True)) == first_run.model_kind(model(torch.float32, True))


_HOLD = textwrap.dedent("""
    import sys, time
    from types import SimpleNamespace
    from pathlib import Path
    from tessera.tools import first_run
    backend = SimpleNamespace(name="cpu", quick_start_backend="reference", warm_marker_dir=lambda: Path(sys.argv[1]))
    lock = first_run.hold_lock(backend)
    print("held" if lock is not None else "busy", flush=True)
    time.sleep(30)
""")


def test_one_background_warmup_at_a_time(tmp_path) -> None:
    backend = _backend(tmp_path)
    assert not first_run.warmup_running(backend)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "warm")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert first_run.warmup_running(backend)
        assert first_run.hold_lock(backend) is None  # a second warm-up backs off
        assert first_run.start_background_warmup(backend, ["--dtype", "float32"]) is None  # and is not started
    finally:
        holder.kill()
        holder.wait()
    assert not first_run.warmup_running(backend)  # the lock died with its process


def test_warmup_argv_names_the_same_model(tmp_path) -> None:
    args = SimpleNamespace(dtype="bfloat16", backend="auto", model=tmp_path / "m.gguf", device=None,
                           keep_quantized=False, dequantize=True)
    assert first_run.warmup_argv(args) == ["--dtype", "bfloat16", "--backend", "auto", "--model",
                                           str(tmp_path / "m.gguf"), "--dequantize"]


@pytest.fixture()
def first_generate(tmp_path, monkeypatch):
    """`tessera generate` as the program would run it (owns_process), on a machine whose kernels are "not compiled":
    a fake marker directory, no real background process, no os._exit."""
    from tessera.models import default_model_path
    from tessera.tools import generate

    try:
        default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    from tessera.backends import registry

    cpu = registry.get("cpu")
    fake = SimpleNamespace(name=cpu.name, quick_start_backend="reference", warm_marker_dir=lambda: tmp_path / "warm")
    started = []
    monkeypatch.setattr(first_run, "effective_backend", lambda name, device: fake)
    monkeypatch.setattr(first_run, "start_background_warmup",
                        lambda backend, argv: started.append(argv) or (12345, tmp_path / "warm" / "warmup.log"))
    monkeypatch.setattr(generate, "_exit_now", lambda: None)
    monkeypatch.setattr(generate, "_long_lived", lambda owns: contextlib.nullcontext())
    monkeypatch.setattr(generate._Upgrade, "EVERY", 0.0)

    def run(argv: list[str]) -> int:
        from tessera.cli import _build_parser

        args = _build_parser().parse_args(["generate", *argv])
        args.owns_process = True
        return args.run(args)

    return SimpleNamespace(run=run, started=started, backend=fake)


def test_first_generate_serves_on_the_quick_start_backend_then_moves_to_the_compiled_kernels(first_generate, capsys,
                                                                                            monkeypatch):
    from tessera.tools import generate

    switched = []
    real_poll = generate._Upgrade.poll

    def poll(self):  # the background warm-up "finishes" after the first streamed token
        if not switched:
            first_run.mark_warm(first_generate.backend, self._kind)
            switched.append(True)
        real_poll(self)

    monkeypatch.setattr(generate._Upgrade, "poll", poll)
    assert first_generate.run(["Hello", "--max-tokens", "4", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "this request runs on the reference backend" in captured.err
    assert first_generate.started and "--dtype" in first_generate.started[0]
    assert "the rest on cpu once its kernels compiled" in captured.err, captured.err
    assert captured.out.strip()


def test_generate_after_the_warm_up_runs_the_compiled_kernels_at_once(first_generate, capsys):
    from tessera.models import load_model

    first_run.mark_warm(first_generate.backend, first_run.model_kind(load_model()))
    assert first_generate.run(["Hello", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "reference backend" not in err and not first_generate.started


def test_wait_for_kernels_keeps_the_compile_in_the_foreground(first_generate, capsys):
    assert first_generate.run(["Hello", "--max-tokens", "2", "--wait-for-kernels"]) == 0
    assert "reference backend" not in capsys.readouterr().err and not first_generate.started


def test_model_kind_of_ggml_block_formats():
    """K-quant and Q5 weights hold their scales inside the blocks (``scales is None``): the kind still names them."""
    import numpy as np

    from tessera.kernels.ggml_quantize import quantize_rows
    from tessera.kernels.quant import from_gguf
    from tessera.tools.first_run import model_kind

    class Fake:
        config = type("C", (), dict(family="llama", norm="rms", activation="silu", qk_norm=False,
                                     post_norms=False))()
        dtype = "torch.float32"

    w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    a, b = Fake(), Fake()
    a.weights = {"x": from_gguf(quantize_rows(w, "q4_k"), "Q4_K", (4, 256))}
    b.weights = {"x": from_gguf(quantize_rows(w, "q6_k"), "Q6_K", (4, 256))}
    assert model_kind(a) != model_kind(b)
