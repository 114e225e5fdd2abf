"""The scheduler alone (no model): token budget, decodes before prompt chunks, FCFS admission, preemption."""

from __future__ import annotations

from tessera.engine import SamplingParams, Scheduler, Sequence
from tessera.engine.sequence import Status
from tessera.kv import BlockManager


def _seq(seq_id: int, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id, list(range(10, 10 + n)), SamplingParams(temperature=0.0, max_tokens=max_tokens), (),
                    max_len=1000)


def _run(sched: Scheduler, token: int = 7) -> list[tuple[int, int, int]]:
    """One step with a fake model that always samples ``token``; returns (seq_id, start, num_new) scheduled."""
    out = sched.schedule()
    sampled = {item.seq.seq_id: (token, 0.0) for item in out.scheduled if item.samples}
    sched.update(out, sampled)
    return [(i.seq.seq_id, i.start, i.num_new) for i in out.scheduled]


def test_chunked_prefill_and_decodes_first():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(_seq(0, 6))
    sched.add(_seq(1, 15))
    assert _run(sched) == [(0, 0, 6), (1, 0, 4)]        # FCFS; the second prompt is cut to the budget
    assert _run(sched) == [(0, 6, 1), (1, 4, 9)]        # the decode comes first, then the next chunk
    assert _run(sched) == [(0, 7, 1), (1, 13, 2)]
    assert _run(sched) == [(0, 8, 1), (1, 15, 1)]


def test_max_num_seqs_and_fcfs():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(_seq(i, 3, max_tokens=2))
    assert [s for s, _, _ in _run(sched)] == [0, 1]
    assert [s for s, _, _ in _run(sched)] == [0, 1]     # both finish (2 tokens each), freeing their places
    assert _run(sched) == [(2, 0, 3)]
    assert sched.block_manager.num_free_pages == 64 - 1


def test_preemption_frees_the_youngest_and_requeues_it_first():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = _seq(0, 4), _seq(1, 4), _seq(2, 9)
    for s in (a, b, c):
        sched.add(s)
    assert _run(sched) == [(0, 0, 4), (1, 0, 4)]        # c (3 pages) does not fit next to a and b
    # a and b each need a second page for their decode token: only 2 pages are left for them, fine
    assert _run(sched) == [(0, 4, 1), (1, 4, 1)]
    for _ in range(3):
        _run(sched)                                     # 8 tokens each in the cache, a 9th sampled
    out = sched.schedule()                              # both need a third page: b, the youngest, is preempted
    assert [i.seq.seq_id for i in out.scheduled] == [0] and out.preempted == [b]
    assert b.status is Status.WAITING and sched.waiting[0] is b and b.num_computed == 0
    assert len(b.output_ids) == 5 and b.num_tokens == 9  # its generated tokens stay, to be recomputed as prompt
    assert bm.num_free_pages == 1
