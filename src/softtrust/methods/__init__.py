"""Trust-region and importance-weight shaping methods: one small frozen dataclass each.

| module | what | methods |
| --- | --- | --- |
| :mod:`~softtrust.methods.base` | the interface: :class:`LossContext`, :class:`Method`, the registry | |
| :mod:`~softtrust.methods.trust_region` | the ratio is in the graph, bounded or damped | Clip, GSPO, SAPO, PSPO, CFPO, GMPO, DRO |
| :mod:`~softtrust.methods.reweighting` | REINFORCE with a detached weight | CISPO, VESPO, DPPO, TOPR, REINFORCE |
| :mod:`~softtrust.methods.covariance` | a batch-wide selection by log-prob/advantage covariance | KLCov, ClipCov |
| :mod:`~softtrust.methods.selection` | a batch-wide selection (``batch_state``) applied per token | M2PO, BAPO |

Adding a method: see ``docs/adding_a_method.md``. Importing this package registers
every method in :data:`METHODS`, the one list of names the CLI, the config, the
adapters and the tests read.
"""

from softtrust.methods.base import (
    METHODS,
    DetachedWeightMethod,
    LossContext,
    Method,
    MethodOutput,
    make_method,
    register_method,
)
from softtrust.methods.covariance import ClipCov, KLCov
from softtrust.methods.reweighting import CISPO, DPPO, REINFORCE, TOPR, VESPO, VESPO_LOG_W_FLOOR
from softtrust.methods.selection import BAPO, M2PO
from softtrust.methods.trust_region import CFPO, DRO, GMPO, GSPO, PSPO, SAPO, Clip

__all__ = [
    "BAPO",
    "CFPO",
    "CISPO",
    "DPPO",
    "DRO",
    "GMPO",
    "GSPO",
    "M2PO",
    "METHODS",
    "PSPO",
    "REINFORCE",
    "SAPO",
    "TOPR",
    "VESPO",
    "VESPO_LOG_W_FLOOR",
    "Clip",
    "ClipCov",
    "DetachedWeightMethod",
    "KLCov",
    "LossContext",
    "Method",
    "MethodOutput",
    "make_method",
    "register_method",
]
