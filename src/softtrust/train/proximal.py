"""The decoupled objective's proximal policy pi_prox (``--proximal``, AReaL, arXiv 2505.24298):
which options go together, and the versions and log-linear weight of ``loglinear``.

Versions are learner steps (optimizer updates): ``v_mu`` the weights that sampled a batch,
``v_theta`` the weights the learner's forward runs with (the step), ``v_prox`` the weights
pi_prox stands for: the batch's first update for ``recompute`` and ``loglinear`` (so with
``--updates-per-batch U`` it is held over the batch's U updates), the snapshot's step for
``held``. ``config.py`` and ``learner.py`` import this module, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from softtrust.methods import METHODS

if TYPE_CHECKING:
    from .config import TrainConfig

PROXIMAL = ("none", "recompute", "loglinear", "held")


def check_proximal_options(config: TrainConfig, need: Callable[[bool, str, str], None]) -> None:
    """``--proximal``, ``--proximal-every`` and ``--updates-per-batch`` (``need(condition, field,
    message)`` raises naming the field): the decoupled objective is for async mode and a method
    that takes pi_prox, in one forward per mini-batch; ``held`` and ``--proximal-every`` go
    together; several updates per fetched batch are async mode's (sync mode's ``--staleness N``
    already splits a rollout into N updates)."""
    need(config.proximal in PROXIMAL, "proximal", f"choose one of {PROXIMAL}")
    need(
        config.proximal == "none" or config.mode == "async",
        "proximal",
        "the decoupled objective is for --mode async (there the behaviour policy is the rollout "
        "worker's); in sync mode use --proximal none",
    )
    need(
        config.proximal == "none" or METHODS[config.method].supports_proximal,
        "proximal",
        f"{METHODS[config.method].proximal_note}; use --proximal none",
    )
    need(
        (config.proximal == "held") == (config.proximal_every > 0),
        "proximal_every" if config.proximal != "held" else "proximal",
        "--proximal held needs --proximal-every M >= 1, and --proximal-every is for --proximal held only",
    )
    need(
        config.proximal == "none" or not config.micro_batch_size,
        "proximal",
        "the decoupled objective takes the whole mini-batch in one forward; drop --micro-batch-size",
    )
    need(
        config.updates_per_batch == 1 or config.mode == "async",
        "updates_per_batch",
        "several updates per fetched batch are for --mode async; in sync mode --staleness N already "
        "splits each rollout into N updates with pi_old held over them (use --staleness)",
    )


def loglinear_alpha(behaviour_version: int, proximal_version: int, current_version: int) -> float:
    """AReaL's interpolation weight ``α = (v_prox − v_μ) / (v_θ − v_μ)`` (arXiv 2505.24298's
    decoupled objective, AReaL ``prox_logp_method="loglinear"``), so that
    ``log π_prox ≈ log μ + α·(log π_θ − log μ)`` without a forward of π_prox.

    ``v_θ`` is the version of the weights the learner's forward ran with, ``v_prox`` the
    version π_prox stands for, ``v_μ`` the behaviour (sampler) version;
    ``v_μ <= v_prox <= v_θ``. softtrust's learner runs its forward with the weights before
    the optimizer step, and π_prox is the weights at the fetched batch's first update, so
    on that update ``v_θ = v_prox`` and ``α = 1``: ``log π_prox = sg(log π_θ)``, exact (with
    one update per batch, every update). Update ``u`` of a batch (``--updates-per-batch``)
    has ``v_θ = v_prox + u``, ``α = lag₀/(lag₀ + u)`` with ``lag₀`` the first update's lag:
    an approximation. At ``v_μ = v_θ`` (``0/0``) all three policies are one, so every α
    gives the same value; α = 1 is returned (the limit of the lag > 0 case). AReaL labels
    the training policy ``v_θ = v_prox + 1`` whatever the mini-batch (its versions count
    batches), which gives ``α = lag/(lag + 1)`` and, when ``π_θ`` is in fact still
    ``π_prox``, an error ``(log π_prox − log μ)/(lag + 1)`` per token.

    Raises:
        ValueError: versions not integers >= 0 in the order ``v_μ <= v_prox <= v_θ``.
    """
    versions = {"behaviour_version": behaviour_version, "proximal_version": proximal_version}
    versions["current_version"] = current_version
    for name, value in versions.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if not behaviour_version <= proximal_version <= current_version:
        raise ValueError(
            f"versions must satisfy behaviour <= proximal <= current, got {behaviour_version}, "
            f"{proximal_version}, {current_version}"
        )
    if current_version == behaviour_version:
        return 1.0
    return (proximal_version - behaviour_version) / (current_version - behaviour_version)


def batch_versions(policy_version: int, lag: int, minibatch_index: int) -> tuple[int, int, int]:
    """``(v_μ, v_prox, v_θ)`` of an update of a fetched batch: the rows' version, the step of
    the batch's first update (``recompute`` / ``loglinear``'s π_prox) and the learner's step
    (``policy_version + lag``); ``minibatch_index`` is the update's position in its batch."""
    step = policy_version + lag
    return policy_version, step - minibatch_index, step
