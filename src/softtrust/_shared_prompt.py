"""The model body over prompt + completion, running each distinct prompt once.

GRPO scores G completions of every prompt: the rows come in groups of G that share their
prompt, and a plain forward over ``[B, P + K]`` runs every prompt G times. With a KV cache
the prompt runs once per group and its keys and values are repeated G times for the
completion positions (``transformers``' ``Cache.batch_repeat_interleave``); the backward
sums the G copies' gradients into the one prompt pass. Same function, G x less prompt work
(for a chat template's system prompt and a short completion, the prompt is most of the tokens).

Position ids are the body's defaults in both forms (``0 .. P+K-1``), and the attention mask
covers the cached prompt and the completion, so the hidden states equal the plain forward's
up to float rounding (tested in float64).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def cache_argument(module: Any) -> str:
    """The name a ``transformers`` forward takes its KV cache by: ``cache`` (>= 5) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def prompt_group_size(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, prompt_length: int
) -> int:
    """G when the rows are consecutive groups of G copies of one prompt (ids and mask), else 1."""
    batch = input_ids.shape[0]
    if batch < 2 or prompt_length < 1:
        return 1
    prompts = input_ids[:, :prompt_length]
    if attention_mask is not None:
        prompts = torch.cat([prompts, attention_mask[:, :prompt_length].to(prompts.dtype)], dim=-1)
    same_as_first = (prompts == prompts[0]).all(dim=-1)
    group = int(same_as_first.long().cumprod(0).sum())  # the first run of rows equal to row 0
    if group < 2 or batch % group:
        return 1
    return group if torch.equal(prompts, prompts[::group].repeat_interleave(group, 0)) else 1


def completion_hidden(
    body: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    completion_length: int,
    share_prompts: bool = True,
) -> torch.Tensor:
    """``[B, K, d]`` hidden states at the positions that predict the last K tokens (``P - 1 .. L - 2``).

    With ``share_prompts`` and rows in groups of one prompt (:func:`prompt_group_size`),
    the prompt runs once per group; otherwise (or when the body returns no cache, e.g.
    under gradient checkpointing) one plain forward over every row.
    """
    length = input_ids.shape[1]
    prompt = length - completion_length
    group = prompt_group_size(input_ids, attention_mask, prompt) if share_prompts else 1
    if group > 1 and not getattr(body, "gradient_checkpointing", False):
        name = cache_argument(body)
        rows = slice(None, None, group)
        first = body(
            input_ids=input_ids[rows, :prompt],
            attention_mask=None if attention_mask is None else attention_mask[rows, :prompt],
            use_cache=True,
        )
        cache = getattr(first, name, None)
        if cache is not None:
            last = first.last_hidden_state[:, -1:].repeat_interleave(group, 0)  # predicts token P
            if completion_length == 1:
                return last
            cache.batch_repeat_interleave(group)
            rest = body(
                input_ids=input_ids[:, prompt:-1],
                attention_mask=None if attention_mask is None else attention_mask[:, :-1],
                use_cache=True,
                **{name: cache},
            )
            return torch.cat([last, rest.last_hidden_state], dim=1)
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return outputs.last_hidden_state[:, -completion_length - 1 : -1]
