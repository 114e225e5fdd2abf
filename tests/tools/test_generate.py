"""`tessera generate`'s start-up: kernel warm-up, compile progress, speeds without kernel preparation, `--verbose`
breakdown, and `tessera warmup`. The kernel-clock tests compile one tiny function; the rest run SmolLM2 on kernels
the engine tests compile anyway."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import numba
import pytest

from tessera._compile_clock import KernelClock, Span, kernel_clock
from tessera.cli import main
from tessera.tools.generate import _Phases, _speeds
from tessera.tools.warmup import COMPILING, CompileProgress, warm_up


def test_kernel_clock_records_top_level_compiles_once():
    @numba.njit
    def inner(x):
        return x * 2

    @numba.njit
    def outer(x):
        return inner(x) + 1

    started = []
    with kernel_clock(on_compile=started.append) as clock:
        assert outer(3) == 7
        assert outer(4) == 9  # compiled already: no new span
    assert started == [outer.py_func.__qualname__]  # inner compiled inside outer: not a top-level compile
    assert [s.name for s in clock.compiled] == [outer.py_func.__qualname__]
    assert clock.compile_count() == 1 and clock.compile_seconds() > 0
    assert clock.seconds() >= clock.compile_seconds()
    outer(5.0)  # the clock is uninstalled: a new signature compiles unseen
    assert clock.compile_count() == 1


def test_clock_counts_only_the_window_asked_for():
    clock = KernelClock(locked=[Span(1.0, 3.0), Span(5.0, 6.0)], compiled=[Span(1.0, 3.0, "k")])
    assert clock.seconds() == 3.0 and clock.seconds(2.0, 5.5) == 1.5
    assert clock.compile_seconds(0.0, 2.0) == 1.0 and clock.compile_seconds(4.0, 9.0) == 0.0


def test_speeds_exclude_kernel_time():
    """Prefill took 2 s of which 1 s compiled a kernel; decode 2 s of which 0.5 s loaded one from the cache."""
    request = 100.0
    clock = KernelClock(locked=[Span(request + 0.5, request + 1.5), Span(request + 2.5, request + 3.0)],
                        compiled=[Span(request + 0.5, request + 1.5, "gemm")])
    out = SimpleNamespace(prompt_tokens=list(range(10)), token_ids=list(range(7)), time_to_first_token=2.0,
                          latency=4.0, finish_reason="length")
    line = _speeds(out, _Phases(start=0.0, request=request), clock)
    assert "prefill 10 tok/s" in line and "decode 4.0 tok/s" in line  # 10 / 1.0 s and 6 / 1.5 s
    assert "1.0 s compiling kernels during the request, excluded" in line


def test_compile_progress_says_so_once():
    out = io.StringIO()
    progress = CompileProgress(out)
    assert progress.summary(0.0) is None
    for name in ("a", "b"):
        progress.on_compile(name)
        progress.on_compiled(Span(0.0, 1.5, name))
    assert out.getvalue() == COMPILING + "\n"
    assert progress.summary(3.0) == "compiled 2 kernels in 3.0 s; later runs load them from the cache"


@pytest.fixture(scope="module")
def llm():
    from tessera.engine import LLM
    from tessera.models import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return LLM(max_num_seqs=1)


def test_warm_up_leaves_nothing_for_the_prefix_cache(llm):
    from tessera.engine import SamplingParams

    prompt = list(range(100, 140))  # 40 tokens: the warm-up takes the first 14
    params = SamplingParams(temperature=0.0, max_tokens=3)
    warm_up(llm, prompt, params)
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    llm.generate([prompt], params)
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    assert not llm.has_unfinished() and llm.block_manager.num_free_pages == llm.block_manager.num_pages


def test_generate_verbose_breaks_the_start_up_down(llm, capsys):
    assert main(["generate", "Hello", "--max-tokens", "4", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "prefill" in err and "tok/s" in err
    for row in ("imports", "load (header", "tokenizer", "engine", "kernel warm-up",
                "prefill (to the first token)", "decode (the other tokens)", "total"):
        assert row in err, row


def test_warmup_command(llm, capsys):
    assert main(["warmup"]) == 0
    assert "warm-up took" in capsys.readouterr().err


def test_generate_as_the_whole_process_flushes_and_exits_zero(llm):
    """Run as the program, `tessera generate` ends without the interpreter's teardown: its text, its speeds line and
    the breakdown still all arrive, through pipes (block-buffered), and the exit status is 0."""
    import subprocess
    import sys

    # --wait-for-kernels: on a machine where `tessera warmup` never ran, no background compile may outlive the test
    done = subprocess.run([sys.executable, "-m", "tessera", "generate", "Hello", "--max-tokens", "4", "--verbose",
                           "--wait-for-kernels"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the generated text was lost"
    assert "tok/s" in done.stderr and done.stderr.rstrip().endswith("total"), done.stderr[-1000:]


def test_generate_with_speculation_reports_its_drafts(llm, capsys):
    assert main(["generate", "Say 'one two three one two three one two three'", "--max-tokens", "12",
                 "--speculative", "ngram", "--num-draft", "3"]) == 0
    err = capsys.readouterr().err
    assert "[speculative:" in err and "drafted" in err and "accepted" in err


@pytest.mark.parametrize("argv,match", [
    (["--num-draft", "3"], "--num-draft needs --speculative"),
    (["--speculative", "eagle"], "expected 'ngram', 'draft:PATH' or 'self:FORMAT'"),
    (["--speculative", "ngram", "--num-draft", "9"], r"num_draft must be an int in \[1, 7\]"),
])
def test_generate_rejects_bad_speculative_flags(argv, match, capsys):
    assert main(["generate", "Hi", "--max-tokens", "2", *argv]) == 2
    assert re.search(match, capsys.readouterr().err)
