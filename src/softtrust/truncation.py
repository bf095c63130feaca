"""Truncated sampling (top-k, top-p): the one definition of the support, for the sampler and the learner.

A sampler that draws from ``softmax(z / T)`` restricted to a support ``S`` (top-k, top-p)
draws from the *truncated* policy ``π̃(j) = p_j / Σ_{i∈S} p_i`` on ``S``, 0 elsewhere. A
learner that scores those tokens with the full softmax sees the ratio ``π/π̃ = P(S)`` (the
kept mass, < 1) on every on-policy token instead of 1 (reported in TRL #6789 and verl
#6240). softtrust's learner scores the truncated policy itself: ``token_logprobs(...,
top_k=, top_p=)`` recomputes ``S`` from its current logits (stateless) with the function
here, so a sampler that uses ``truncated_log_softmax`` / ``sample_truncated`` and the
learner can never disagree on the rule.

The rule (the order and conventions of Hugging Face ``generate``'s warpers, and of vLLM),
on the temperature-scaled logits ``z = logits / T`` of one row, ``V`` entries:

1. **Temperature first**, then top-k, then top-p (top-p sees the top-k-truncated row).
2. **Top-k**: keep every ``j`` with ``z_j >= z_(k)``, the k-th largest value. Ties with the
   k-th value are all kept, so more than ``k`` tokens can survive (HF ``TopKLogitsWarper``).
   ``top_k >= V`` truncates nothing.
3. **Top-p**: sort the surviving logits ascending, ``c_i`` the cumulative sum of their
   softmax in that order; the first ``r`` sorted entries with ``c_i <= 1 - top_p`` are
   removed (at most ``V - 1``: the largest logit always stays), exactly HF
   ``TopPLogitsWarper`` / vLLM's formula, computed with the same ops. Without ties this
   keeps the smallest set of largest-logit tokens whose mass is >= ``top_p``: token ``j``
   stays iff ``Σ_{i: z_i > z_j} p_i < top_p`` (up to rounding).
   ``top_p == 1`` truncates nothing (HF skips the warper then).
4. Both steps keep ``{j : z_j >= τ}`` for one per-row threshold ``τ``, a value of the row
   (the smallest kept logit). **Ties with τ are kept**: for top-p this can keep tied tokens
   that HF's sort-order-dependent pick would drop (identical whenever the row has no tie at τ).

``top_k`` and ``top_p`` both ``None`` (or ``top_k >= V``, ``top_p == 1``) is no truncation.
min-p, typical-p and the like are not covered.

The learner's support is stateless: recomputed from the current logits, not recorded by the
sampler (DeepSeek-V3.2's "keep sampling mask" records it instead).

References: top-k sampling, Fan et al., Hierarchical Neural Story Generation (arXiv
1805.04833); top-p (nucleus) sampling, Holtzman et al., The Curious Case of Neural Text
Degeneration (arXiv 1904.09751).
"""

from __future__ import annotations

import torch

from softtrust._validation import check_number


def check_truncation(top_k: object, top_p: object) -> None:
    """Raise ``ValueError`` unless ``top_k`` is ``None`` or an int >= 1 and ``top_p`` is ``None`` or in (0, 1]."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k must be a positive int or None (no top-k truncation), got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool):
            raise ValueError(f"top_p must be a number in (0, 1] or None (no top-p truncation), got {top_p!r}")
        check_number("top_p", top_p, low=0.0, high=1.0, low_inclusive=False)


def truncates(top_k: int | None, top_p: float | None, vocab: int) -> bool:
    """Whether ``(top_k, top_p)`` removes anything from a ``vocab``-entry row (``top_k < V`` or ``top_p < 1``)."""
    return (top_k is not None and top_k < vocab) or (top_p is not None and top_p < 1.0)


def truncation_threshold(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The per-row threshold ``τ`` of the support ``{j : logits_j >= τ}`` (see the module docstring).

    Args:
        logits: ``[..., V]`` temperature-scaled logits (``logits / T``), float.
        top_k: keep the k largest (ties at the k-th value kept), or ``None``.
        top_p: nucleus mass in (0, 1], or ``None``.

    Returns:
        ``[...]`` thresholds in the logits' dtype: the smallest kept logit of each row,
        ``-inf`` where nothing is truncated.

    Memory: top-k only, a ``[..., k]`` top-k; with top-p, a full sort of each row: about
    20 bytes per fp32 logit (sorted values, int64 sort indices, softmax, cumulative sum)
    next to the input. Callers bound it by passing row blocks.
    """
    check_truncation(top_k, top_p)
    vocab = logits.shape[-1]
    threshold = torch.full(logits.shape[:-1], -torch.inf, dtype=logits.dtype, device=logits.device)  # [...]
    if top_k is not None and top_k < vocab:
        threshold = logits.topk(top_k, dim=-1).values[..., -1]  # the k-th largest  [...]
    if top_p is None or top_p >= 1.0:
        return threshold
    # Top-p sees the top-k-truncated row: its removed entries get probability 0.
    kept = (
        logits
        if top_k is None or top_k >= vocab
        else logits.masked_fill(logits < threshold[..., None], -torch.inf)
    )
    ascending = kept.sort(dim=-1).values  # [..., V]
    del kept  # memory: the logits, the sorted row and its softmax at most
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)  # [..., V], nondecreasing
    # HF/vLLM: the ascending prefix with cumulative mass <= 1 - top_p goes; the largest always stays.
    removed = (cumulative <= (1 - top_p)).sum(dim=-1).clamp(max=vocab - 1)  # [...]
    return ascending.gather(-1, removed.unsqueeze(-1)).squeeze(-1)  # smallest kept value  [...]


def truncation_mask(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """``[..., V]`` bool, True on the support of the truncated distribution of ``logits`` (already / T).

    ``logits >= truncation_threshold(logits, top_k, top_p)``; see the module docstring for the rule.
    """
    return logits >= truncation_threshold(logits, top_k, top_p).unsqueeze(-1)


def truncated_log_softmax(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Log-probs of the truncated sampling distribution: ``-inf`` off the support, renormalised on it.

    ``log π̃_j = z_j - log Σ_{i∈S} e^{z_i}`` for ``j ∈ S = truncation_mask(z, top_k, top_p)``,
    ``z = logits / temperature``. The sampler's log-probs (what ``token_logprobs(...,
    top_k=, top_p=)`` reproduces from hidden states). Builds the full ``[..., V]`` row.

    Args:
        logits: ``[..., V]`` raw logits (float; computed in float32 unless float64).
        temperature: > 0, applied first.
        top_k, top_p: as in :func:`truncation_threshold`.
    """
    check_number("temperature", temperature, low=0.0, low_inclusive=False)
    check_truncation(top_k, top_p)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.to(dtype) / temperature  # [..., V]
    if truncates(top_k, top_p, scaled.shape[-1]):
        scaled = scaled.masked_fill(~truncation_mask(scaled, top_k, top_p), -torch.inf)
    return torch.log_softmax(scaled, dim=-1)


def sample_truncated(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    uniform: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from the truncated distribution; return it and its log-prob.

    Args:
        logits: ``[B, V]`` raw logits.
        temperature, top_k, top_p: as in :func:`truncated_log_softmax`.
        uniform: optional ``[B]`` draws in [0, 1): token = the first ``j`` with
            ``cdf_j > u`` (inverse CDF in float64); never an off-support token, even when
            rounding leaves the last CDF value under ``u``.
        generator: the random stream of ``torch.multinomial`` when ``uniform`` is None.

    Returns:
        ``tokens [B]`` int64 and ``logprobs [B]``, the renormalised log-probs of those
        tokens (the behaviour policy's numbers for ``old_logprobs``/``rollout_logprobs``).
    """
    log_probs = truncated_log_softmax(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # [B, V]
    if uniform is None:
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(1)  # [B]
    else:
        probs = log_probs.double().exp()  # [B, V], 0 off the support
        cdf = probs.cumsum(dim=-1)  # [B, V]
        tokens = (cdf <= uniform.double().unsqueeze(1)).sum(dim=-1)  # [B]
        # Rounding can leave cdf[-1] a hair under u: take the last supported token then.
        last_supported = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # [B]
        tokens = torch.minimum(tokens, last_supported)
    return tokens, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def truncated_row_statistics(
    logits: torch.Tensor,
    labels: torch.Tensor,
    top_k: int | None,
    top_p: float | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(support, log-normaliser, log π̃_y, entropy)`` of full rows; the forward of ``token_logprobs``' truncated path.

    The label is always in the learner's support: ``S_y = S ∪ {y}`` with ``S`` the
    truncation support of the row. On-policy ``y ∈ S`` and this is the sampler's truncated
    log-prob. For a stale sample whose label fell out of the current support it is
    ``z_y - log(Σ_S e^z + e^{z_y})``: finite, below every supported token's log-prob,
    continuous as the label crosses the threshold (rounding-level flips of the label
    itself change nothing); its gradient is the log-softmax gradient over ``S_y``.

    Args:
        logits: ``[R, V]`` temperature-scaled logits, overwritten.
        labels: ``[R]`` int64 in ``[0, V)``.

    Returns:
        ``support [R, ceil(V / 8)]`` uint8, ``S_y`` packed 8 tokens a byte (:func:`pack_bits`),
        ``log_normalizer [R]`` (``log Σ_{S_y} e^z``), ``logprobs [R]``, ``entropy [R]`` of
        ``π̃`` over ``S_y`` (empty unless ``with_entropy``).
    """
    threshold = truncation_threshold(logits, top_k, top_p)  # [R]
    target = logits.gather(1, labels.unsqueeze(1)).squeeze(1)  # z_y  [R]
    in_support = (logits >= threshold.unsqueeze(1)).scatter_(1, labels.unsqueeze(1), True)  # S ∪ {y}  [R, V]
    masked = logits.masked_fill_(~in_support, -torch.inf)  # [R, V]
    log_normalizer = torch.logsumexp(masked, dim=1)  # [R]
    entropy = logits.new_empty(0)
    if with_entropy:
        probs = masked.sub_(log_normalizer.unsqueeze(1)).exp_()  # π̃, 0 off the support  [R, V]
        entropy = -torch.special.xlogy(probs, probs).sum(1)  # 0 log 0 = 0  [R]
    return pack_bits(in_support), log_normalizer, target - log_normalizer, entropy


_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` bool -> ``[R, ceil(V / 8)]`` uint8, column ``j`` in bit ``j % 8`` of byte ``j // 8``."""
    rows, width = mask.shape
    padded = torch.nn.functional.pad(mask, (0, -width % 8)).view(rows, -1, 8)  # [R, V8, 8]
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (padded.to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)  # distinct bits: the sum is an OR


def unpack_bits(packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns ``[start, stop)`` of the ``[R, V]`` bool mask that :func:`pack_bits` packed ([R, stop - start])."""
    first = start // 8
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, first : -(-stop // 8), None] & weights) != 0  # [R, bytes, 8]
    offset = start - 8 * first
    return bits.flatten(1)[:, offset : offset + stop - start]
