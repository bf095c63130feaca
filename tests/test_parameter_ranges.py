"""Every numeric hyperparameter at extreme values: refused at construction, or a finite, correct loss.

A library parameter that is finite but beyond what float32 holds (``eps_high=1e39``), or that
takes a loss term out of float32 (``SAPO(tau_pos=1e-300)``, ``VESPO(k_pos=1e30)``,
``KL(coef=1e39)``), must raise a ``ValueError`` naming it when the object is built, not fail or
give NaN at call time. Whatever is accepted must compute the loss the float64 computation
gives, in float32 (the compute dtype of every input but float64), with a finite gradient.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import softtrust as st

from helpers import random_batch

EXTREMES = (1e39, 1e-300, -1e39, 1e30)


def _numeric_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if "float" in str(f.type) or "int" in str(f.type)]


def _extras(logprobs: torch.Tensor, old: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every optional input a loss may need, in ``logprobs``' dtype (drawn in float64, then cast)."""
    gen = torch.Generator().manual_seed(3)
    shape = tuple(logprobs.shape)
    draw = torch.rand(shape, generator=gen, dtype=torch.float64)
    return {
        "rollout_logprobs": old + 0.2 * (draw - 0.5).to(old.dtype),
        "ref_logprobs": old - 0.3 * draw.flip(-1).to(old.dtype),
        "entropy": (2.0 * torch.rand(shape, generator=gen, dtype=torch.float64)).to(old.dtype),
    }


def _method(name: str, field: str):
    return lambda value: (st.PolicyLoss(name, **{field: value}), ())


def _option(option: str, aggregation: str, needs: tuple[str, ...]):
    return lambda value: (st.PolicyLoss("clip", aggregation=aggregation, **{option: value}), needs)


def _kl(estimator: str, corrected: bool):
    kl = lambda value: st.KL(value, estimator, importance_corrected=corrected)  # noqa: E731
    return lambda value: (st.PolicyLoss("clip", kl=kl(value)), ("ref_logprobs",))


def _correction(correction: type, fixed: dict, field: str):
    return lambda value: (
        st.PolicyLoss("clip", correction=correction(**fixed, **{field: value})),
        ("rollout_logprobs",),
    )


def _cases() -> list[tuple[str, str, object]]:
    """``(label, parameter, build)``: ``build(value)`` gives ``(loss_fn, names of the optional inputs)``."""
    cases = [
        (f"{name}.{field}", field, _method(name, field))
        for name, cls in st.METHODS.items()
        for field in _numeric_fields(cls)
    ]
    for option, aggregation, needs in (
        ("log_ratio_clamp", "token-mean", ()),
        ("max_completion_length", "seq-mean-token-sum-norm", ()),
        ("entropy_coef", "token-mean", ("entropy",)),
        ("entropy_quantile", "token-mean", ("entropy",)),
    ):
        cases.append((f"PolicyLoss.{option}", option, _option(option, aggregation, needs)))
    for estimator in st.KL_ESTIMATORS:
        for corrected in (False, True):
            cases.append((f"KL({estimator}, corrected={corrected}).coef", "coef", _kl(estimator, corrected)))
    corrections = [(st.TIS, {}), (st.MIS, {}), (st.OPSM, {})]
    corrections += [(st.Reject, {"divergence": d}) for d in ("k1", "k2", "k3", "ratio")]
    for correction, fixed in corrections:
        for field in _numeric_fields(correction):
            label = f"{correction.__name__}({fixed}).{field}"
            cases.append((label, field, _correction(correction, fixed, field)))
    return cases


CASES = _cases()


def _loss_and_grad(loss_fn, dtype, needs, **kwargs):
    logprobs, old, advantages, mask = random_batch(4, 6, seed=1, spread=0.5, dtype=torch.float64)
    logprobs, old, advantages = (x.to(dtype) for x in (logprobs, old, advantages))
    extras = _extras(logprobs, old)
    leaf = logprobs.clone().requires_grad_(True)
    out = loss_fn(leaf, old, advantages, mask, **{k: extras[k] for k in needs}, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out.loss.detach().double(), grad.double()


def _check_refusal_or_finite(build, parameter: str, value: float, **call_kwargs) -> None:
    try:
        loss_fn, needs = build(value)
        loss32, grad32 = _loss_and_grad(loss_fn, torch.float32, needs, **call_kwargs)
    except ValueError as error:  # refused: the message names the parameter and the value
        assert parameter in str(error) and repr(value) in str(error), str(error)
        return
    loss64, grad64 = _loss_and_grad(loss_fn, torch.float64, needs, **call_kwargs)
    assert torch.isfinite(loss32) and torch.isfinite(grad32).all(), (loss32, grad32)
    torch.testing.assert_close(loss32, loss64, rtol=1e-4, atol=1e-5)
    scale = grad64.abs().max().item()
    torch.testing.assert_close(grad32, grad64, rtol=1e-3, atol=1e-5 * max(scale, 1.0))


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize(("label", "parameter", "build"), CASES, ids=[case[0] for case in CASES])
def test_extreme_parameter_is_refused_at_construction_or_gives_the_float64_loss(
    label, parameter, build, value
):
    _check_refusal_or_finite(build, parameter, value)


@pytest.mark.parametrize("value", EXTREMES)
def test_extreme_kl_coef_of_a_call_is_refused_or_gives_the_float64_loss(value):
    def build(_value):
        return st.PolicyLoss("clip", kl=st.KL(0.1)), ("ref_logprobs",)

    _check_refusal_or_finite(build, "kl_coef", value, kl_coef=value)


def test_every_method_and_correction_has_extreme_cases():
    """The table above reaches every numeric field of every registered method (a new one is covered)."""
    labels = {label for label, _, _ in CASES}
    expected = {f"{name}.{field}" for name, cls in st.METHODS.items() for field in _numeric_fields(cls)}
    assert (
        expected <= labels and len(expected) >= 35
    )  # every method's float fields (REINFORCE, TOPR have none)
    assert sum(label.startswith("Reject") for label, _, _ in CASES) == 12  # 4 divergences x low/high/veto


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: st.Clip(eps_high=1e39), "eps_high must be 0 or of a magnitude in [1.175e-38, 3.403e+38]"),
        (lambda: st.SAPO(tau_pos=1e-300), "tau_pos must be 0 or of a magnitude"),
        (lambda: st.SAPO(tau_neg=1e-13), "tau_neg must be in [1e-12, 1e+12]: it multiplies and divides"),
        (lambda: st.CFPO(eps=1e-13), "eps must be >= 1e-12: it divides a loss term"),
        (lambda: st.DRO(beta=1e13), "beta must be <= 1e+12: it multiplies a loss term"),
        (lambda: st.KL(coef=1e39), "coef must be 0 or of a magnitude"),
        (lambda: st.KL(coef=3e38), "coef must be <= 1e+12"),
        (lambda: st.VESPO(k_pos=1e30), "k_pos=1e+30, lambda_pos=3.0: VESPO's weight"),
        (lambda: st.VESPO(k_neg=0.0, lambda_neg=40.0), "k_neg=0.0, lambda_neg=40.0: VESPO's weight"),
        (lambda: st.PolicyLoss("clip", log_ratio_clamp=30.0), "log_ratio_clamp must be <= 27.63"),
        (lambda: st.PolicyLoss("clip", entropy_coef=1e13), "entropy_coef must be <= 1e+12"),
    ],
)
def test_out_of_range_messages_name_the_parameter_and_the_range(build, expected):
    with pytest.raises(
        ValueError, match="^" + expected.replace("[", r"\[").replace("+", r"\+").replace("(", r"\(")
    ):
        build()


def test_vespo_peak_bound_accepts_the_paper_kernels_and_a_steep_one():
    """The bound refuses only a φ that leaves float32's comfortable range: the paper's (2, 3) and
    (3, 2) peak near 1.2, and k = 16, λ = 2 (φ peaks at W = 8, e^19.3 ≈ 2.3e8) is still accepted."""
    st.VESPO()
    assert st.methods.reweighting.vespo_log_phi_peak(2.0, 3.0) == pytest.approx(2 * math.log(2 / 3) + 1)
    st.VESPO(k_pos=16.0, lambda_pos=2.0)
    with pytest.raises(ValueError, match="k_pos=30.0, lambda_pos=2.0"):
        st.VESPO(k_pos=30.0, lambda_pos=2.0)


def test_bapo_grid_is_bounded_at_construction():
    """``low_step=1e-9`` would ask for a [3e8, B, T] search (killed for memory): refused, naming it."""
    with pytest.raises(
        ValueError, match=r"K = 1 \+ floor.*1 \+ 36 \+ 300000000 candidates, more than 1000.*low_step=1e-09"
    ):
        st.BAPO(low_step=1e-9)
    st.BAPO(high_step=0.01, low_step=0.001)  # 1 + 180 + 300 candidates: accepted
    assert len(st.BAPO(high_max=1e30, low_max=0.6).bounds_grid()[0]) == 1  # no lower step: one candidate
