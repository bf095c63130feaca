"""Entropy terms of the loss: the high-entropy selection (``entropy_quantile``, TRL's
``top_entropy_quantile``, arXiv 2506.01939) and the entropy bonus (``entropy_coef``)."""

from __future__ import annotations

import math

import pytest
import torch

import softtrust as st
from softtrust.entropy import ENTROPY_THRESHOLD, entropy_threshold, high_entropy_mask

from helpers import loss_and_grad, random_batch


def entropies(shape, seed=0, dtype=torch.float64):
    return 3 * torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("quantile", [1.0, 0.8, 0.5, 0.2, 0.01, 0.0])
def test_threshold_is_torch_quantile_of_the_active_entropies(dtype, quantile):
    _, _, _, mask = random_batch(6, 9, seed=2)
    entropy = entropies(mask.shape, seed=2, dtype=dtype)
    entropy[~mask] = math.nan  # masked positions never count
    expected = torch.quantile(entropy[mask], 1 - quantile)
    assert torch.equal(entropy_threshold(entropy, mask, quantile), expected)


def test_threshold_with_one_or_no_active_token():
    entropy = torch.tensor([[0.3, 2.0, 1.0]])
    one = torch.tensor([[False, True, False]])
    assert entropy_threshold(entropy, one, 0.2) == 2.0
    assert entropy_threshold(entropy, torch.zeros_like(one), 0.2) == math.inf
    assert not high_entropy_mask(entropy, torch.zeros_like(one), math.inf).any()


def test_quantile_keeps_the_policy_gradient_on_the_top_entropy_tokens_only():
    logprobs, old, advantages, mask = random_batch(6, 9, seed=4, spread=0.3)
    entropy = entropies(mask.shape, seed=4)
    loss_fn = st.PolicyLoss("reinforce", aggregation="token-sum", entropy_quantile=0.3)
    _, grad, metrics = loss_and_grad(loss_fn, logprobs, old, advantages, mask, entropy=entropy)
    kept = entropy >= torch.quantile(entropy[mask], 0.7)
    kept &= mask
    torch.testing.assert_close(grad, -advantages[:, None] * kept, rtol=0, atol=0)
    assert metrics["entropy/kept"] == pytest.approx(float(kept.sum() / mask.sum()), rel=1e-6)
    assert 0.25 < metrics["entropy/kept"] < 0.4
    assert metrics["entropy/mean"] == pytest.approx(float(entropy[mask].mean()), rel=1e-6)


@pytest.mark.parametrize("quantile", [1.0, 0.4])
def test_entropy_bonus_subtracts_coef_times_entropy_on_the_kept_tokens(quantile):
    logprobs, old, advantages, mask = random_batch(6, 9, seed=5, spread=0.3)
    entropy = entropies(mask.shape, seed=5).requires_grad_(True)
    base = st.PolicyLoss("clip", entropy_quantile=quantile)
    bonus = st.PolicyLoss("clip", entropy_quantile=quantile, entropy_coef=0.05)
    out = bonus(logprobs, old, advantages, mask, entropy=entropy)
    without = base(logprobs, old, advantages, mask, entropy=entropy.detach())
    kept = mask & (entropy.detach() >= torch.quantile(entropy.detach()[mask], 1 - quantile))
    expected_bonus = (entropy.detach() * kept).sum() / mask.sum()  # token-mean over every active token
    torch.testing.assert_close(out.loss, without.loss - 0.05 * expected_bonus, rtol=1e-12, atol=1e-14)
    (grad,) = torch.autograd.grad(out.loss, entropy)
    torch.testing.assert_close(grad, -0.05 * kept.double() / mask.sum(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", ["clip", "vespo", "m2po"])
def test_micro_batches_with_the_global_threshold_add_up_to_the_whole_batch(method):
    logprobs, old, advantages, mask = random_batch(8, 7, seed=6, spread=0.3)
    entropy = entropies(mask.shape, seed=6)
    loss_fn = st.PolicyLoss(method, entropy_quantile=0.3, entropy_coef=0.01)
    assert loss_fn.uses_batch_state and loss_fn.needs_entropy
    whole, whole_grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask, entropy=entropy)
    state = loss_fn.batch_state(logprobs, old, advantages, mask, entropy=entropy)
    assert ENTROPY_THRESHOLD in state
    total, grads, local = 0.0, [], 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        args = (logprobs[rows], old[rows], advantages[rows], mask[rows])
        kwargs = dict(entropy=entropy[rows], num_tokens=mask.sum())
        loss, grad, _ = loss_and_grad(loss_fn, *args, state=state, **kwargs)
        total, grads = total + loss, [*grads, grad]
        local += loss_and_grad(loss_fn, *args, **kwargs)[0]
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat(grads), whole_grad, rtol=1e-12, atol=1e-14)
    assert not torch.isclose(local, whole, rtol=1e-6, atol=0), "each piece's own threshold should differ"


def test_masked_entropy_never_matters():
    logprobs, old, advantages, mask = random_batch(5, 6, seed=7)
    entropy = entropies(mask.shape, seed=7)
    poisoned = entropy.clone()
    poisoned[~mask] = math.nan
    loss_fn = st.PolicyLoss("clip", entropy_quantile=0.5, entropy_coef=0.1)
    clean = loss_and_grad(loss_fn, logprobs, old, advantages, mask, entropy=entropy)
    dirty = loss_and_grad(loss_fn, logprobs, old, advantages, mask, entropy=poisoned)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


def test_entropy_terms_compile_whole():
    logprobs, old, advantages, mask = random_batch(5, 6, seed=8)
    entropy = entropies(mask.shape, seed=8)
    loss_fn = st.PolicyLoss("cispo", entropy_quantile=0.4, entropy_coef=0.02, check_values=False)
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    eager = loss_and_grad(loss_fn, logprobs, old, advantages, mask, entropy=entropy)
    value = loss_and_grad(compiled, logprobs, old, advantages, mask, entropy=entropy)
    torch.testing.assert_close(value[0], eager[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(value[1], eager[1], rtol=1e-12, atol=1e-14)


def test_entropy_is_reported_when_given_and_ignored_otherwise():
    logprobs, old, advantages, mask = random_batch(5, 6, seed=9)
    entropy = entropies(mask.shape, seed=9)
    loss_fn = st.PolicyLoss("clip")
    plain = loss_and_grad(loss_fn, logprobs, old, advantages, mask)
    reported = loss_and_grad(loss_fn, logprobs, old, advantages, mask, entropy=entropy)
    assert torch.equal(plain[0], reported[0]) and "entropy/mean" in reported[2]
    assert "entropy/mean" not in plain[2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"entropy_quantile": -0.1}, "entropy_quantile must be >= 0.0"),
        ({"entropy_coef": -0.01}, "entropy_coef must be >= 0.0"),
        ({"entropy_quantile": 1.5}, "entropy_quantile must be <= 1.0"),
        ({"entropy_quantile": math.nan}, "entropy_quantile must be a finite number"),
        ({"entropy_coef": math.inf}, "entropy_coef must be a finite number"),
        ({"entropy_coef": "0.1"}, "entropy_coef must be a finite number"),
    ],
)
def test_error_bad_entropy_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        st.PolicyLoss("clip", **kwargs)


@pytest.mark.parametrize(
    ("entropy", "message"),
    [
        (None, r"entropy_coef=0.1, entropy_quantile=1.0 need entropy="),
        (
            torch.zeros(5, 5, dtype=torch.float64),
            r"entropy must have shape \(B, T\) like logprobs = \(5, 6\)",
        ),
        (torch.zeros(5, 6, dtype=torch.long), "entropy must be a floating-point tensor"),
    ],
)
def test_error_bad_entropy_input(entropy, message):
    logprobs, old, advantages, mask = random_batch(5, 6, seed=10)
    with pytest.raises(ValueError, match=message):
        st.PolicyLoss("clip", entropy_coef=0.1)(logprobs, old, advantages, mask, entropy=entropy)


def test_non_finite_entropy_at_an_active_token_is_refused_or_gives_a_non_finite_loss():
    logprobs, old, advantages, mask = random_batch(5, 6, seed=11)
    entropy = entropies(mask.shape, seed=11)
    row, col = mask.nonzero()[0].tolist()
    entropy[row, col] = math.nan
    with pytest.raises(
        ValueError,
        match=rf"entropy must be finite at active \(unmasked\) positions, got nan at index \({row}, {col}\)",
    ):
        st.PolicyLoss("clip", entropy_coef=0.1)(logprobs, old, advantages, mask, entropy=entropy)
    unchecked = st.PolicyLoss("clip", entropy_coef=0.1, check_values=False)
    assert not torch.isfinite(unchecked(logprobs, old, advantages, mask, entropy=entropy).loss)


def test_quantile_zero_keeps_the_largest_entropy_only():
    logprobs, old, advantages, mask = random_batch(6, 9, seed=12)
    entropy = entropies(mask.shape, seed=12)
    loss_fn = st.PolicyLoss("reinforce", aggregation="token-sum", entropy_quantile=0.0)
    _, grad, _ = loss_and_grad(loss_fn, logprobs, old, advantages, mask, entropy=entropy)
    top = entropy == entropy[mask].max()
    torch.testing.assert_close(grad, -advantages[:, None] * top, rtol=0, atol=0)
    assert int(top.sum()) == 1


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements of any tensor an ATen op returns inside the block (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in torch.utils._pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_the_learners_entropy_path_keeps_the_logprob_peak(monkeypatch):
    """The learner's log-prob function with entropy builds no [b, T, V] tensor: with small
    tiles (64 tokens x 128 vocabulary entries) the largest tensor of forward + backward is the
    same with and without the entropy (and its gradient), and far below b·T·V, which the
    unfused entropy reaches (the control that makes the check able to fail)."""
    pytest.importorskip("transformers")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import softtrust.logprobs as logprobs_module
    from softtrust.train.scoring import Scoring, completion_logprobs_of

    monkeypatch.setattr(logprobs_module, "TILE_ELEMENTS", 64 * 128)
    monkeypatch.setattr(logprobs_module, "DEFAULT_VOCAB_CHUNK_SIZE", 128)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    rows, prompt, width = 8, 4, 24
    ids = torch.randint(0, config.vocab_size, (rows, prompt + width))
    attention = torch.ones_like(ids)
    full = rows * width * config.vocab_size  # 98,304 elements: the logits the path never builds

    def largest(with_entropy: bool, unfused: bool = False) -> int:
        model.zero_grad(set_to_none=True)
        with _LargestTensor() as tracker:
            if unfused:
                logits = model(ids, attention_mask=attention).logits[:, -width - 1 : -1]
                entropy = torch.distributions.Categorical(logits=logits).entropy()
                loss = entropy.sum()
            else:
                scored = completion_logprobs_of(model, ids, attention, width, Scoring(0.7), with_entropy)
                loss = scored.logprobs.sum() + (scored.entropy.sum() if with_entropy else 0)
            loss.backward()
        return tracker.largest

    without, with_entropy = largest(False), largest(True)
    assert with_entropy == without
    assert with_entropy <= full // 4  # the LM-head weight (512 x 16) and one tile dominate
    assert largest(True, unfused=True) >= full
