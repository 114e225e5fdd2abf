"""Ranks started by torchrun (or by hand with its environment): greedy tokens equal to one process, clean exits, a
dead rank on either side, and the refusals.

Each process test starts two fresh interpreters on loopback (several seconds each on a loaded machine).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from tessera.distributed.comm import TensorParallelError
from tessera.distributed.torchrun import GroupPlan, LaunchEnv, _check_same_model, launch_env, plan_for
from tessera.engine import LLM, SamplingParams
from tessera.models import load_model
from tests.models.helpers import save_tiny

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 42, 9, 100], [7, 3, 150, 61, 12, 88, 14, 19, 23], [201, 4, 33]]
#: what every rank runs: build the engine, generate, record that it got past LLM(); with "hold", wait for a line on
#: stdin after the first generate and generate again (the failure tests kill a rank in between)
RANK_SCRIPT = '''
import json, os, sys
from tessera.engine import LLM, SamplingParams

path, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
prompts = json.loads(sys.argv[4])
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
llm = LLM(path, page_size=4, num_pages=64, tensor_parallel_size=2)
open(f"{out}.rank{os.environ['RANK']}", "w").write("past LLM()")  # only rank 0 may get here
print(json.dumps([o.token_ids for o in llm.generate(prompts, greedy)]), flush=True)
if mode == "hold":
    sys.stdin.readline()
    try:
        llm.generate(prompts, greedy)
        print("generated", flush=True)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
llm.shutdown()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    # one thread per rank: two ranks share this machine's cores with the test itself
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), TESSERA_TP_TIMEOUT="60", **extra)
    return env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("torchrun_llama")
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_tiny(transformers.LlamaForCausalLM, config, path)
    (path / "rank.py").write_text(RANK_SCRIPT)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    llm = LLM(load_model(checkpoint), page_size=4, num_pages=64)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                                      ignore_eos=True))]


def test_torchrun_two_ranks_match_single_process(checkpoint, reference, tmp_path):
    out = tmp_path / "out"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(_free_port()), str(checkpoint / "rank.py"), str(checkpoint), str(out), "once", json.dumps(PROMPTS)]
    start = time.monotonic()
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    elapsed = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]  # torchrun exits 0 only when every rank did
    assert json.loads(run.stdout.strip().splitlines()[-1]) == reference
    assert (tmp_path / "out.rank0").exists() and not (tmp_path / "out.rank1").exists()
    assert elapsed < 60, elapsed


def _start_pair(checkpoint: Path, out: Path) -> list[subprocess.Popen]:
    """Rank 0 and rank 1 started by hand with torchrun's variables (no agent: nothing but tessera ends them)."""
    port = str(_free_port())
    return [subprocess.Popen([sys.executable, str(checkpoint / "rank.py"), str(checkpoint), str(out), "hold",
                              json.dumps(PROMPTS)], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=port))
            for r in (0, 1)]


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


def test_dead_worker_fails_rank0_cleanly(checkpoint, reference, tmp_path):
    rank0, rank1 = procs = _start_pair(checkpoint, tmp_path / "out")
    try:
        assert json.loads(rank0.stdout.readline()) == reference
        rank1.send_signal(signal.SIGKILL)
        rank1.wait(10)
        start = time.monotonic()
        rank0.stdin.write("go\n")
        rank0.stdin.flush()
        line = rank0.stdout.readline()
        assert time.monotonic() - start < 30
        assert line.startswith("TensorParallelError: tensor-parallel step failed"), line
        assert "rank 1 (pid" in line and "torchrun" in line, line
        assert rank0.wait(30) == 0
    finally:
        _end(procs)


def test_dead_rank0_ends_worker(checkpoint, reference, tmp_path):
    rank0, rank1 = procs = _start_pair(checkpoint, tmp_path / "out")
    try:
        assert json.loads(rank0.stdout.readline()) == reference
        rank0.send_signal(signal.SIGKILL)  # the worker idles on rank 0's store, which dies with it
        start = time.monotonic()
        code = rank1.wait(30)
        assert time.monotonic() - start < 15
        assert code != 0
        _, err = rank1.communicate(timeout=10)
        assert "TensorParallelError: tensor-parallel rank 1 of 2" in err, err[-2000:]
        assert not (tmp_path / "out.rank1").exists()
    finally:
        _end(procs)


def _set_launch(monkeypatch, **values: str) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in values.items():
        monkeypatch.setenv(k, v)


def test_world_size_must_equal_tensor_parallel_size(checkpoint, monkeypatch):
    _set_launch(monkeypatch, RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2, but .* WORLD_SIZE=3 .* must be equal"):
        LLM(load_model(checkpoint), page_size=4, num_pages=8, tensor_parallel_size=2)


def test_incomplete_launch_environment_is_refused(monkeypatch):
    _set_launch(monkeypatch, RANK="1", WORLD_SIZE="2")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT are not; start every rank with torchrun"):
        launch_env()
    _set_launch(monkeypatch, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")  # spawned workers' store, not a launch
    assert launch_env() is None


def test_worker_refuses_a_different_model(checkpoint):
    fields = dict(port=1, num_pages=8, page_size=4, kv_cache_dtype=None, threads=1, timeout_s=1.0, idle_timeout_s=1.0)
    plan: GroupPlan = plan_for(load_model(checkpoint), [], **fields)
    env = LaunchEnv(rank=1, world=2, local_rank=1, master_addr="127.0.0.1", master_port=1)
    _check_same_model(plan, load_model(checkpoint), env)  # the same load passes
    with pytest.raises(TensorParallelError, match="rank 1 loaded a different model than rank 0 .*float32.*bfloat16"):
        _check_same_model(plan, load_model(checkpoint, dtype="bfloat16"), env)
