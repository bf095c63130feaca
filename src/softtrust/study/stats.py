"""The study's statistics over seeds: intervals, paired tests, the Holm adjustment (pure functions).

Every value is a fraction (accuracies in [0, 1]) or a difference of two; none of these
functions reads a file. The quantiles and tail probabilities come from ``scipy.stats`` (the
``train`` extra; ``softtrust sweep`` checks for it before running any cell: ``report.require_report_dependencies``).
"""

from __future__ import annotations

import math

from softtrust._optional import import_optional

ALPHA = 0.05  # the family-wise error rate of the report's claims (Holm)


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def mean_std_ci(values: list[float]) -> dict:
    """Mean, sample std and the 95 % Student t half-width over seeds.

    ``ci95 = t_{0.975, n-1} · s / √n`` (``scipy.stats.t.ppf``); None values and non-finite
    ones are dropped; ``std`` and ``ci95`` are None with fewer than two values.
    Returns ``{"mean", "std", "ci95", "n", "values"}``.
    """
    stats = import_optional("scipy.stats", "the sweep's statistics")

    values = _finite(values)
    n = len(values)
    if n == 0:
        return {"mean": None, "std": None, "ci95": None, "n": 0, "values": []}
    mean = sum(values) / n
    if n == 1:
        return {"mean": mean, "std": None, "ci95": None, "n": 1, "values": values}
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return {
        "mean": mean,
        "std": std,
        "ci95": float(stats.t.ppf(0.975, n - 1)) * std / math.sqrt(n),
        "n": n,
        "values": values,
    }


def paired_t_test(differences: list[float]) -> dict:
    """The paired t-test of per-seed differences ``d_s = x[a, s] − x[b, s]`` against 0.

    ``t = mean(d) / (s_d / √n)`` with ``n − 1`` degrees of freedom; ``p`` is two-sided
    (``scipy.stats.t.sf``), None with fewer than two differences. All differences equal
    and non-zero gives ``p = 0`` (no spread), all zero gives ``p = 1``.
    Returns ``mean_std_ci``'s dict plus ``{"test": "t", "p"}``.
    """
    stats = import_optional("scipy.stats", "the sweep's statistics")

    stat = mean_std_ci(differences)
    p = None
    if stat["n"] >= 2:
        if stat["std"] == 0:
            p = 1.0 if stat["mean"] == 0 else 0.0
        else:
            t = stat["mean"] / (stat["std"] / math.sqrt(stat["n"]))
            p = float(2 * stats.t.sf(abs(t), stat["n"] - 1))
    return {**stat, "test": "t", "p": p}


def sign_test(differences: list[float]) -> dict:
    """The exact two-sided sign test of per-seed differences (for bimodal outcomes).

    Counts the seeds with ``d_s > 0`` and ``d_s < 0`` (ties dropped) and tests them
    against Binomial(n, 1/2) (``scipy.stats.binomtest``). It assumes nothing about the
    shape of the spread, so it stays valid when some runs collapse and others do not;
    its price: with 5 seeds the smallest possible p is 2 / 2⁵ = 0.0625.
    Returns ``mean_std_ci``'s dict plus ``{"test": "sign", "p", "positive", "negative"}``.
    """
    stats = import_optional("scipy.stats", "the sweep's statistics")

    values = _finite(differences)
    positive, negative = sum(v > 0 for v in values), sum(v < 0 for v in values)
    p = float(stats.binomtest(positive, positive + negative, 0.5).pvalue) if positive + negative else None
    return {**mean_std_ci(values), "test": "sign", "p": p, "positive": positive, "negative": negative}


def holm(p_values: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values (Holm 1979).

    With the m given p-values sorted, ``p_(1) ≤ … ≤ p_(m)``, the adjusted values are
    ``p̃_(i) = min(1, max_{j ≤ i} (m − j + 1) · p_(j))``; a hypothesis is rejected at
    family-wise level α when ``p̃ ≤ α``. None entries (no test possible) are passed
    through and do not count in m. Order is kept: ``result[k]`` adjusts ``p_values[k]``.
    """
    indexed = sorted((p, k) for k, p in enumerate(p_values) if p is not None)
    m = len(indexed)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, k) in enumerate(indexed):
        if not (0.0 <= p <= 1.0):
            raise ValueError(f"p_values: expected values in [0, 1], got {p} at index {k}")
        running = max(running, (m - rank) * p)
        adjusted[k] = min(1.0, running)
    return adjusted
