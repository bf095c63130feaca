"""Peak CPU memory of one call, as the kernel sees it (resident set high-water mark).

PyTorch's CPU allocator takes large tensors from glibc's ``malloc``, which maps blocks
above its mmap threshold straight from the kernel and returns them on free, so the
resident set size tracks live tensors. glibc raises that threshold (up to 32 MiB) each
time it frees a mapped block, after which blocks of that size come from the heap and stay
resident when freed: memory measured after a warm-up then starts from a baseline that
already holds them, and the peak is understated. A process that measures after a warm-up
runs with :data:`FIXED_MMAP_ENV`, which fixes the threshold at 1 MiB. The peak is read from ``VmHWM`` in
``/proc/self/status`` after resetting it (``echo 5 > /proc/self/clear_refs``, Linux
>= 4.0). ``getrusage(RUSAGE_SELF).ru_maxrss`` is the fallback where that is not
possible; it cannot be reset, and in a child process it also remembers the parent's
resident size at fork, so run the measurement in a fresh interpreter.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path

# Environment for a measuring process: every block of 1 MiB or more is mapped and returned on free.
FIXED_MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset the resident high-water mark to the current resident size; False if unsupported."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def current_rss_kib() -> int:
    """Resident set size now, in KiB."""
    value = _status_kib("VmRSS")
    return value if value is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_rss_kib() -> int:
    """Resident set high-water mark, in KiB (since the last ``reset_peak``)."""
    value = _status_kib("VmHWM")
    return value if value is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_delta_mib(fn: Callable[[], object]) -> tuple[float, str]:
    """Peak resident memory ``fn()`` adds above the current resident size, in MiB, and the method used."""
    exact = reset_peak()
    baseline = current_rss_kib()
    fn()
    method = "VmHWM (reset)" if exact else "ru_maxrss"
    return (peak_rss_kib() - baseline) / 1024.0, method


def heap_allocations(limit: int = 1 << 28) -> bool:
    """Serve every block below ``limit`` bytes from glibc's heap and keep freed memory mapped.

    For timing: with glibc's default, dynamic mmap threshold, a block above it is mapped
    from the kernel on every allocation and page-faulted on first touch, so which variant
    pays the faults depends on the order of allocations and frees in a round-robin run, not
    on its own work (a variant that allocates a few more [B, T] temporaries measured 0.6x at
    64 x 4096 against 0.97x with this fixed). Returns False where ``mallopt`` is missing.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, limit)) and bool(libc.mallopt(m_trim_threshold, limit))
    except (OSError, AttributeError):
        return False
