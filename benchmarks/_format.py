"""Text shared by the benchmarks' written readings."""


def span(values: list[float]) -> str:
    """``0.94–1.16×``, or ``1.02×`` when every value prints the same to 2 decimals."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}×" if low == high else f"{low}–{high}×"
