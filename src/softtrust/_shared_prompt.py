"""The model body over prompt + completion, running each distinct prompt once.

GRPO scores G completions of every prompt: consecutive rows share their prompt, and a plain
forward over ``[B, P + K]`` runs every prompt G times. With a KV cache each run of equal
prompts is computed once and its keys and values are selected for every row of the run
(``transformers``' ``Cache.batch_select_indices``); the backward sums the copies' gradients
into the one prompt pass. Same function, G x less prompt work (for a chat template's system
prompt and a short completion, the prompt is most of the tokens).

Position ids are the body's defaults in both forms (``0 .. P+K-1``), and the attention mask
covers the cached prompt and the completion, so the hidden states equal the plain forward's
(exactly in float64; tested). A row's prompt is computed the same way whichever other rows
share the batch, so a micro-batch that splits a group gives its rows the same numbers.

Not shared (one plain forward instead): activation checkpointing (transformers' or
``torch``'s ``checkpoint_wrapper``: the recomputation would write the cache twice), dropout
active in training mode (the copies would share one dropout draw), a 4-D attention mask,
and FSDP-sharded parameters (``DTensor``: two forwards would all-gather every layer twice).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def cache_argument(module: Any) -> str:
    """The name a ``transformers`` forward takes its KV cache by: ``cache`` (>= 5) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, prompt_length: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Runs of consecutive rows with the same prompt (ids and mask): ``(first_rows, index)`` or None.

    ``first_rows`` [R]: the first row of each run; ``index`` [B]: the run of each row
    (``0, 0, 0, 1, 1, ...``). None when no two consecutive rows share their prompt.
    """
    batch = input_ids.shape[0]
    if batch < 2 or prompt_length < 1:
        return None
    prompts = input_ids[:, :prompt_length]
    if attention_mask is not None:
        prompts = torch.cat([prompts, attention_mask[:, :prompt_length].to(prompts.dtype)], dim=-1)
    starts = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    starts[1:] = (prompts[1:] != prompts[:-1]).any(dim=-1)
    if bool(starts.all()):
        return None
    return starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1


def can_share(body: Any) -> bool:
    """Whether to run each prompt once: exact for this body, and no extra parameter gathers (module docstring)."""
    if body.training and float(getattr(getattr(body, "config", None), "attention_dropout", 0.0) or 0.0) > 0:
        return False
    for module in body.modules():
        if getattr(module, "gradient_checkpointing", False) or hasattr(module, "_checkpoint_wrapped_module"):
            return False
        if module.training and isinstance(module, torch.nn.Dropout) and module.p > 0:
            return False
    parameter = next(body.parameters(), None)
    return parameter is None or type(parameter).__name__ != "DTensor"


def completion_hidden(
    body: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    completion_length: int,
    share_prompts: bool = True,
) -> torch.Tensor:
    """``[B, K, d]`` hidden states at the positions that predict the last K tokens (``P - 1 .. L - 2``).

    With ``share_prompts``, rows in runs of one prompt (:func:`prompt_groups`) and a body
    where sharing is exact (:func:`can_share`), each prompt runs once; otherwise (or when
    the body returns no cache) one plain forward over every row.
    """
    prompt = input_ids.shape[1] - completion_length
    two_dim = attention_mask is None or attention_mask.dim() == 2
    groups = prompt_groups(input_ids, attention_mask, prompt) if share_prompts and two_dim else None
    if groups is not None and can_share(body):
        first_rows, index = groups
        name = cache_argument(body)
        first = body(
            input_ids=input_ids[first_rows, :prompt],
            attention_mask=None if attention_mask is None else attention_mask[first_rows, :prompt],
            use_cache=True,
        )
        cache = getattr(first, name, None)
        if cache is not None:
            last = first.last_hidden_state[index, -1:]  # predicts token P
            if completion_length == 1:
                return last
            cache.batch_select_indices(index)
            rest = body(
                input_ids=input_ids[:, prompt:-1],
                attention_mask=None if attention_mask is None else attention_mask[:, :-1],
                use_cache=True,
                **{name: cache},
            )
            return torch.cat([last, rest.last_hidden_state], dim=1)
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return outputs.last_hidden_state[:, -completion_length - 1 : -1]
