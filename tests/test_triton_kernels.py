"""softtrust's Triton tile kernels (softtrust/_triton.py) against the PyTorch path.

The kernels run on CUDA; here triton's interpreter (``TRITON_INTERPRET=1``) runs them on
CPU tensors, in a fresh interpreter because triton reads that variable when it compiles.
Skipped when triton is not installed (the ``dev`` extra installs it on Linux); the GPU
benchmark (benchmarks/bench_gpu.py) checks them on a GPU against float64.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import softtrust

from budgets import EPS32, rounding_budget

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.numerics,  # the interpreted kernels against the PyTorch tile ops, in float32 and bf16
    pytest.mark.costly,
]

SCRIPT = r"""
import json, os, warnings, torch
import softtrust._triton as kernels
from softtrust.logprobs import token_logprobs

calls = {"fold": 0, "grad_tile": 0}
for name in calls:
    real = getattr(kernels, name)
    def counted(*args, _real=real, _name=name, **kwargs):
        calls[_name] += 1
        return _real(*args, **kwargs)
    setattr(kernels, name, counted)

def inputs(dtype):
    generator = torch.Generator().manual_seed(0)
    n, dim, vocab = 45, 12, 1500
    hidden = torch.randn(n, dim, generator=generator).to(dtype).requires_grad_()
    weight = (0.4 * torch.randn(vocab, dim, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=generator)
    labels[::7] = -100
    labels[1:6] = torch.tensor([0, vocab - 1, 332, 333, 666])  # first, last, either side of a chunk edge
    return hidden, weight, labels, torch.randn(n, generator=generator)

def run(dtype, chunk, vocab_chunk, temperature, mode):
    os.environ["SOFTTRUST_TRITON"] = mode  # "interpret": the kernels; "0": PyTorch tile ops
    hidden, weight, labels, upstream = inputs(dtype)
    logp = token_logprobs(hidden, weight, labels, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vocab_chunk)
    grads = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
    return [logp.double(), *(g.double() for g in grads)]

errors = {}
for dtype in (torch.float32, torch.bfloat16):
    for chunk, vocab_chunk, temperature in ((None, None, 0.7), (7, 333, 1.0), (45, 1500, 1.3)):
        got = run(dtype, chunk, vocab_chunk, temperature, "interpret")
        expected = run(dtype, chunk, vocab_chunk, temperature, "0")
        key = f"{dtype}-{chunk}-{vocab_chunk}-{temperature}"
        errors[key] = [((g - e).abs().max() / e.abs().max().clamp(min=1)).item() for g, e in zip(got, expected)]
used = dict(calls)

# Cases the kernels must leave to the PyTorch tile ops: a bias, the entropy, float64.
skipped = {}
os.environ["SOFTTRUST_TRITON"] = "interpret"
for case in ("bias", "entropy", "float64"):
    calls.update(fold=0, grad_tile=0)
    hidden, weight, labels, upstream = inputs(torch.float64 if case == "float64" else torch.float32)
    bias = torch.zeros(weight.shape[0], requires_grad=True) if case == "bias" else None
    out = token_logprobs(hidden, weight, labels, bias=bias, with_entropy=case == "entropy")
    logp = out[0] if case == "entropy" else out
    objective = (logp * upstream.to(logp.dtype)).sum()
    if case == "entropy":  # differentiated: its gradient tile is PyTorch's (a logged entropy is not)
        objective = objective + out[1].sum()
    objective.backward()
    skipped[case] = dict(calls)

# A kernel that computes something else fails the first-use check: a warning, PyTorch tile ops.
kernels._works_on.cache_clear()
real_grad = kernels.grad_tile
kernels.grad_tile = lambda *args: real_grad(*args).mul_(1.01)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    broken = kernels.available(torch.device("cpu"))
print(json.dumps({"errors": errors, "calls": used, "skipped": skipped, "broken": broken,
                  "warning": [str(w.message) for w in caught]}))
"""


def test_kernels_match_the_pytorch_path_values_and_gradients():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    src = str(Path(softtrust.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # 6 configurations: fold once per tile in forward, grad_tile once per tile in backward
    # (plus one call of each for the first-use check)
    assert result["calls"]["fold"] > 6 and result["calls"]["grad_tile"] == result["calls"]["fold"]
    assert result["skipped"] == {case: {"fold": 0, "grad_tile": 0} for case in ("bias", "entropy", "float64")}
    assert result["broken"] is False
    assert any("Triton tile kernels unavailable on cpu" in w for w in result["warning"]), result["warning"]
    for key, errors in result["errors"].items():
        # fp32: the same math in another order, relative to max(|value|, 1): a log-softmax over
        # 1500 entries (gradients: 45 rows), 10·eps32·√1500 ≈ 4.6e-5. bf16: the gradient tile is
        # rounded to bf16 in both paths, where an exp that differs in its last fp32 bit flips a
        # rounding; the gradients, bf16 too, then differ by a few bf16 ulps (2^-8 relative
        # each): 2e-2 is 5 of them, the bf16 tolerance of the other tests. A misplaced label
        # costs O(1) in either dtype.
        tolerance = rounding_budget(EPS32, terms=1500) if "float32" in key else 2e-2
        assert max(errors) <= tolerance, (key, errors)
