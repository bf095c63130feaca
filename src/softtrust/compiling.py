"""``compile_loss``: ``torch.compile`` for one loss, with a recompile budget of its own.

Dynamo keeps its compiled graphs (and counts recompilations) per Python code object. Every
callable *object* given to ``torch.compile`` (a :class:`~softtrust.PolicyLoss`, or any
object with ``__call__``) is entered through one shared wrapper frame of torch's, so every
compiled loss of a process shares one cache: each distinct loss (another method, level,
correction, or hyperparameter value: they are constants of the graph) adds an entry, and
the 9th raises ``FailOnRecompileLimitHit`` under ``fullgraph=True`` (without it, the loss
falls back to eager with a warning). :func:`compile_loss` calls the loss from a function
whose code object is new for each call, so each compiled loss has the full
``torch._dynamo.config.recompile_limit`` (8 by default) for itself: one per input shape
class and dtype it meets, not one per loss of the process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile_loss"]


def compile_loss(loss_fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile(loss_fn, **options)`` with a compile cache of its own (see the module docstring).

    Example::

        compiled = st.compile_loss(st.PolicyLoss("vespo"), fullgraph=True)
        out = compiled(logprobs, old_logprobs, advantages, mask)

    Args:
        loss_fn: a :class:`~softtrust.PolicyLoss` (or any callable).
        **options: passed to ``torch.compile`` (``fullgraph``, ``backend``, ``mode``, ``dynamic``).

    Returns:
        A function with ``loss_fn``'s call signature; values and gradients are eager's.
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable (a PolicyLoss), got {type(loss_fn).__name__}")

    def compiled_loss(*args: Any, **kwargs: Any) -> Any:
        return loss_fn(*args, **kwargs)

    # a new code object: dynamo's cache and recompile count live on it, so this loss's own
    compiled_loss.__code__ = compiled_loss.__code__.replace(co_name=f"compiled_{type(loss_fn).__name__}")
    return torch.compile(compiled_loss, **options)
