"""The expected formula of every registered method, written from METHODS.md independently of softtrust.

One entry per name in ``st.METHODS`` (``test_every_registered_method_has_an_expected_formula``
fails for a method without one). An entry maps an :class:`Inputs` (dense float64 tensors
of one batch, the method instance) to the per-token loss ℓ, broadcastable to [B, T];
``ratio`` is at the loss's level and differentiable, and ``sg`` (detach) marks the
weights that carry no gradient. Adding a method: add its formula here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Inputs(NamedTuple):
    method: object  # the method instance (its parameters)
    ratio: torch.Tensor  # [B, T] or [B, 1]: r at the level, differentiable
    token_log_ratio: torch.Tensor  # [B, T] clamped logp - old, 0 where masked
    logprobs: torch.Tensor  # [B, T] log π_θ, 0 where masked
    advantages: torch.Tensor  # [B, 1]
    mask: torch.Tensor  # [B, T] 0/1 float
    old: torch.Tensor | None = None  # [B, T] log π_old, 0 where masked


def sg(x: torch.Tensor) -> torch.Tensor:
    return x.detach()


def clip(x: Inputs) -> torch.Tensor:
    m, r, a = x.method, x.ratio, x.advantages
    return -torch.minimum(r * a, r.clamp(1 - m.eps_low, 1 + m.eps_high) * a)


def sapo(x: Inputs) -> torch.Tensor:
    tau = torch.where(
        x.advantages > 0, torch.tensor(x.method.tau_pos), torch.tensor(x.method.tau_neg)
    ).double()
    return -(4 / tau) * torch.sigmoid(tau * (x.ratio - 1)) * x.advantages


def vespo(x: Inputs) -> torch.Tensor:
    m, a = x.method, x.advantages
    w = torch.exp(torch.clamp(torch.log(sg(x.ratio)), min=math.log(1e-8)))
    k = torch.where(a >= 0, m.k_pos, m.k_neg)
    lam = torch.where(a >= 0, m.lambda_pos, m.lambda_neg)
    return -(w**k * torch.exp(lam * (1 - w))) * a * x.logprobs


def gmpo(x: Inputs) -> torch.Tensor:
    eps, a, lr = x.method.eps, x.advantages, x.token_log_ratio
    s = torch.sign(a)
    per_token = s * torch.minimum(s * lr, s * lr.clamp(-eps, eps))
    return -a * torch.exp(
        (per_token * x.mask).sum(-1, keepdim=True) / x.mask.sum(-1, keepdim=True).clamp(min=1)
    )


def dppo(x: Inputs) -> torch.Tensor:
    m, a = x.method, x.advantages
    low, high = m.thresholds
    p, q = torch.exp(sg(x.logprobs)), torch.exp(x.old)
    if m.divergence == "tv":
        valid = torch.where(a > 0, p - q <= high, p - q >= -low)
    else:  # KL(Bern(q) || Bern(p)) with 0·log 0 = 0
        kl = torch.xlogy(q, q) - torch.xlogy(q, p) + torch.xlogy(1 - q, 1 - q) - torch.xlogy(1 - q, 1 - p)
        valid = torch.where(a > 0, (kl <= high) | (p <= q), (kl <= low) | (p >= q))
    return -sg(x.ratio.clamp(max=m.cap) * valid) * a * x.logprobs


def covariance_and_count(x: Inputs) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cov over active tokens (1-D), their flat positions, and k = max(1, floor(ratio·N))."""
    valid = x.mask.reshape(-1) > 0
    a = torch.broadcast_to(x.advantages, x.mask.shape).reshape(-1)[valid]
    lp = sg(x.logprobs).reshape(-1)[valid]
    cov = (a - a.mean()) * (lp - lp.mean())
    return cov, torch.nonzero(valid).reshape(-1), max(1, int(x.method.ratio * int(valid.sum())))


def kl_cov(x: Inputs) -> torch.Tensor:
    selected = torch.zeros(x.mask.numel(), dtype=torch.float64)
    cov, where, k = covariance_and_count(x)
    if cov.numel():
        selected[where[torch.topk(cov, k).indices]] = 1.0
    penalty = x.method.coef * x.token_log_ratio.abs() * selected.reshape(x.mask.shape)
    return -x.advantages * x.ratio + penalty


def clip_cov(x: Inputs) -> torch.Tensor:
    m, a, r = x.method, x.advantages, x.ratio
    unclipped, clipped = -a * r, -a * r.clamp(1 - m.eps_low, 1 + m.eps_high)
    picked = torch.zeros(x.mask.numel(), dtype=torch.bool)
    cov, where, k = covariance_and_count(x)
    unclipped_here = (sg(clipped) <= sg(unclipped)).reshape(-1)[where]
    candidate = unclipped_here & (cov > m.cov_low) & (cov < m.cov_high)
    # the documented pick: the k candidates with the smallest key (salt 0.5 without a generator)
    mix = 12.9898 * sg(x.logprobs) + 78.233 * x.old + 37.719 * torch.broadcast_to(a, x.mask.shape) + 500.0
    key = torch.frac(43758.5453 * torch.sin(mix)).abs().reshape(-1)[where][candidate]
    if key.numel():
        picked[where[candidate][torch.topk(key, min(k, key.numel()), largest=False).indices]] = True
    return torch.where(picked.reshape(x.mask.shape), 0.0, torch.maximum(unclipped, clipped))


def m2po(x: Inputs) -> torch.Tensor:
    # d = old - logp (detached); sort the active tokens' d² descending and drop the fewest largest
    # so that the mean of the rest is < tau (all of them when no rest qualifies); ties with the last
    # dropped value are dropped too. The kept tokens train with -r·A, no clip (the paper).
    d2 = sg(x.token_log_ratio) ** 2
    values = sorted(
        (v for v, m in zip(d2.flatten().tolist(), x.mask.flatten().tolist(), strict=True) if m), reverse=True
    )
    k = len(values)
    for start in range(len(values)):
        rest = values[start:]
        if sum(rest) / len(rest) < x.method.tau:
            k = start
            break
    cut = values[k - 1] if k > 0 else math.inf
    keep = (d2 < cut).double()
    return -keep * x.ratio * x.advantages


def bapo(x: Inputs) -> torch.Tensor:
    # Algorithm 1 of the paper, walked with Python numbers; rho = P / (P + N) by clipped value.
    m = x.method
    r, a = sg(x.ratio), (x.advantages * x.mask)
    low_steps = math.floor((m.low_max - m.low_start) / m.low_step + 1e-9)
    high_steps = math.floor((m.high_max - m.high_start) / m.high_step + 1e-9)
    i, j = 0, 0  # steps taken by c_high, c_low

    def share(c_low, c_high):
        pos = (torch.minimum(r, torch.tensor(c_high)) * a.clamp(min=0)).sum().item()
        neg = (torch.maximum(r, torch.tensor(c_low)) * (-a).clamp(min=0)).sum().item()
        return 1.0 if pos + neg == 0 else pos / (pos + neg)

    c_low, c_high = m.low_start, m.high_start
    while share(c_low, c_high) < m.target and j + 1 <= low_steps:
        if i + 1 <= high_steps:
            i += 1
        else:
            j += 1
        c_low, c_high = m.low_start + j * m.low_step, m.high_start + i * m.high_step
    return -torch.minimum(x.ratio * x.advantages, x.ratio.clamp(c_low, c_high) * x.advantages)


EXPECTED = {
    "clip": clip,
    "gspo": clip,
    "cispo": lambda x: (
        -sg(x.ratio.clamp(min=x.method.ratio_low, max=x.method.ratio_high)) * x.advantages * x.logprobs
    ),
    "sapo": sapo,
    "pspo": lambda x: -((1 - x.method.alpha) * x.ratio + x.method.alpha) * x.advantages,
    "vespo": vespo,
    "cfpo": lambda x: (
        -(x.ratio * x.advantages - x.advantages.abs() * (x.ratio - 1) ** 2 / (2 * x.method.eps))
    ),
    "gmpo": gmpo,
    "reinforce": lambda x: -x.advantages * x.logprobs,
    "dppo": dppo,
    "dro": lambda x: -(x.advantages * x.logprobs - x.method.beta / 2 * x.token_log_ratio**2),
    "topr": lambda x: (
        -sg(torch.where(x.advantages < 0, x.ratio.clamp(0, 1), 1.0)) * x.advantages * x.logprobs
    ),
    "kl-cov": kl_cov,
    "clip-cov": clip_cov,
    "m2po": m2po,
    "bapo": bapo,
}

# The aggregation modes, from METHODS.md: (Σ_t m·ℓ per row [B], mask [B, T]) -> scalar.
AGGREGATE = {
    "token-mean": lambda rows, m: rows.sum() / m.sum().clamp(min=1),
    "token-sum": lambda rows, m: rows.sum(),
    "seq-mean-token-mean": lambda rows, m: (rows / m.sum(-1).clamp(min=1)).mean(),
    "seq-mean-token-sum": lambda rows, m: rows.mean(),
    "seq-mean-token-sum-norm": lambda rows, m: rows.sum() / (m.shape[0] * m.shape[1]),
}


def expected_loss(method, level, aggregation, logprobs, old, advantages, mask, clamp=20.0) -> torch.Tensor:
    """The whole loss from the table: dense float64 inputs, masked entries zeroed first."""
    m = mask.double()
    logprobs, old = logprobs * m, old * m
    token_log_ratio = (logprobs - old).clamp(-clamp, clamp)
    if level == "token":
        log_ratio = token_log_ratio
    elif level == "sequence-sum":
        log_ratio = token_log_ratio.sum(-1, keepdim=True).clamp(-clamp, clamp)
    else:
        log_ratio = token_log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        if level == "sequence-mean-token":  # GSPO-token: the mean's value, each token's own gradient
            log_ratio = sg(log_ratio) + token_log_ratio - sg(token_log_ratio)
    inputs = Inputs(method, torch.exp(log_ratio), token_log_ratio, logprobs, advantages[:, None], m, old)
    per_token = torch.broadcast_to(EXPECTED[method.name](inputs), m.shape)
    return AGGREGATE[aggregation]((per_token * m).sum(-1), m)
