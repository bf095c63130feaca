"""Memory-lean token log-probs: LM head -> log-softmax -> gather, without the (N, V) logits.

Turning hidden states into per-token log-probs is where RL for LLMs spends its memory:
with a vocabulary of 32k-152k entries, the unfused ``log_softmax(hidden @ W.T).gather``
holds the (N, V) fp32 logits several times over (the logits, the log-softmax saved for
backward, the zero-filled gather gradient, the logits gradient). ``token_logprobs``
never builds them. It streams over tiles of ``chunk_size`` tokens by
``vocab_chunk_size`` vocabulary entries, folds each tile into a running (online)
log-sum-exp, and in backward recomputes each tile's logits instead of storing them.
Only O(N) fp32 values are saved for backward: the log-sum-exp and the entropy per row.
On CUDA, with triton installed (it ships with PyTorch's CUDA wheels), two Triton kernels
(:mod:`softtrust._triton`) do each tile's elementwise work when there is no LM-head bias
and no entropy: one pass to fold a tile in forward, one to write its gradient in
backward. ``SOFTTRUST_TRITON=0`` keeps the PyTorch tile ops.

This module holds the public functions, their input checks, the tile sizes and the
autograd Function whose forward and backward loop over the tiles; the ops on one tile
(logits, gradient, online log-sum-exp, buffers, dtype rules) are in :mod:`softtrust._tiles`.

Math, for one row with hidden state ``h``, labels ``y`` and temperature ``T``::

    z_j     = (h · W_j + b_j) / T                       logits, j in [0, V)
    log p_y = z_y - logsumexp(z)
    H       = logsumexp(z) - Σ_j p_j z_j                 entropy of the same distribution
    ∂ log p_y / ∂ z_j = 1[j = y] - p_j
    ∂ H / ∂ z_j       = -p_j (log p_j + H)
    ∂ z_j / ∂ (h · W_j + b_j) = 1 / T

so with upstream gradients ``g`` (log-prob) and ``e`` (entropy) the logits gradient is
``dz_j = (g (1[j = y] - p_j) - e p_j (log p_j + H)) / T`` and the three parameter
gradients are two GEMMs and a column sum: ``dh = dz @ W``, ``dW = dzᵀ @ h``, ``db = Σ dz``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from softtrust import _triton
from softtrust._shared_prompt import completion_hidden
from softtrust._tiles import (
    _accumulation_dtype,
    _add_matmul,
    _autocast_off,
    _gemm_dtype,
    _GemmSum,
    _grads_out,
    _logits_grad_tile,
    _logits_tile,
    _OnlineLogSumExp,
    _OnlineLogSumExpEntropy,
    _row_scale,
    _scatter_rows,
    _spans,
    _Workspace,
)
from softtrust._validation import check_number, check_shape
from softtrust.truncation import check_truncation, truncated_row_statistics, truncates, unpack_bits

IGNORE_INDEX = -100
# One tile holds at most this many logits: 4 Mi entries, 16 MiB in fp32 (2048 tokens x 2048
# vocabulary entries), next to N x V for the unfused path. Every op on a tile pays a fixed
# cost (thread synchronisation on CPU, a kernel launch on GPU), so tiles must not be tiny;
# but a tile that stays in the CPU's last-level cache makes its elementwise passes (max,
# exp, sum; exp again in backward) and the GEMM that reads it back cheaper. Measured on a
# 2-core EPYC (`bench_logprobs.py --tiles`, docs/benchmarks.md): 2048 x 2048 tiles ran
# forward + backward 0.93-1.21x the unfused path, 1024 x 8192 tiles 0.95-1.27x, 512 x 2048 0.99-1.27x.
TILE_ELEMENTS = 1 << 22
# Vocabularies larger than this are split into chunks folded by the online log-sum-exp.
DEFAULT_VOCAB_CHUNK_SIZE = 2048
# On a GPU the same 2048 x 2048 tiles leave it waiting on kernel launches: on an H200
# (`bench_gpu.py`, docs/benchmarks_gpu.md) they ran 7.7-13.8x the unfused path in bf16
# with PyTorch tile ops, 8192 x 16384 tiles 1.45-2.7x. Off the CPU a tile holds up to
# 128 Mi logits (512 MiB in fp32), VOCAB_CHUNK_SIZE_GPU vocabulary entries wide; wider
# chunks are faster at small N but hold more than 25% of the unfused path's memory there.
TILE_ELEMENTS_GPU = 1 << 27
VOCAB_CHUNK_SIZE_GPU = 8192
# The top-k/top-p forward runs blocks of whole rows, rows x V logits, one GEMM each. Few rows
# make a slow GEMM (W is read once per block: on 2 EPYC cores, V = 151,936, 9.6 ms a row at
# 27 rows, 5.1 at 110), but the support's per-row sort holds about 20 bytes per logit next
# to the logits (sorted values, int64 sort indices, softmax, cumulative sum): 8 Mi logits
# a block on CPU (55 rows at V = 151,936, about 200 MiB with its sort), 32 Mi elsewhere.
TRUNCATED_TILE_ELEMENTS = 1 << 23
TRUNCATED_TILE_ELEMENTS_GPU = 1 << 25
_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    with_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Equal to ``log_softmax((hidden @ weight.T + bias) / temperature, -1).gather(labels)``
    in value and gradient, but the (N, V) logits never exist: tiles of
    ``chunk_size x vocab_chunk_size`` logits are computed, folded into a running
    log-sum-exp and dropped, then recomputed in backward. Memory: the unfused path
    holds N x V fp32 logits several times over; this holds one tile plus O(N) floats.

    The math runs in float32 whatever the input dtype (bf16 GEMM outputs are upcast
    per tile), in float64 when the inputs are float64. Under autocast the GEMMs run
    in the autocast dtype.

    Args:
        hidden: [N, d] or [B, T, d] (any leading shape) final hidden states, any float dtype.
        weight: [V, d] LM-head weight (``lm_head.weight``).
        labels: integer tensor of shape ``hidden.shape[:-1]``: the token whose
            log-prob each row scores, in ``[0, V)`` or equal to ``ignore_index``.
        bias: optional [V] LM-head bias.
        temperature: logits are divided by it (> 0).
        chunk_size: tokens per tile (> 0). Default: ``TILE_ELEMENTS // vocab_chunk_size``
            on CPU (2048), ``TILE_ELEMENTS_GPU // vocab_chunk_size`` on other devices.
        vocab_chunk_size: vocabulary entries per tile (> 0). Default: ``V`` up to
            ``DEFAULT_VOCAB_CHUNK_SIZE`` (CPU) or ``VOCAB_CHUNK_SIZE_GPU`` (other devices),
            chunks of that size above.
        with_entropy: also return the entropy of each row's distribution.
        ignore_index: rows with this label are skipped entirely (never go through the
            LM head): log-prob 0, entropy 0, zero gradient, whatever their label.
        top_k: score the truncated policy of top-k sampling (an int >= 1), or None.
        top_p: score the truncated policy of top-p (nucleus) sampling (in (0, 1]), or None.

    Truncated sampling (``top_k`` / ``top_p``): the policy scored is the one a top-k/top-p
    sampler draws from, ``π̃_j = p_j / Σ_{i∈S} p_i`` on its support ``S``. ``S`` is
    recomputed from the current logits ``z = (h·W + b) / T`` by
    :func:`softtrust.truncation.truncation_threshold`, the rule the sampler helpers
    (``truncated_log_softmax``, ``sample_truncated``) use: temperature, then top-k (every
    logit >= the k-th largest is kept, ties included), then top-p on the top-k-renormalised
    row (HF/vLLM: drop the ascending-sorted prefix whose cumulative probability is
    <= 1 - top_p, never the largest logit; ties with the smallest kept logit are kept).
    Then ``log π̃_y = z_y - log Σ_{j∈S∪{y}} e^{z_j}``: on-policy (``y ∈ S``) the sampler's
    renormalised log-prob, so the ratio is 1; a stale label outside the current support
    gets a finite value below every supported token's (its probability had the support
    kept it), never -inf. The gradient is the log-softmax gradient over ``S ∪ {y}``
    (``S`` is piecewise constant in ``z``: no gradient through it); the entropy is that
    of ``π̃`` over ``S ∪ {y}``. ``top_k=None`` and ``top_p`` None or 1 (or ``top_k >= V``)
    take the default path, unchanged. The support needs whole rows: the forward runs
    blocks of ``rows x V`` logits, one GEMM each, with ``rows = chunk_size`` or
    ``TRUNCATED_TILE_ELEMENTS // V`` (``_GPU`` off the CPU), plus a ``topk`` (top-k) or a
    per-row sort (top-p) per block; it saves the support packed, 1 bit per logit, and
    backward runs the default tiles with the support read from it (no Triton kernels).
    Memory above the default path: the packed support, ``N x V / 8`` bytes (19 MiB at
    N = 1024, V = 151,936), and one block with its sort, about 24 bytes per block logit
    (about 200 MiB on CPU, 800 MiB elsewhere, whatever N).

    Returns:
        ``logprobs`` of shape ``labels.shape``, float32 (float64 for float64 inputs);
        ``(logprobs, entropy)`` when ``with_entropy`` is true.
    """
    _check_inputs(hidden, weight, labels, bias, temperature, chunk_size, vocab_chunk_size, top_k, top_p)
    dim, vocab = hidden.shape[-1], weight.shape[0]
    flat_hidden = hidden.reshape(-1, dim)  # [N, d]
    flat_labels = labels.reshape(-1)  # [N]
    active = flat_labels != ignore_index  # [N]
    _check_label_range(flat_labels, active, vocab, ignore_index)

    # Gather the active rows first, so ignored rows never reach the LM head.
    rows = None if bool(active.all()) else active.nonzero().squeeze(1)  # [M]
    active_hidden = flat_hidden if rows is None else flat_hidden.index_select(0, rows)  # [M, d]
    active_labels = flat_labels if rows is None else flat_labels.index_select(0, rows)  # [M]

    tile_elements, default_vocab_chunk = default_tile(hidden.device)
    vocab_chunk = min(vocab_chunk_size or default_vocab_chunk, vocab)
    token_chunk = chunk_size or max(1, tile_elements // vocab_chunk)
    truncation = None
    if truncates(top_k, top_p, vocab):  # the support needs whole rows: forward blocks of rows x V logits
        truncation = (top_k, top_p, chunk_size or max(1, truncated_tile_elements(hidden.device) // vocab))
    outputs = _FusedLinearLogSoftmax.apply(
        active_hidden,
        weight,
        bias,
        active_labels.long(),
        1.0 / float(temperature),
        token_chunk,
        vocab_chunk,
        _gemm_dtype(hidden, weight),
        with_entropy,
        truncation,
    )
    outputs = outputs if with_entropy else (outputs,)
    outputs = tuple(_scatter_rows(x, rows, flat_labels.numel()).view(labels.shape) for x in outputs)
    return outputs if with_entropy else outputs[0]


def truncated_tile_elements(device: torch.device) -> int:
    """Logits per tile of the top-k/top-p path (tiles of whole rows): ``TRUNCATED_TILE_ELEMENTS`` on CPU, else ``_GPU``."""
    return TRUNCATED_TILE_ELEMENTS if device.type == "cpu" else TRUNCATED_TILE_ELEMENTS_GPU


def default_tile(device: torch.device) -> tuple[int, int]:
    """``(logits per tile, vocabulary chunk)`` of the default tiles on ``device``.

    CPU: ``(TILE_ELEMENTS, DEFAULT_VOCAB_CHUNK_SIZE)``, 2048 x 2048 tiles that stay in
    the last-level cache. Other devices: ``(TILE_ELEMENTS_GPU, VOCAB_CHUNK_SIZE_GPU)``,
    tiles large enough that each kernel has work for the whole GPU.
    """
    if device.type == "cpu":
        return TILE_ELEMENTS, DEFAULT_VOCAB_CHUNK_SIZE
    return TILE_ELEMENTS_GPU, VOCAB_CHUNK_SIZE_GPU


def completion_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int,
    *,
    completion_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    share_prompts: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the last ``logits_to_keep`` tokens of ``input_ids`` under a Hugging Face causal LM.

    Runs the model body only (``model.get_decoder()``), never its LM head, and scores
    the completion through ``token_logprobs`` with ``model.get_output_embeddings()``:
    hidden position ``t`` predicts token ``t + 1``. Differentiable w.r.t. the model
    parameters. Equal to
    ``log_softmax(model(input_ids, attention_mask).logits[:, -K-1:-1] / temperature).gather``
    with ``K = logits_to_keep``, without the (B, K, V) logits.

    Args:
        model: a ``transformers`` causal LM (``*ForCausalLM``) whose logits are the plain
            LM-head projection (no logit soft-capping or scaling).
        input_ids: [B, L] prompt + completion token ids.
        attention_mask: [B, L] attention mask, or None.
        logits_to_keep: K, the completion length, ``0 < K < L``.
        completion_mask: optional [B, K] mask; positions where it is 0 are skipped
            (log-prob 0, entropy 0, no gradient).
        temperature: logits are divided by it (> 0).
        with_entropy: also return the per-token entropy.
        chunk_size: tokens per tile, passed to ``token_logprobs``.
        top_k, top_p: score the truncated sampling policy (``token_logprobs``).
        share_prompts: when consecutive rows share their prompt (GRPO's G completions per
            prompt: same prompt ids and mask), run each prompt once and select its KV cache
            for every row (``softtrust._shared_prompt``; not under activation checkpointing
            or active dropout): the same log-probs and gradients up to float rounding, G x
            less prompt work.

    Returns:
        [B, K] float32 log-probs, and the [B, K] entropies when ``with_entropy``.
    """
    batch, length = input_ids.shape
    if not isinstance(logits_to_keep, int) or not 0 < logits_to_keep < length:
        raise ValueError(
            f"logits_to_keep must be an int in (0, {length}) for input_ids of shape {tuple(input_ids.shape)}, "
            f"got {logits_to_keep!r}"
        )
    _check_plain_lm_head(model)
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    # Position t predicts token t + 1, so the last position predicts nothing.
    hidden = completion_hidden(body, input_ids, attention_mask, logits_to_keep, share_prompts)  # [B, K, d]
    labels = input_ids[:, -logits_to_keep:]  # [B, K]
    if completion_mask is not None:
        check_shape("completion_mask", completion_mask, (batch, logits_to_keep), "(B, logits_to_keep)")
        labels = labels.masked_fill(completion_mask == 0, IGNORE_INDEX)  # [B, K]
    head = model.get_output_embeddings()
    return token_logprobs(
        hidden,
        head.weight,
        labels,
        bias=getattr(head, "bias", None),
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        top_k=top_k,
        top_p=top_p,
    )


class _FusedLinearLogSoftmax(torch.autograd.Function):
    """``(log p_y, H)`` of ``softmax((h @ W.T + b) * inv_temperature)`` over tiles; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [M, d]
        weight: torch.Tensor,  # [V, d]
        bias: torch.Tensor | None,  # [V]
        labels: torch.Tensor,  # [M] int64, all in [0, V)
        inv_temperature: float,
        token_chunk: int,
        vocab_chunk: int,
        gemm_dtype: torch.dtype,
        with_entropy: bool,
        truncation: tuple[int | None, float | None, int] | None,  # (top_k, top_p, forward rows per block)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # Entropy is often only logged: let its gradient arrive as None instead of zeros.
        ctx.set_materialize_grads(False)
        with _autocast_off(hidden.device):
            if truncation is None:
                support = None
                log_normalizer, logprobs, entropy = _fold_tiles(
                    hidden,
                    weight,
                    bias,
                    labels,
                    inv_temperature,
                    token_chunk,
                    vocab_chunk,
                    gemm_dtype,
                    with_entropy,
                )
            else:
                support, log_normalizer, logprobs, entropy = _truncated_rows(
                    hidden,
                    weight,
                    bias,
                    labels,
                    inv_temperature,
                    gemm_dtype,
                    with_entropy,
                    *truncation,
                )
        ctx.save_for_backward(hidden, weight, bias, labels, log_normalizer, entropy, support)
        ctx.config = (inv_temperature, token_chunk, vocab_chunk, gemm_dtype)
        return (logprobs, entropy) if with_entropy else logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None = None):
        hidden, weight, bias, labels, log_normalizer, entropy, support = ctx.saved_tensors
        inv_temperature, token_chunk, vocab_chunk, gemm_dtype = ctx.config
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        acc_dtype = log_normalizer.dtype
        grad_logprobs = None if grad_logprobs is None else grad_logprobs.to(acc_dtype)  # [M]
        grad_entropy = None if grad_entropy is None else grad_entropy.to(acc_dtype)  # [M]
        # Σ_c tile_c @ W_c, scaled by row_scale at the end (the scale is the same in every chunk).
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=acc_dtype) if needs_hidden else None  # [M, d]
        # No zero fill: every vocabulary chunk of the weight gradient is written exactly once.
        grad_weight = torch.empty_like(weight) if needs_weight else None  # [V, d]
        grad_bias = bias.new_zeros(bias.shape, dtype=acc_dtype) if needs_bias else None  # [V]
        if grad_logprobs is None and grad_entropy is None:
            if grad_weight is not None:
                grad_weight.zero_()
            return _grads_out(grad_hidden, grad_weight, grad_bias, hidden, bias)

        row_scale = _row_scale(grad_logprobs, grad_entropy, inv_temperature, log_normalizer)  # [M]
        # dWᵀ's right operand, row_scale ⊙ h, formed once for all vocabulary chunks.
        scaled_hidden = (hidden * row_scale.unsqueeze(1)).to(gemm_dtype) if needs_weight else None  # [M, d]
        token_spans = list(_spans(hidden.shape[0], token_chunk))
        workspace = _Workspace(hidden.device)
        kernels = grad_entropy is None and support is None and _kernels_apply(hidden, bias, acc_dtype)
        with _autocast_off(hidden.device):
            for v0, v1 in _spans(weight.shape[0], vocab_chunk):
                weight_chunk = weight[v0:v1].to(gemm_dtype)  # [v, d]
                bias_chunk = None if bias is None else bias[v0:v1].to(acc_dtype)  # [v]
                grad_weight_rows = None
                if grad_weight is not None:
                    grad_weight_rows = _GemmSum(
                        grad_weight[v0:v1], acc_dtype, terms=len(token_spans)
                    )  # [v, d]
                for n0, n1 in token_spans:
                    local_labels = labels[n0:n1] - v0  # [n]
                    if kernels:  # the GEMM, then one Triton kernel writes p - onehot in the GEMM dtype
                        raw = _logits_tile(
                            hidden[n0:n1], weight_chunk, None, 1.0, acc_dtype, workspace
                        )  # [n, v]
                        # fp32: in place; bf16: into the bf16 GEMM buffer, free again (as below)
                        out = (
                            raw if gemm_dtype == acc_dtype else workspace.tile("gemm", *raw.shape, gemm_dtype)
                        )
                        grad_tile = _triton.grad_tile(
                            raw, local_labels, inv_temperature, log_normalizer[n0:n1], out
                        )
                    else:
                        logits = _logits_tile(
                            hidden[n0:n1], weight_chunk, bias_chunk, inv_temperature, acc_dtype, workspace
                        )  # [n, v] recomputed
                        off_support = (  # top-k/top-p: the support the forward saw, S ∪ {y}
                            None if support is None else ~unpack_bits(support[n0:n1], v0, v1)
                        )  # [n, v]
                        grad_tile = _logits_grad_tile(
                            logits,
                            local_labels,
                            log_normalizer[n0:n1],
                            entropy[n0:n1],
                            None if grad_logprobs is None else grad_logprobs[n0:n1],
                            None if grad_entropy is None else grad_entropy[n0:n1],
                            workspace,
                            off_support,
                        )  # [n, v]
                        if grad_bias is not None:
                            grad_bias[v0:v1] += grad_tile.T @ row_scale[n0:n1]  # [v]
                        if gemm_dtype != acc_dtype:
                            # The GEMM output tile is free again: reuse it for the bf16 copy.
                            grad_tile = workspace.tile("gemm", *grad_tile.shape, gemm_dtype).copy_(grad_tile)
                    # dz = row_scale[:, None] * grad_tile, in the GEMM dtype
                    if grad_hidden is not None:
                        _add_matmul(grad_hidden[n0:n1], grad_tile, weight_chunk)  # [n, d]
                    if grad_weight_rows is not None:
                        grad_weight_rows.add(grad_tile.T, scaled_hidden[n0:n1])  # += dzᵀ @ h  [v, d]
                if grad_weight_rows is not None:
                    grad_weight_rows.close()
        if grad_hidden is not None:
            grad_hidden.mul_(row_scale.unsqueeze(1))  # dh = row_scale ⊙ Σ_c tile_c @ W_c
        return _grads_out(grad_hidden, grad_weight, grad_bias, hidden, bias)


def _fold_tiles(
    hidden: torch.Tensor,  # [M, d]
    weight: torch.Tensor,  # [V, d]
    bias: torch.Tensor | None,  # [V]
    labels: torch.Tensor,  # [M]
    inv_temperature: float,
    token_chunk: int,
    vocab_chunk: int,
    gemm_dtype: torch.dtype,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward over tiles: ``(logsumexp, log p_y, H or empty)`` per row, each [M]."""
    acc_dtype = _accumulation_dtype(gemm_dtype)
    state_type = _OnlineLogSumExpEntropy if with_entropy else _OnlineLogSumExp
    state = state_type.empty(hidden.shape[0], acc_dtype, hidden.device)
    workspace = _Workspace(hidden.device)
    kernels = not with_entropy and _kernels_apply(hidden, bias, acc_dtype)
    for v0, v1 in _spans(weight.shape[0], vocab_chunk):
        weight_chunk = weight[v0:v1].to(gemm_dtype)  # [v, d]
        bias_chunk = None if bias is None else bias[v0:v1].to(acc_dtype)  # [v]
        for n0, n1 in _spans(hidden.shape[0], token_chunk):
            local_labels = labels[n0:n1] - v0  # [n]
            if kernels:  # the GEMM, then one Triton kernel folds the tile (temperature included)
                raw = _logits_tile(hidden[n0:n1], weight_chunk, None, 1.0, acc_dtype, workspace)  # [n, v]
                running, target = state.log_normalizer[n0:n1], state.target[n0:n1]  # [n] each
                _triton.fold(raw, local_labels, inv_temperature, running, target, first=v0 == 0)
            else:
                logits = _logits_tile(
                    hidden[n0:n1], weight_chunk, bias_chunk, inv_temperature, acc_dtype, workspace
                )  # [n, v]
                state.fold(logits, local_labels, n0, n1, first=v0 == 0, workspace=workspace)
    return state.finish()


def _truncated_rows(
    hidden: torch.Tensor,  # [M, d]
    weight: torch.Tensor,  # [V, d]
    bias: torch.Tensor | None,  # [V]
    labels: torch.Tensor,  # [M]
    inv_temperature: float,
    gemm_dtype: torch.dtype,
    with_entropy: bool,
    top_k: int | None,
    top_p: float | None,
    rows_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of the top-k/top-p path: ``(support, log Σ_{S_y} e^z, log π̃_y, H or empty)`` per row.

    The support needs whole rows: blocks of ``rows_per_block x V`` logits, one GEMM each.
    It is saved packed, 1 bit per logit (``[M, ceil(V / 8)]`` uint8): backward recomputes
    its own tiles with other GEMM shapes, whose rounding could move a logit across the
    threshold, so it reads the forward's support instead of recomputing it.
    """
    acc_dtype = _accumulation_dtype(gemm_dtype)
    weight_gemm = weight.to(gemm_dtype)  # [V, d]
    bias_acc = None if bias is None else bias.to(acc_dtype)  # [V]
    workspace = _Workspace(hidden.device)
    rows, vocab = hidden.shape[0], weight.shape[0]
    # Outputs allocated up front: a block's results, allocated between its temporaries, would
    # pin them in glibc's heap (measured: +535 MiB resident at N = 1024, V = 151,936).
    outputs = (
        torch.empty(rows, -(-vocab // 8), dtype=torch.uint8, device=hidden.device),  # support
        *(torch.empty(rows, dtype=acc_dtype, device=hidden.device) for _ in range(3 if with_entropy else 2)),
    )
    for n0, n1 in _spans(rows, rows_per_block):
        block = truncated_row_statistics(
            _logits_tile(
                hidden[n0:n1], weight_gemm, bias_acc, inv_temperature, acc_dtype, workspace
            ),  # [n, V]
            labels[n0:n1],
            top_k,
            top_p,
            with_entropy,
        )
        for out, value in zip(outputs, block, strict=False):
            out[n0:n1].copy_(value)
        del block
    return outputs if with_entropy else (*outputs, outputs[1].new_empty(0))  # type: ignore[return-value]


def _kernels_apply(hidden: torch.Tensor, bias: torch.Tensor | None, acc_dtype: torch.dtype) -> bool:
    """Whether the Triton tile kernels (:mod:`softtrust._triton`) take a tile's elementwise work.

    They cover fp32 accumulation without an LM-head bias (the callers also exclude the
    entropy: its fold and gradient stay in PyTorch), on a device where they run.
    """
    return bias is None and acc_dtype == torch.float32 and _triton.available(hidden.device)


def _check_plain_lm_head(model: Any) -> None:
    """Refuse models whose logits are not the plain LM-head projection (the fused path would differ)."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(
                f"model.config.{name}={value!r}: completion_logprobs supports only models whose logits are "
                "the plain LM-head projection; call token_logprobs on the transformed head instead"
            )


def _check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    chunk_size: int | None,
    vocab_chunk_size: int | None,
    top_k: int | None = None,
    top_p: float | None = None,
) -> None:
    """Shapes, dtypes and hyperparameters of ``token_logprobs``; raises ``ValueError`` naming the argument."""
    _check_float_ndim("hidden", hidden, "(N, d) or (B, T, d)", min_ndim=2)
    _check_float_ndim("weight", weight, "(V, d)", min_ndim=2, max_ndim=2)
    vocab, dim = weight.shape
    if hidden.shape[-1] != dim:
        raise ValueError(
            f"hidden has last dim {hidden.shape[-1]} (shape {tuple(hidden.shape)}) but weight has shape "
            f"{tuple(weight.shape)}; expected weight of shape (V, {hidden.shape[-1]})"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype not in _INTEGER_DTYPES:
        received = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be an integer tensor of token ids, got {received}")
    check_shape("labels", labels, tuple(hidden.shape[:-1]), "hidden.shape[:-1]")
    if bias is not None:
        _check_float_ndim("bias", bias, "(V,)", min_ndim=1, max_ndim=1)
        check_shape("bias", bias, (vocab,), "(V,)")
    check_number("temperature", temperature, low=0.0, low_inclusive=False)
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    check_truncation(top_k, top_p)


def _check_float_ndim(name: str, x: object, meaning: str, min_ndim: int, max_ndim: int | None = None) -> None:
    """Raise unless ``x`` is a floating-point tensor with ``min_ndim <= ndim <= max_ndim``."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        received = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point tensor of shape {meaning}, got {received}")
    if x.ndim < min_ndim or (max_ndim is not None and x.ndim > max_ndim):
        raise ValueError(f"{name} must have shape {meaning}, got shape {tuple(x.shape)}")


def _check_label_range(labels: torch.Tensor, active: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise unless every active label is a token id in [0, V)."""
    bad = active & ((labels < 0) | (labels >= vocab))  # [N]
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"labels must be in [0, V) = [0, {vocab}) or equal ignore_index={ignore_index}, "
            f"got {int(labels[position])} at flat position {position}"
        )
