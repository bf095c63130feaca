"""Tile machinery of :mod:`softtrust.logprobs`: the ops on one tile of logits and the state between tiles.

``token_logprobs`` never builds the (N, V) logits: its autograd Function (in
:mod:`softtrust.logprobs`, with the math in that module's docstring) loops over tiles of
``n`` tokens by ``v`` vocabulary entries. This module holds what those loops call:

* per-tile logits and their gradient: :func:`_logits_tile` (the GEMM, bias, temperature;
  fp32 output straight from a bf16/fp16 GEMM where PyTorch can, :func:`_gemm_writes_fp32`),
  :func:`_logits_grad_tile` and its per-row factor :func:`_row_scale`;
* the running statistics across vocabulary chunks: :class:`_OnlineLogSumExp` (log-probs)
  and :class:`_OnlineLogSumExpEntropy` (log-probs and entropy), built on
  :func:`_tile_logsumexp` and :func:`_pick_label_logits`;
* the sums and buffers: :class:`_GemmSum` (a weight-gradient chunk summed in the accumulation dtype),
  :func:`_add_matmul`, :class:`_Workspace` (tile-sized buffers reused from tile to tile);
* small helpers: :func:`_spans`, :func:`_scatter_rows`, :func:`_grads_out`, the dtype
  rules :func:`_gemm_dtype` and :func:`_accumulation_dtype`, and :func:`_autocast_off`.

This is the PyTorch path. On CUDA, in the common case (no LM-head bias, no entropy), the
Triton kernels of :mod:`softtrust._triton` do the elementwise work of the fold and of the
gradient tile instead (the choice is made in :mod:`softtrust.logprobs`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch


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
