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

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from softtrust import _triton
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
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    # Position t predicts token t + 1, so the last position predicts nothing.
    hidden = outputs.last_hidden_state[:, -logits_to_keep - 1 : -1]  # [B, K, d]
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


class _Workspace:
    """Tile-sized buffers reused from tile to tile.

    A fresh tile-sized tensor per op costs page faults on CPU (large allocations go
    straight to ``mmap``), about as much as the op itself; every tile op here writes
    into one of these buffers instead. The first tile is the largest, so each buffer
    is allocated once per forward or backward.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def tile(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous [rows, cols] view of the buffer ``name`` (contents undefined)."""
        numel = rows * cols
        buffer = self.buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = self.buffers[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buffer[:numel].view(rows, cols)


class _GemmSum:
    """``out = Σ_k a_k @ b_k`` summed in ``acc_dtype``, for one vocabulary chunk of the weight gradient.

    The first product is written, not added, so ``out`` needs no zero fill. When ``out``
    is bf16 and there are several terms, the sum runs in an fp32 buffer rounded once at
    the end (rounding each partial sum to bf16 would bias the gradient); a single term
    is written straight from the GEMM.
    """

    def __init__(self, out: torch.Tensor, acc_dtype: torch.dtype, terms: int) -> None:
        self.out = out  # [v, d]
        self.acc_dtype = acc_dtype
        self.sum_in_out = out.dtype == acc_dtype or terms <= 1
        self.total: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.total is not None:
            _add_matmul(self.total, a, b)
        elif not self.sum_in_out:
            self.total = (a @ b).to(self.acc_dtype)  # [v, d] fp32 buffer
        elif a.dtype == self.out.dtype:
            self.total = torch.mm(a, b, out=self.out)
        else:
            self.total = self.out.copy_(a @ b)

    def close(self) -> None:
        if self.total is None:
            self.out.zero_()  # no active token: zero gradient
        elif self.total is not self.out:
            self.out.copy_(self.total)  # round the fp32 sum once


@dataclass
class _OnlineLogSumExp:
    """Running ``L = logsumexp(z)`` per row and the label logit ``z_y``, one vocabulary chunk at a time.

    Log-probs only: each tile's log-sum-exp (max-shifted, in place) is merged into the
    running value with ``logaddexp`` (the online log-sum-exp).
    """

    log_normalizer: torch.Tensor  # [M]
    target: torch.Tensor  # [M]

    @classmethod
    def empty(cls, rows: int, dtype: torch.dtype, device: torch.device) -> _OnlineLogSumExp:
        return cls(*(torch.zeros(rows, dtype=dtype, device=device) for _ in range(2)))

    def fold(
        self,
        logits: torch.Tensor,
        local_labels: torch.Tensor,
        n0: int,
        n1: int,
        first: bool,
        workspace: _Workspace,
    ) -> None:
        """Fold one [n, v] tile (rows n0:n1) into the statistics; ``logits`` is overwritten."""
        _pick_label_logits(self.target[n0:n1], logits, local_labels)
        chunk_lse = _tile_logsumexp(logits)  # [n]
        running = self.log_normalizer[n0:n1]  # [n]
        running.copy_(chunk_lse if first else torch.logaddexp(running, chunk_lse))

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logsumexp, log p_y, empty)`` per row."""
        logprobs = self.target - self.log_normalizer  # [M]
        return self.log_normalizer, logprobs, self.log_normalizer.new_empty(0)


@dataclass
class _OnlineLogSumExpEntropy:
    """Running max, sums and label logit per row for log-probs and entropy, one vocabulary chunk at a time.

    With ``m`` the running max (an exact logit value): ``sum_exp = Σ e^{z_j - m}``,
    ``shifted_dot = Σ e^{z_j - m} (z_j - m)`` and ``target = z_y``. Then
    ``logsumexp = m + log sum_exp`` and ``H = log sum_exp - shifted_dot / sum_exp``.
    Everything stays relative to ``m`` (``z - m`` is exact), so large logits lose no
    digits: forming ``logsumexp - E[z]`` instead would cancel.
    """

    max: torch.Tensor  # [M]
    sum_exp: torch.Tensor  # [M]
    shifted_dot: torch.Tensor  # [M]
    target: torch.Tensor  # [M]

    @classmethod
    def empty(cls, rows: int, dtype: torch.dtype, device: torch.device) -> _OnlineLogSumExpEntropy:
        return cls(*(torch.zeros(rows, dtype=dtype, device=device) for _ in range(4)))

    def fold(
        self,
        logits: torch.Tensor,
        local_labels: torch.Tensor,
        n0: int,
        n1: int,
        first: bool,
        workspace: _Workspace,
    ) -> None:
        """Fold one [n, v] tile (rows n0:n1) into the statistics; ``logits`` is overwritten."""
        _pick_label_logits(self.target[n0:n1], logits, local_labels)
        old_max = self.max[n0:n1]  # [n]
        new_max = logits.amax(1) if first else torch.maximum(old_max, logits.amax(1))  # [n]
        shifted = logits.sub_(new_max.unsqueeze(1))  # z - m'  [n, v], all <= 0
        exp_shifted = torch.exp(shifted, out=workspace.tile("exp", *shifted.shape, shifted.dtype))  # [n, v]
        chunk_sum = exp_shifted.sum(1)  # [n]
        # Σ e^{z-m'} (z-m') as a batched dot product: no [n, v] temporary.
        chunk_dot = (exp_shifted.unsqueeze(1) @ shifted.unsqueeze(2)).view(-1)  # [n]
        sum_exp, dot = self.sum_exp[n0:n1], self.shifted_dot[n0:n1]
        if first:
            dot.copy_(chunk_dot)
            sum_exp.copy_(chunk_sum)
        else:
            # Re-base the old sums from m to m': Σ e^{z-m'} = e^{m-m'} Σ e^{z-m}, and
            # Σ e^{z-m'} (z-m') = e^{m-m'} (Σ e^{z-m} (z-m) + (m-m') Σ e^{z-m}).
            shift = old_max - new_max  # [n], <= 0
            rescale = shift.exp()  # [n]
            dot.copy_(rescale * (dot + shift * sum_exp) + chunk_dot)
            sum_exp.copy_(rescale * sum_exp + chunk_sum)
        old_max.copy_(new_max)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logsumexp, log p_y, H)`` per row, each [M]."""
        log_sum_exp = self.sum_exp.log()  # [M]
        log_normalizer = self.max + log_sum_exp  # [M]
        entropy = log_sum_exp - self.shifted_dot / self.sum_exp  # [M]
        return log_normalizer, self.target - log_normalizer, entropy


def _tile_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` of each row of a [n, v] tile ([n]); ``logits`` may be overwritten.

    ``log Σ e^z = m + log Σ e^{z-m}`` with ``m`` the row max, which keeps ``exp`` from
    overflowing. On CPU as max, an in-place shift and exp, and a sum (faster there than
    ``torch.logsumexp``, measured on a 2048 x 2048 fp32 tile: 3.7 against 5.1-5.5 ms);
    elsewhere ``torch.logsumexp`` (fewer kernel launches; it allocates one tile-sized
    temporary). On CUDA the Triton fold (:mod:`softtrust._triton`) usually replaces both.
    """
    if logits.device.type != "cpu":
        return torch.logsumexp(logits, 1)
    chunk_max = logits.amax(1)  # [n]
    return chunk_max + logits.sub_(chunk_max.unsqueeze(1)).exp_().sum(1).log()


def _pick_label_logits(target: torch.Tensor, logits: torch.Tensor, local_labels: torch.Tensor) -> None:
    """Write ``logits[i, label_i]`` into ``target[i]`` for the rows whose label is in this chunk."""
    width = logits.shape[1]
    in_chunk = (local_labels >= 0) & (local_labels < width)  # [n]
    picked = logits.gather(1, local_labels.clamp(0, width - 1).unsqueeze(1)).squeeze(1)  # [n]
    target.copy_(torch.where(in_chunk, picked, target))


def _logits_tile(
    hidden: torch.Tensor,  # [n, d]
    weight: torch.Tensor,  # [v, d], in gemm_dtype
    bias: torch.Tensor | None,  # [v], in acc_dtype
    inv_temperature: float,
    acc_dtype: torch.dtype,
    workspace: _Workspace,
) -> torch.Tensor:
    """``(h @ W.T + b) * inv_temperature`` for one tile, in ``acc_dtype``, in a workspace buffer.

    A bf16/fp16 GEMM writes its output in that dtype and the tile is upcast (one more
    pass over it); on CUDA, where ``torch.mm`` can write fp32 from bf16/fp16 operands
    (``out_dtype``), the GEMM writes the fp32 tile itself, unrounded.
    """
    rows, cols = hidden.shape[0], weight.shape[0]
    if weight.dtype != acc_dtype and _gemm_writes_fp32(hidden.device, weight.dtype, acc_dtype):
        logits = torch.mm(hidden.to(weight.dtype), weight.T, out_dtype=acc_dtype)  # [n, v]
    else:
        raw = workspace.tile("gemm", rows, cols, weight.dtype)  # [n, v]
        torch.mm(hidden.to(weight.dtype), weight.T, out=raw)
        # bf16 GEMM output upcast per tile; fp32 needs no copy.
        logits = raw if raw.dtype == acc_dtype else workspace.tile("logits", rows, cols, acc_dtype).copy_(raw)
    if bias is not None:
        logits.add_(bias)
    if inv_temperature != 1.0:
        logits.mul_(inv_temperature)
    return logits


@functools.cache
def _gemm_writes_fp32(device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=out_dtype)`` runs for ``dtype`` operands on ``device``.

    PyTorch has it for fp16/bf16 -> fp32 on CUDA only; probed once per device and dtypes.
    """
    if device.type != "cuda" or out_dtype != torch.float32:
        return False
    try:
        probe = torch.ones(2, 2, dtype=dtype, device=device)
        return torch.mm(probe, probe, out_dtype=out_dtype).dtype == out_dtype
    except Exception:  # a probe: any failure (no such overload, no CUDA build) means no
        return False


def _row_scale(
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    inv_temperature: float,
    like: torch.Tensor,
) -> torch.Tensor:
    """The per-row factor of the logits gradient, ``dz = row_scale[:, None] * tile`` ([M]).

    Without an entropy gradient (the common case) ``dz = -(g / T) (p - onehot)``: the
    factor ``-g / T`` is applied to the [n, d] GEMM operands instead of the [n, v] tile,
    which saves a pass over every tile. With one, the factor is ``1 / T``.
    """
    if grad_entropy is None:
        return grad_logprobs * -inv_temperature  # [M]
    return torch.full_like(like, inv_temperature)  # [M]


def _logits_grad_tile(
    logits: torch.Tensor,  # [n, v], overwritten
    local_labels: torch.Tensor,  # [n]
    log_normalizer: torch.Tensor,  # [n]
    entropy: torch.Tensor,  # [n] (or empty)
    grad_logprobs: torch.Tensor | None,  # [n]
    grad_entropy: torch.Tensor | None,  # [n]
    workspace: _Workspace,
    off_support: torch.Tensor | None = None,  # [n, v] bool, top-k/top-p only
) -> torch.Tensor:
    """The logits gradient of one tile, up to the factor of ``_row_scale``.

    ``dz_j = (g (1[j=y] - p_j) - e p_j (log p_j + H)) / T``; the tile is ``p - onehot``
    without an entropy gradient, ``-p_j (g + e (log p_j + H)) + g 1[j=y]`` with one.
    With ``off_support`` (truncated sampling) ``p`` is the renormalised ``π̃``, 0 off the
    support: the ``p_j`` terms are zeroed there (before the label's term is added, so a
    label is never dropped), which is the gradient of the log-softmax restricted to the support.
    """
    log_probs = logits.sub_(log_normalizer.unsqueeze(1))  # log p_j = z_j - L  [n, v]
    width = log_probs.shape[1]
    in_chunk = (local_labels >= 0) & (local_labels < width)  # [n]
    label_column = local_labels.clamp(0, width - 1).unsqueeze(1)  # [n, 1]

    if grad_entropy is None:
        tile = log_probs.exp_()  # p_j  [n, v]
        if off_support is not None:
            tile.masked_fill_(off_support, 0.0)
        # p - onehot: subtract 1 at the label, only for rows whose label falls in this chunk.
        tile.scatter_add_(1, label_column, torch.where(in_chunk, -1.0, 0.0).to(tile.dtype).unsqueeze(1))
        return tile

    probs = torch.exp(log_probs, out=workspace.tile("exp", *log_probs.shape, log_probs.dtype))  # [n, v]
    coeff = log_probs.add_(entropy.unsqueeze(1)).mul_(grad_entropy.unsqueeze(1))  # e (log p_j + H)
    if grad_logprobs is not None:
        coeff.add_(grad_logprobs.unsqueeze(1))  # g + e (log p_j + H)
    tile = probs.mul_(coeff).neg_()  # -p_j (g + e (log p_j + H))  [n, v]
    if off_support is not None:
        tile.masked_fill_(off_support, 0.0)  # finite before: z_j - L is finite off the support
    if grad_logprobs is not None:
        tile.scatter_add_(1, label_column, torch.where(in_chunk, grad_logprobs, 0).unsqueeze(1))  # + g 1[j=y]
    return tile


def _add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b``; for bf16/fp16 ``a, b`` the GEMM output is upcast before the fp32 sum."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)


def _grads_out(
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    grad_bias: torch.Tensor | None,
    hidden: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients in each input's dtype, ``None`` for the non-tensor arguments."""
    grad_hidden = None if grad_hidden is None else grad_hidden.to(hidden.dtype)
    grad_bias = None if grad_bias is None or bias is None else grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _spans(total: int, step: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive chunks of ``step`` covering ``range(total)``."""
    for start in range(0, total, step):
        yield start, min(start + step, total)


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor | None, total: int) -> torch.Tensor:
    """Place the active rows' ``values`` [M] back at ``rows`` of a zero [total] vector."""
    if rows is None:
        return values
    return values.new_zeros(total).index_copy(0, rows, values)  # [N]


def _gemm_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMMs run in the inputs' promoted dtype, or in the autocast dtype under autocast."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    device_type = hidden.device.type
    if dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def _accumulation_dtype(gemm_dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float accumulates in float32."""
    return torch.float64 if gemm_dtype == torch.float64 else torch.float32


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Disable autocast inside the tiles: the dtypes are chosen explicitly there."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


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
