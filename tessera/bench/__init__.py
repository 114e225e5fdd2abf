"""``tessera bench``: every benchmark suite through one harness, with machine ceilings measured in the same run.

A suite (``tessera.bench.suites``) yields :class:`~tessera.bench.harness.Case` objects: our call, the baseline's
call on the same inputs, and the FLOPs and bytes one call does. :func:`~tessera.bench.harness.run_cases` times each
pair interleaved (median of repeated runs, spread as the interquartile range), and the report expresses every result
as a rate, a fraction of this run's measured ceilings, a ratio to its baseline and the roofline's prediction.
:mod:`~tessera.bench.compare` diffs two result files; :mod:`~tessera.bench.plot` draws them.
"""

from tessera.bench.harness import Case, Result, measure, run_cases

__all__ = ["Case", "Result", "measure", "run_cases"]
