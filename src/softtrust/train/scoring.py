"""How the trainer scores completions: the one log-prob function and the learner's micro-batches.

Every log-prob the trainer computes goes through :func:`completion_logprobs_of`: the
behaviour policy's at rollout time, the learner's in the update, a proximal snapshot's
(π_prox) and the KL reference's. One function, so that at lag 0 the ratio is exactly 1 and a
snapshot is scored exactly as the policy it copies. :func:`row_pieces` cuts a mini-batch into
the learner's micro-batches; the behaviour forward runs in the same pieces, so each row runs
with the shapes it has in the update.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from softtrust.logprobs import completion_logprobs


class Scoring(NamedTuple):
    """The policy the sampler draws from, which the learner scores: logits divided by
    ``temperature``, truncated to the ``top_k`` most likely tokens or the ``top_p`` nucleus."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None


UNTRUNCATED = Scoring()  # temperature 1, the full softmax


class LogProbs(NamedTuple):
    """``[B, T]`` float32 completion log-probs (0 at masked positions), and the ``[B, T]``
    per-token entropies when asked for (else ``None``)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


def completion_logprobs_of(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    scoring: Scoring = UNTRUNCATED,
    with_entropy: bool = False,
) -> LogProbs:
    """The log-probs of the last ``completion_length`` tokens of ``input_ids`` under ``model``.

    ``model``: a causal LM (the policy in one process, a proximal snapshot, the reference), or
    the DDP / FSDP2 wrapper of ``distributed.PolicyForward``, whose forward calls this function
    on the model it wraps (so gradients flow through the wrapper's hooks). Position ``t``
    predicts token ``t + 1``; masked completion positions hold 0. The work is
    ``softtrust.completion_logprobs``: the ``[B, T, V]`` logits are never built.

    Args:
        input_ids, attention_mask: ``[B, L]`` prompt + completion, left-padded prompts.
        completion_length: ``T``, the completion's padded width.
        scoring: temperature and truncation (``Scoring``).
        with_entropy: also return the per-token entropy of the scored policy.
    """
    if getattr(getattr(model, "module", model), "wraps_causal_lm", False):
        return model(
            input_ids,
            attention_mask,
            completion_length=completion_length,
            scoring=scoring,
            with_entropy=with_entropy,
        )
    result = completion_logprobs(
        model,
        input_ids,
        attention_mask,
        completion_length,
        completion_mask=attention_mask[:, -completion_length:],  # [B, T]
        temperature=scoring.temperature,
        with_entropy=with_entropy,
        top_k=scoring.top_k,
        top_p=scoring.top_p,
    )
    return LogProbs(*result) if with_entropy else LogProbs(result)


def row_pieces(rows: int, micro_batch_size: int | None) -> list[slice]:
    """The learner's micro-batches of a mini-batch of ``rows`` rows (``--micro-batch-size``;
    0 or None: one piece)."""
    size = micro_batch_size or rows
    return [slice(start, start + size) for start in range(0, rows, size)] or [slice(0, 0)]
