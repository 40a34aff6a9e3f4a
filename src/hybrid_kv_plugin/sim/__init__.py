"""Drive the installed wheel's real ``Scheduler`` + ``KVCacheManager`` (+ connector) on a CPU.

No model runs: a step feeds the scheduler a hand-made ``ModelRunnerOutput`` and, for
the SimpleCPU connectors, completes the connector's transfers the way its worker
would report them. Used by the tests and by ``hybrid-kv replay``.
"""

from hybrid_kv_plugin.sim.engine import SimEngine, StepRecord
from hybrid_kv_plugin.sim.geometry import HybridGeometry

__all__ = ["HybridGeometry", "SimEngine", "StepRecord"]
