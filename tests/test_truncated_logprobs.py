"""Oracle tests for truncated sampling (top-k, top-p): ``softtrust.truncation`` and ``token_logprobs(top_k=, top_p=)``.

The support rule is checked on hand-made rows (closed forms) and against Hugging Face's own
warpers; the fused log-probs against a dense float64 oracle (full logits, the support mask
plus the label, masked log-softmax) in value and gradient; and the point of it all: a
sampler that draws from the truncated distribution sees ratio 1 from the truncated
learner and the kept mass P(S) from the full-softmax learner.
"""

from __future__ import annotations

import math

import pytest
import torch

import softtrust as st
from softtrust.logprobs import completion_logprobs, token_logprobs
from softtrust.truncation import (
    sample_truncated,
    truncated_log_softmax,
    truncation_mask,
    truncation_threshold,
)

from budgets import EPS32, rounding_budget

pytestmark = (
    pytest.mark.numerics
)  # the truncated log-prob kernels against a float64 oracle: the outcome depends on float paths

N, D, V = 37, 16, 101  # prime: no chunk size divides them
# float32 against the float64 oracle: each value sums <= V = 101 exponentials, ~eps32·√V of its
# size; ×10 margin ≈ 1.2e-5, relative above 1, absolute below (test_logprobs.FP32_TOL)
FP32_BUDGET = rounding_budget(EPS32, terms=V)
TRUNCATIONS = [(1, None), (3, None), (None, 0.5), (None, 0.9), (5, 0.8), (40, 0.95)]


def make_inputs(n=N, dim=D, vocab=V, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=generator)  # [N, d]
    weight = scale * torch.randn(vocab, dim, generator=generator)  # [V, d]
    bias = 0.5 * torch.randn(vocab, generator=generator)  # [V]
    labels = torch.randint(0, vocab, (n,), generator=generator)  # [N]
    return hidden, weight, bias, labels


def dense_reference(hidden, weight, bias, labels, temperature, top_k, top_p):
    """float64 oracle: support = truncation_mask(z) plus the label; masked log-softmax; its entropy."""
    logits = (hidden @ weight.T + bias) / temperature  # [N, V]
    keep = truncation_mask(logits.detach(), top_k, top_p)  # [N, V]
    keep = keep.scatter(1, labels.unsqueeze(1), True)
    log_probs = torch.log_softmax(logits.masked_fill(~keep, -math.inf), dim=-1)  # [N, V]
    picked = log_probs.gather(1, labels.unsqueeze(1)).squeeze(1)  # [N]
    # 0 log 0 = 0 off the support, with a NaN-free gradient (no -inf inside the product).
    entropy = -(log_probs.exp() * torch.where(keep, log_probs, 0)).sum(-1)  # [N]
    return picked, entropy, keep


# ---- the support rule ---------------------------------------------------------------------


def test_top_k_keeps_every_logit_tied_with_the_kth():
    logits = torch.tensor([[3.0, 2.0, 1.0, 2.0, 2.0, 0.5]])
    assert truncation_mask(logits, top_k=2).tolist() == [[True, True, False, True, True, False]]
    assert truncation_mask(logits, top_k=1).tolist() == [[True, False, False, False, False, False]]
    assert truncation_mask(logits, top_k=6).all() and truncation_mask(logits, top_k=100).all()


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.05, 1), (0.45, 1), (0.55, 2), (0.75, 2), (0.85, 3), (0.97, 4), (1.0, 4)],
)
def test_top_p_keeps_the_fewest_largest_tokens_whose_mass_reaches_top_p(top_p, kept):
    # Sorted probabilities 0.5, 0.3, 0.15, 0.05 (shuffled): token j stays iff the mass
    # strictly above it is < top_p, i.e. exclusive masses 0, 0.5, 0.8, 0.95.
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
    mask = truncation_mask(probs.log().unsqueeze(0), top_p=top_p)[0]
    order = probs.argsort(descending=True)
    assert mask[order].tolist() == [True] * kept + [False] * (4 - kept)


def test_top_p_sees_the_top_k_renormalised_row():
    # p = 0.4, 0.3, 0.2, 0.1. top-k=2 renormalises to 4/7, 3/7: top-p 0.5 keeps one token;
    # top-p alone on the full row would keep two (0.4 < 0.5), and top-p before top-k two.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64).log()
    assert truncation_mask(logits, top_k=2, top_p=0.5).tolist() == [[True, False, False, False]]
    assert truncation_mask(logits, top_p=0.5).tolist() == [[True, True, False, False]]


def test_temperature_comes_before_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    hot = truncated_log_softmax(logits, temperature=4.0, top_p=0.7).isfinite()
    cold = truncated_log_softmax(logits, temperature=0.5, top_p=0.7).isfinite()
    # p = .35, .27, .21, .17 at T = 4 (flatter: more tokens to reach 0.7) against .87, .12, .02, .00 at T = 0.5
    assert hot.sum() == 3 and cold.sum() == 1


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"), [(5, None, 0.7), (None, 0.8, 1.3), (20, 0.9, 0.6)]
)
def test_support_equals_hugging_face_temperature_top_k_top_p_warpers(top_k, top_p, temperature):
    warpers = pytest.importorskip("transformers.generation.logits_process")
    logits = 3.0 * torch.randn(64, 257, generator=torch.Generator().manual_seed(1))  # [B, V], no ties
    hf = warpers.TemperatureLogitsWarper(temperature)(None, logits)
    if top_k is not None:
        hf = warpers.TopKLogitsWarper(top_k)(None, hf)
    if top_p is not None:
        hf = warpers.TopPLogitsWarper(top_p)(None, hf)
    ours = truncation_mask(logits / temperature, top_k, top_p)
    assert torch.equal(ours, hf.isfinite())
    torch.testing.assert_close(
        truncated_log_softmax(logits, temperature=temperature, top_k=top_k, top_p=top_p),
        torch.log_softmax(hf, dim=-1),
    )


def test_threshold_is_minus_inf_without_truncation_and_a_row_value_with_it():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(2))
    assert torch.equal(truncation_threshold(logits), torch.full((4,), -math.inf))
    assert torch.equal(truncation_threshold(logits, top_p=1.0), torch.full((4,), -math.inf))
    threshold = truncation_threshold(logits, top_k=3, top_p=0.9)
    assert ((logits == threshold.unsqueeze(1)).sum(1) == 1).all()  # the smallest kept logit


# ---- the fused learner against the dense oracle -------------------------------------------


@pytest.mark.parametrize(("top_k", "top_p"), TRUNCATIONS)
@pytest.mark.parametrize(
    ("temperature", "chunk_size", "vocab_chunk_size"),
    [(0.7, 5, 16), (1.0, None, None), (1.3, 1, 7), (1.3, N, V - 1), (0.7, 4, V)],
)
def test_values_entropy_and_grads_match_the_dense_float64_oracle(
    top_k, top_p, temperature, chunk_size, vocab_chunk_size
):
    hidden, weight, bias, labels = make_inputs(scale=0.6)
    labels[::3] = (hidden @ weight.T + bias).argmax(1)[::3]  # some labels in every support
    fused = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    oracle = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    logprobs, entropy = token_logprobs(
        fused[0],
        fused[1],
        labels,
        bias=fused[2],
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        with_entropy=True,
        top_k=top_k,
        top_p=top_p,
    )
    ref_logprobs, ref_entropy, keep = dense_reference(*oracle, labels, temperature, top_k, top_p)
    assert keep.sum(1).min() < V  # it does truncate
    generator = torch.Generator().manual_seed(3)
    grad_logp, grad_ent = torch.randn(2, N, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((logprobs * grad_logp.float() + entropy * grad_ent.float()).sum(), fused)
    ref_grads = torch.autograd.grad((ref_logprobs * grad_logp + ref_entropy * grad_ent).sum(), oracle)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, atol=FP32_BUDGET, rtol=FP32_BUDGET)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=FP32_BUDGET, rtol=FP32_BUDGET)
    # gradients sum N = 37 rows of V-term products, with cancellation: 10·eps32·√(N·V) ≈ 7e-5
    grad_budget = rounding_budget(EPS32, terms=N * V)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), expected, atol=FP32_BUDGET, rtol=grad_budget)


@pytest.mark.parametrize(("top_k", "top_p"), [(2, None), (None, 0.7), (4, 0.9)])
def test_logprob_only_grads_match_in_float64_and_pass_gradcheck(top_k, top_p):
    hidden, weight, bias, labels = (
        t.double() if t.is_floating_point() else t for t in make_inputs(n=6, dim=4, vocab=13)
    )
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    logprobs = token_logprobs(
        *leaves[:2],
        labels,
        bias=leaves[2],
        temperature=0.8,
        chunk_size=3,
        vocab_chunk_size=5,
        top_k=top_k,
        top_p=top_p,
    )
    ref, _, _ = dense_reference(*leaves, labels, 0.8, top_k, top_p)
    # float64 in another order: 13 terms of size ~3, 10·eps64·√13·3 ≈ 2.4e-14; ×40 (gradients too)
    torch.testing.assert_close(logprobs, ref, atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad(logprobs.sum(), leaves)
    ref_grads = torch.autograd.grad(ref.sum(), leaves)
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    # Finite differences: the support is locally constant at a random point.
    assert torch.autograd.gradcheck(
        lambda h, w: token_logprobs(h, w, labels, temperature=0.8, chunk_size=3, top_k=top_k, top_p=top_p),
        (leaves[0].detach().requires_grad_(), leaves[1].detach().requires_grad_()),
    )


def test_no_truncation_takes_the_default_path_bit_for_bit():
    hidden, weight, bias, labels = make_inputs()
    plain = token_logprobs(hidden, weight, labels, bias=bias, temperature=0.9)
    for top_k, top_p in [(None, 1.0), (V, None), (V + 5, 1.0)]:
        same = token_logprobs(hidden, weight, labels, bias=bias, temperature=0.9, top_k=top_k, top_p=top_p)
        assert torch.equal(same, plain)


def test_ignored_rows_stay_zero_with_zero_grad_under_truncation():
    hidden, weight, bias, labels = make_inputs()
    labels[4:9] = -100
    hidden[5] = math.nan
    leaf = hidden.clone().requires_grad_()
    logprobs = token_logprobs(leaf, weight, labels, bias=bias, top_k=4, top_p=0.9)
    (grad,) = torch.autograd.grad(logprobs.sum(), leaf)
    assert (logprobs[4:9] == 0).all() and logprobs.isfinite().all()
    assert (grad[4:9] == 0).all() and grad.isfinite().all()


def test_bf16_inputs_match_the_float64_oracle_within_bf16_tolerance():
    hidden, weight, _, labels = make_inputs(scale=0.6)
    logprobs = token_logprobs(hidden.bfloat16(), weight.bfloat16(), labels, top_k=10, top_p=0.9)
    assert logprobs.dtype == torch.float32
    hidden, weight = hidden.bfloat16().double(), weight.bfloat16().double()
    ref, _, _ = dense_reference(hidden, weight, torch.zeros(V, dtype=torch.float64), labels, 1.0, 10, 0.9)
    # the bf16 bound of test_logprobs.assert_close_bf16: 2 · 2^-9 · |z| (+2% for larger |log p|)
    torch.testing.assert_close(logprobs.double(), ref, atol=0.05, rtol=0.02)


# ---- labels outside the current support (stale samples) -----------------------------------


def test_a_label_outside_the_support_gets_a_finite_log_prob_below_every_supported_token():
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0, -2.0]], dtype=torch.float64)  # hidden = logits, W = I
    weight = torch.eye(5, dtype=torch.float64)
    for label in (2, 3, 4):  # all outside the top-2 support
        leaf = logits.clone().requires_grad_()
        logprob = token_logprobs(leaf, weight, torch.tensor([label]), top_k=2)
        (grad,) = torch.autograd.grad(logprob.sum(), leaf)
        kept = torch.tensor([4.0, 3.0, logits[0, label].item()], dtype=torch.float64)
        expected = logits[0, label] - torch.logsumexp(kept, 0)  # log p_y / (P(S) + p_y)
        torch.testing.assert_close(logprob, expected.reshape(1))
        supported = torch.log_softmax(logits[0, :2], 0)
        assert logprob.item() < supported.min().item()
        # d/dz: onehot(y) - softmax over S ∪ {y}; 0 on the other dropped tokens.
        probs = torch.zeros(5, dtype=torch.float64)
        probs[[0, 1, label]] = torch.softmax(kept, 0)
        torch.testing.assert_close(
            grad[0], torch.nn.functional.one_hot(torch.tensor(label), 5).double() - probs
        )


def test_stale_out_of_support_tokens_give_finite_loss_and_grads_through_the_policy_loss():
    # The learner moved: every sampled token left the current top-1 support.
    hidden, weight, _, _ = make_inputs(n=12, vocab=V)
    logits = hidden @ weight.T  # [12, V]
    labels = logits.argsort(1)[:, 0]  # the least likely token of each row
    old_logprobs = torch.full((1, 12), -0.1)
    advantages = torch.tensor([[1.0] * 6 + [-1.0] * 6])
    for method in ("clip", "cispo", "gspo", "vespo"):
        leaf = hidden.clone().requires_grad_()
        logprobs = token_logprobs(leaf, weight, labels, top_k=1).view(1, 12)
        assert logprobs.isfinite().all() and (logprobs - old_logprobs < -20).any()  # the clamp engages
        out = st.PolicyLoss(method)(logprobs, old_logprobs, advantages, torch.ones(1, 12))
        (grad,) = torch.autograd.grad(out.loss, leaf, allow_unused=True)
        assert out.loss.isfinite()
        assert grad is None or grad.isfinite().all()


# ---- on-policy ratio with truncated sampling ----------------------------------------------


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"), [(3, None, 1.0), (None, 0.8, 0.7), (20, 0.9, 1.2)]
)
@pytest.mark.parametrize("draw", ["multinomial", "inverse-cdf"])
def test_on_policy_ratio_is_one_for_the_truncated_learner_and_the_kept_mass_for_the_full_one(
    top_k, top_p, temperature, draw
):
    hidden, weight, bias, _ = make_inputs(n=200, vocab=V, seed=4)
    logits = hidden @ weight.T + bias  # [N, V], what the sampler's LM head computes
    generator = torch.Generator().manual_seed(5)
    uniform = torch.rand(200, generator=generator, dtype=torch.float64) if draw == "inverse-cdf" else None
    tokens, old_logprobs = sample_truncated(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform, generator=generator
    )
    assert truncation_mask(logits / temperature, top_k, top_p).gather(1, tokens.unsqueeze(1)).all()

    truncated = token_logprobs(
        hidden, weight, tokens, bias=bias, temperature=temperature, top_k=top_k, top_p=top_p
    )
    # the sampler's and the learner's float32 log-softmax over <= V logits of size |z|/T, in
    # other orders: 10·eps32·√V·|z|max/T (|z| <= 20: 2-3.5e-4; measured 1.4e-6); a wrong support moves
    # the log-prob by the log of the mass it adds or drops (> 0.05, below)
    budget = rounding_budget(EPS32, terms=V, scale=float(logits.abs().max()) / temperature)
    torch.testing.assert_close(truncated - old_logprobs, torch.zeros(200), atol=budget, rtol=0)

    # The full-softmax learner on the same samples: ratio = P(S), the kept mass, not 1.
    full = token_logprobs(hidden, weight, tokens, bias=bias, temperature=temperature)
    scaled = logits / temperature
    kept_mass = torch.where(truncation_mask(scaled, top_k, top_p), scaled.softmax(-1), 0).sum(-1)  # [N]
    torch.testing.assert_close((full - old_logprobs).exp(), kept_mass, atol=budget, rtol=0)
    assert ((full - old_logprobs).exp() - 1).abs().max() > 0.05


def test_inverse_cdf_never_lands_off_the_support_at_u_near_one():
    logits = torch.tensor([[5.0, 4.0, -3.0, -3.5]]).repeat(3, 1)
    uniform = torch.tensor([0.0, 0.999999, 1.0 - 1e-16], dtype=torch.float64)
    tokens, logprobs = sample_truncated(logits, top_k=2, uniform=uniform)
    assert tokens.tolist() == [0, 1, 1] and logprobs.isfinite().all()


def test_completion_logprobs_score_the_truncated_policy_of_the_model_logits():
    pytest.importorskip("transformers")
    from softtrust.train.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer).float()
    batch = tokenizer(["12+30=42", "7*6=42!!"], return_tensors="pt", padding=True)
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    keep = 5
    got = completion_logprobs(model, input_ids, attention_mask, keep, temperature=0.7, top_k=4, top_p=0.9)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[
            :, -keep - 1 : -1
        ]  # [B, K, V]
    labels = input_ids[:, -keep:]  # [B, K]
    ref = (
        torch.log_softmax(
            (logits / 0.7).masked_fill(
                ~truncation_mask(logits / 0.7, 4, 0.9).scatter(-1, labels.unsqueeze(-1), True), -math.inf
            ),
            dim=-1,
        )
        .gather(-1, labels.unsqueeze(-1))
        .squeeze(-1)
    )
    torch.testing.assert_close(got.detach(), ref, atol=FP32_BUDGET, rtol=FP32_BUDGET)  # float32, other order


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 0}, "top_k must be a positive int or None.*got 0"),
        ({"top_k": -2}, "top_k must be a positive int or None.*got -2"),
        ({"top_k": True}, "top_k must be a positive int or None.*got True"),
        ({"top_k": 2.0}, "top_k must be a positive int or None.*got 2.0"),
        ({"top_p": 0.0}, "top_p must be > 0.0, got 0.0"),
        ({"top_p": -0.5}, "top_p must be > 0.0"),
        ({"top_p": 1.5}, "top_p must be <= 1.0, got 1.5"),
        ({"top_p": True}, "top_p must be a number in .0, 1. or None.*got True"),
        ({"top_p": math.nan}, "top_p must be a finite number, got nan"),
        ({"top_p": "0.9"}, "top_p must be a finite number"),
    ],
)
def test_bad_truncation_arguments_raise_value_errors_naming_them(kwargs, match):
    hidden, weight, _, labels = make_inputs()
    with pytest.raises(ValueError, match=match):
        token_logprobs(hidden, weight, labels, **kwargs)
    with pytest.raises(ValueError, match=match):
        truncation_mask(hidden @ weight.T, **kwargs)
    with pytest.raises(ValueError, match=match):
        sample_truncated(hidden @ weight.T, **kwargs)


def test_without_truncation_the_sampler_helper_draws_what_the_trainer_sampler_draws():
    # The trainer's inverse-CDF sampler (rollout.py) can switch to sample_truncated unchanged.
    rollout = pytest.importorskip("softtrust.train.rollout")
    generator = torch.Generator().manual_seed(6)
    logits = 2.0 * torch.randn(64, 50, generator=generator)
    uniform = torch.rand(64, generator=generator, dtype=torch.float64)
    log_probs = torch.log_softmax(logits / 0.7, dim=-1)
    tokens, logprobs = sample_truncated(logits, temperature=0.7, uniform=uniform)
    assert torch.equal(tokens, rollout.inverse_cdf_sample(log_probs, uniform))
    assert torch.equal(logprobs, log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1))
