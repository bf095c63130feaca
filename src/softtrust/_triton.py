"""Triton kernels for the elementwise work of one ``token_logprobs`` tile on a GPU.

On a CPU the tile's elementwise passes cost a few percent next to its GEMMs; on a GPU
each is a kernel launch and a trip through memory, and together they cost more than
the GEMMs (docs/benchmarks_gpu.md). Two kernels replace them, for the common case of
no LM-head bias and no entropy gradient:

* :func:`fold`: one read of the fp32 logits tile ``raw = h @ W_cᵀ`` per row: the
  row's log-sum-exp of ``z = raw / T`` by the online (running max) formula, merged into
  the running ``log_normalizer`` with ``logaddexp``, and the label logit ``z_y`` when the
  label falls in this vocabulary chunk. Replaces max, shift, exp, sum, log, gather and
  merge.
* :func:`grad_tile`: ``p - onehot(y)`` with ``p = exp(raw / T - L)``, written once in
  the GEMM dtype (bf16 for bf16 inputs). Replaces shift, exp, scatter and the bf16 copy.

The math is the same as the PyTorch tile ops of :mod:`softtrust._tiles`, in fp32.
``triton`` is optional: :func:`available` says whether these kernels run on a device
(the first time, it runs both on a small tile and checks them against PyTorch; a
Triton that cannot build or run them leaves a warning and the PyTorch path). Set
``SOFTTRUST_TRITON=0`` to keep the PyTorch path everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch

FOLD_BLOCK = 1024  # columns a fold program reads per step
GRAD_BLOCK = 1024  # columns of one row a gradient program writes


@functools.cache
def _triton():
    """The ``triton`` module and the two compiled kernels, or None when triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def fold_kernel(
        raw_ptr,  # [n, v] fp32, row stride raw_stride
        labels_ptr,  # [n] int64, label - v0 (may fall outside [0, v))
        lse_ptr,  # [n] fp32 running log-sum-exp, read unless FIRST
        target_ptr,  # [n] fp32 label logit, written where the label is in this chunk
        n_cols,
        raw_stride,
        inv_temperature,
        FIRST: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = raw_ptr + row.to(tl.int64) * raw_stride
        row_max = tl.full((), float("-inf"), tl.float32)
        row_sum = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")) * inv_temperature
            new_max = tl.maximum(row_max, tl.max(z, 0))
            row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(z - new_max), 0)
            row_max = new_max
        chunk_lse = row_max + tl.log(row_sum)
        if FIRST:
            tl.store(lse_ptr + row, chunk_lse)
        else:
            running = tl.load(lse_ptr + row)
            high = tl.maximum(running, chunk_lse)
            low = tl.minimum(running, chunk_lse)
            tl.store(lse_ptr + row, high + tl.log(1.0 + tl.exp(low - high)))
        label = tl.load(labels_ptr + row)
        if (label >= 0) & (label < n_cols):
            tl.store(target_ptr + row, tl.load(base + label) * inv_temperature)

    @triton.jit
    def grad_kernel(
        raw_ptr,  # [n, v] fp32
        labels_ptr,  # [n] int64, label - v0
        lse_ptr,  # [n] fp32 log-sum-exp of the whole row
        out_ptr,  # [n, v] in the GEMM dtype
        n_cols,
        raw_stride,
        out_stride,
        inv_temperature,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        z = tl.load(raw_ptr + row.to(tl.int64) * raw_stride + cols, mask=inside, other=0.0)
        p = tl.exp(z * inv_temperature - tl.load(lse_ptr + row))
        label = tl.load(labels_ptr + row)
        grad = p - tl.where(cols == label, 1.0, 0.0)
        tl.store(
            out_ptr + row.to(tl.int64) * out_stride + cols,
            grad.to(out_ptr.dtype.element_ty),
            mask=inside,
        )

    return triton, fold_kernel, grad_kernel


def available(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: CUDA, triton installed and working there,
    ``SOFTTRUST_TRITON`` not ``0``.

    ``SOFTTRUST_TRITON=interpret`` with ``TRITON_INTERPRET=1`` (set before triton is first
    imported) runs them on CPU tensors through triton's interpreter, slowly: the tests use
    it to check the kernels without a GPU.
    """
    mode = os.environ.get("SOFTTRUST_TRITON", "1")
    if mode == "0":
        return False
    interpreted = mode == "interpret" and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not (interpreted and device.type == "cpu"):
        return False
    return _triton() is not None and _works_on(device)


@functools.cache
def _works_on(device: torch.device) -> bool:
    """Run both kernels once on a 3 x 37 tile on ``device`` and compare them with PyTorch.

    A triton that cannot compile or launch them there (no C compiler, an unsupported
    GPU), or that computes something else, gives a warning and False: the caller then
    keeps the PyTorch tile ops instead of failing.
    """
    try:
        generator = torch.Generator().manual_seed(0)
        raw = (4 * torch.randn(3, 37, generator=generator)).to(device)
        labels = torch.tensor([0, 36, 40], device=device)  # first, last, outside the chunk
        lse = torch.zeros(3, device=device)
        target = torch.full((3,), -1.0, device=device)
        fold(raw, labels, 0.5, lse, target, first=True)
        grad = grad_tile(raw, labels, 0.5, lse, torch.empty_like(raw))
        z = raw * 0.5
        expected_lse = torch.logsumexp(z, 1)
        expected_grad = torch.exp(z - expected_lse[:, None])
        expected_grad[0, 0] -= 1
        expected_grad[1, 36] -= 1
        expected_target = torch.stack([z[0, 0], z[1, 36], torch.tensor(-1.0, device=device)])
        ok = all(
            torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            for got, want in ((lse, expected_lse), (target, expected_target), (grad, expected_grad))
        )
        if not ok:
            raise RuntimeError("the kernels' results differ from PyTorch's on a test tile")
    except Exception as error:  # any failure: keep the PyTorch path, say why once
        warnings.warn(
            f"softtrust: Triton tile kernels unavailable on {device} ({type(error).__name__}: {error}); "
            "token_logprobs uses PyTorch tile ops there",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def fold(
    raw: torch.Tensor,  # [n, v] fp32, h @ W_cᵀ
    local_labels: torch.Tensor,  # [n] int64
    inv_temperature: float,
    log_normalizer: torch.Tensor,  # [n] fp32, updated in place
    target: torch.Tensor,  # [n] fp32, updated in place
    first: bool,
) -> None:
    """Fold one tile into the running log-sum-exp and label logit (see the module docstring)."""
    _, fold_kernel, _ = _triton()
    rows, cols = raw.shape
    with _on(raw.device):
        fold_kernel[(rows,)](
            raw,
            local_labels,
            log_normalizer,
            target,
            cols,
            raw.stride(0),
            inv_temperature,
            FIRST=first,
            BLOCK=FOLD_BLOCK,
        )


def grad_tile(
    raw: torch.Tensor,  # [n, v] fp32, h @ W_cᵀ
    local_labels: torch.Tensor,  # [n] int64
    inv_temperature: float,
    log_normalizer: torch.Tensor,  # [n] fp32
    out: torch.Tensor,  # [n, v], the GEMM dtype
) -> torch.Tensor:
    """``p - onehot(y)`` of one tile into ``out`` (see the module docstring); returns ``out``."""
    triton, _, grad_kernel = _triton()
    rows, cols = raw.shape
    grid = (rows, triton.cdiv(cols, GRAD_BLOCK))
    with _on(raw.device):
        grad_kernel[grid](
            raw,
            local_labels,
            log_normalizer,
            out,
            cols,
            raw.stride(0),
            out.stride(0),
            inv_temperature,
            BLOCK=GRAD_BLOCK,
        )
    return out
