"""Fine-grained hybrid prefix hits through SimpleCPU CPU offload (vLLM PR #54736).

``stats``: the boundary-store counters, with the same fields on every wheel.
``metrics``: Prometheus export of those counters where the wheel has none (0.29, 0.30).
``fine_grained_scheduler``: the 0.29 scheduler side (a ``SimpleCPUOffloadScheduler`` subclass).
``mode``: which of stock / native / backport a connector instance runs.
"""
