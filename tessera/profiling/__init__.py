"""Where an LLM step spends its time: per-op accounting (calls, wall time, FLOPs, bytes) and a traced request.

:func:`account_ops` wraps the kernel call points of a forward step; :func:`profile_request` runs one request of a
:class:`tessera.engine.LLM` under ``torch.profiler`` with the accounting on and writes a Chrome/Perfetto trace.
``tessera profile`` (:mod:`tessera.tools.profile`) prints the result against the roofline of this CPU.

Examples
--------
>>> from tessera.profiling import account_ops
>>> with account_ops() as acct:
...     model.logits(ids)
>>> acct.stats["matmul"].flops
"""

from tessera.profiling.accounting import (
    COMM_OPS,
    TARGETS,
    OpAccounting,
    OpStats,
    account_ops,
    force_unfused,
    targets,
)
from tessera.profiling.tracer import ProfileResult, profile_request

__all__ = ["COMM_OPS", "TARGETS", "OpAccounting", "OpStats", "ProfileResult", "account_ops", "force_unfused", "profile_request",
           "targets"]
