"""Trust-region and importance-weight shaping methods: one small frozen dataclass each.

| module | what | e.g. |
| --- | --- | --- |
| :mod:`~softtrust.methods.base` | the interface: :class:`LossContext`, :class:`Method`, the registry | |
| :mod:`~softtrust.methods.trust_region` | the ratio is in the graph, bounded or damped | Clip, GSPO, SAPO |
| :mod:`~softtrust.methods.reweighting` | REINFORCE with a detached weight | CISPO, VESPO |
| :mod:`~softtrust.methods.covariance` | a batch-wide selection by log-prob/advantage covariance | KLCov, ClipCov |
| :mod:`~softtrust.methods.selection` | a batch-wide selection (``batch_state``) applied per token | M2PO, BAPO |

Each module's ``__all__`` names its methods; this package re-exports them all in its own
``__all__``, and ``softtrust`` re-exports that: a method added to one of these modules needs
no edit here or in ``softtrust/__init__.py``. Adding a method: see ``docs/adding_a_method.md``.
Importing this package registers every method in :data:`METHODS`, the one list of names the
CLI, the config, the adapters, the docs' method lists and the tests read.
"""

from softtrust.methods import base, covariance, reweighting, selection, trust_region
from softtrust.methods.base import *  # noqa: F403
from softtrust.methods.covariance import *  # noqa: F403
from softtrust.methods.reweighting import *  # noqa: F403
from softtrust.methods.reweighting import VESPO_LOG_W_FLOOR as VESPO_LOG_W_FLOOR
from softtrust.methods.selection import *  # noqa: F403
from softtrust.methods.trust_region import *  # noqa: F403

__all__ = [
    *base.__all__,
    *trust_region.__all__,
    *reweighting.__all__,
    *covariance.__all__,
    *selection.__all__,
]
