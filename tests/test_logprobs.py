"""Oracle tests for ``softtrust.logprobs``: the fused path equals the unfused log-softmax.

The oracle is ``log_softmax((hidden @ W.T + b) / T).gather(labels)`` (and its entropy)
computed in float64 by autograd; values, entropies and the gradients for hidden, weight
and bias must match it within a float32 error budget (``FP32_TOL``, ~1.2e-5) from float32
inputs, and within the bf16 rounding bound (``assert_close_bf16``) from bf16.
"""

from __future__ import annotations

import pytest
import torch

from softtrust.logprobs import completion_logprobs, token_logprobs

from budgets import EPS32, EPS64, rounding_budget

pytestmark = (
    pytest.mark.numerics
)  # the log-prob kernels against a float64 oracle: the outcome depends on float paths

N, D, V = 37, 16, 101  # N and V prime: no chunk size divides them
# float32 against the float64 oracle: a log-softmax sums V = 101 exponentials (a gradient sums
# N = 37 rows, a logit D = 16 products: fewer), so each value carries ~eps32·√V of its size;
# ×10 margin ≈ 1.2e-5, relative for large values, absolute for those below 1 (measured: 3e-6).
FP32_TOL = {"atol": rounding_budget(EPS32, terms=V), "rtol": rounding_budget(EPS32, terms=V)}


def make_inputs(
    n: int = N, dim: int = D, vocab: int = V, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=generator)  # [N, d]
    weight = 0.3 * torch.randn(vocab, dim, generator=generator)  # [V, d]
    bias = 0.5 * torch.randn(vocab, generator=generator)  # [V]
    labels = torch.randint(0, vocab, (n,), generator=generator)  # [N]
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), labels


def leaves(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def reference(hidden, weight, bias, labels, temperature=1.0, ignore_index=-100):
    """Unfused float64 oracle: log-probs and entropies, 0 at ignored rows."""
    logits = hidden @ weight.T  # [..., V]
    if bias is not None:
        logits = logits + bias
    log_probs = torch.log_softmax(logits / temperature, dim=-1)  # [..., V]
    active = labels != ignore_index
    picked = log_probs.gather(-1, torch.where(active, labels, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return torch.where(active, picked, 0), torch.where(active, entropy, 0)


def upstream(shape, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64), torch.randn(
        shape, generator=generator, dtype=torch.float64
    )


def fused_and_reference(
    dtype=torch.float32, temperature=1.0, chunk_size=None, vocab_chunk_size=None, labels=None, use_bias=True
):
    """Values and (hidden, weight, bias) gradients of ``Σ g·logp + e·H`` from both paths."""
    hidden, weight, bias, default_labels = make_inputs(dtype=dtype)
    labels = default_labels if labels is None else labels
    fused_leaves = leaves(hidden, weight, bias)
    oracle_leaves = leaves(hidden, weight, bias, dtype=torch.float64)
    if not use_bias:
        fused_leaves[2] = oracle_leaves[2] = None
    logprobs, entropy = token_logprobs(
        fused_leaves[0],
        fused_leaves[1],
        labels,
        bias=fused_leaves[2],
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        with_entropy=True,
    )
    ref_logprobs, ref_entropy = reference(*oracle_leaves, labels, temperature)
    grad_logp, grad_ent = upstream(labels.shape)
    params = [x for x in fused_leaves if x is not None]
    ref_params = [x for x in oracle_leaves if x is not None]
    grads = torch.autograd.grad((logprobs * grad_logp + entropy * grad_ent).sum(), params)
    ref_grads = torch.autograd.grad((ref_logprobs * grad_logp + ref_entropy * grad_ent).sum(), ref_params)
    return (logprobs, entropy, *grads), (ref_logprobs, ref_entropy, *ref_grads)


@pytest.mark.parametrize(
    ("chunk_size", "vocab_chunk_size"),
    [(None, None), (7, None), (100, None), (1, None), (7, 13), (3, 1), (100, V), (5, 200)],
    ids=[
        "default",
        "rows-7",
        "rows-over-N",
        "rows-1",
        "rows-7-vocab-13",
        "vocab-1",
        "vocab-V",
        "vocab-over-V",
    ],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_values_entropy_and_grads_match_float64_unfused(chunk_size, vocab_chunk_size, temperature):
    fused, oracle = fused_and_reference(
        temperature=temperature, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size
    )
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.float32
    for name, got, expected in zip(
        ["logprobs", "entropy", "hidden", "weight", "bias"], fused, oracle, strict=True
    ):
        torch.testing.assert_close(
            got.double(), expected, **FP32_TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize(("chunk_size", "vocab_chunk_size"), [(None, None), (7, 13), (3, 1), (100, V)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_logprob_only_path_matches_float64_unfused(chunk_size, vocab_chunk_size, temperature):
    hidden, weight, bias, labels = make_inputs()
    fused = leaves(hidden, weight, bias)
    oracle = leaves(hidden, weight, bias, dtype=torch.float64)
    logprobs = token_logprobs(
        fused[0],
        fused[1],
        labels,
        bias=fused[2],
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
    )
    ref_logprobs = reference(*oracle, labels, temperature)[0]
    torch.testing.assert_close(logprobs.double(), ref_logprobs, **FP32_TOL)
    grad_logp = upstream(labels.shape)[0]
    (logprobs * grad_logp).sum().backward()
    (ref_logprobs * grad_logp).sum().backward()
    for got, expected in zip(fused, oracle, strict=True):
        torch.testing.assert_close(got.grad.double(), expected.grad, **FP32_TOL)


def test_fp32_without_bias_matches_float64_unfused():
    fused, oracle = fused_and_reference(temperature=1.3, chunk_size=6, vocab_chunk_size=17, use_bias=False)
    for got, expected in zip(fused, oracle, strict=True):
        torch.testing.assert_close(got.double(), expected, **FP32_TOL)


def assert_close_bf16(fused, oracle):
    """bf16 tolerance: 0.05 nats on values, 2% of the largest reference entry on gradients.

    A bound, not an estimate: the oracle sees the same bf16 inputs, and the GEMM rounds each
    logit to bf16, by at most 2^-9·|z| (|z| <= ~10 here): z_label - logsumexp moves by at most
    2 · 2^-9 · 10 ≈ 0.04 nats (0.05; measured 0.011 on default, avx2 and avx512); the
    probabilities in the gradient move by e^0.02 - 1 ≈ 2% of themselves. The unfused bf16 path
    (bf16 logits, fp32 log-softmax) is off by the same order.
    """
    for got, expected in zip(fused[:2], oracle[:2], strict=True):
        torch.testing.assert_close(got.double(), expected, atol=0.05, rtol=0)
    for got, expected in zip(fused[2:], oracle[2:], strict=True):
        scale = expected.abs().max().item()
        torch.testing.assert_close(got.double(), expected, atol=0.02 * scale, rtol=0)


@pytest.mark.parametrize("chunk_size", [None, 7], ids=["one-token-tile", "token-tiles-7"])
def test_bf16_matches_float64_unfused_within_bf16_tolerance(chunk_size):
    fused, oracle = fused_and_reference(
        dtype=torch.bfloat16, temperature=0.8, chunk_size=chunk_size, vocab_chunk_size=32
    )
    assert fused[0].dtype == torch.float32
    assert [g.dtype for g in fused[2:]] == [torch.bfloat16] * 3
    assert_close_bf16(fused, oracle)


def test_bf16_weight_grad_sums_token_tiles_in_fp32():
    # One large and 100 small same-sign contributions per weight row, one token per tile:
    # summed in bf16, each small term is below half an ulp of the running sum and is lost
    # (a 23% error); summed in fp32 and rounded once, the gradient is right.
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4, generator=generator).expand(101, 4).bfloat16()
    weight = torch.randn(8, 4, generator=generator).bfloat16().requires_grad_()
    labels = torch.full((101,), 3)
    upstream_grad = torch.full((101,), 0.003)
    upstream_grad[0] = 1.0
    logprobs = token_logprobs(hidden, weight, labels, chunk_size=1)
    (grad,) = torch.autograd.grad((logprobs * upstream_grad).sum(), weight)
    oracle = weight.detach().double().requires_grad_()
    ref_logprobs = reference(hidden.double(), oracle, None, labels)[0]
    (ref_grad,) = torch.autograd.grad((ref_logprobs * upstream_grad.double()).sum(), oracle)
    # the bf16 bound of assert_close_bf16 (2% of the largest entry); a bf16 sum would be 23% off
    torch.testing.assert_close(grad.double(), ref_grad, atol=0.02 * ref_grad.abs().max().item(), rtol=0)


def test_float64_inputs_give_float64_outputs_and_pass_gradcheck():
    hidden, weight, bias, labels = make_inputs(n=6, dim=4, vocab=9, dtype=torch.float64)
    hidden, weight, bias = leaves(hidden, weight, bias)

    def fused(h, w, b):
        return token_logprobs(
            h, w, labels, bias=b, temperature=0.9, chunk_size=4, vocab_chunk_size=4, with_entropy=True
        )

    logprobs, entropy = fused(hidden, weight, bias)
    assert logprobs.dtype == torch.float64 and entropy.dtype == torch.float64
    ref_logprobs, ref_entropy = reference(hidden, weight, bias, labels, 0.9)
    # float64 in another order: 9 exponentials of values ~2, 10·eps64·√9·2 ≈ 1.3e-14; ×75
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(fused, (hidden, weight, bias))


def test_ignored_rows_are_zero_with_zero_grad_even_when_their_hidden_is_nan():
    hidden, weight, bias, labels = make_inputs()
    ignored = torch.zeros(N, dtype=torch.bool)
    ignored[[0, 5, 36]] = True
    labels = labels.masked_fill(ignored, -100)
    dirty_hidden = hidden.masked_fill(ignored.unsqueeze(1), float("nan"))  # never reaches the LM head
    hidden_leaf, weight_leaf, bias_leaf = leaves(dirty_hidden, weight, bias)
    logprobs, entropy = token_logprobs(
        hidden_leaf, weight_leaf, labels, bias=bias_leaf, chunk_size=4, vocab_chunk_size=30, with_entropy=True
    )
    assert torch.all(logprobs[ignored] == 0) and torch.all(entropy[ignored] == 0)
    grad_logp, grad_ent = upstream(labels.shape)
    (logprobs * grad_logp + entropy * grad_ent).sum().backward()
    assert torch.all(hidden_leaf.grad[ignored] == 0)

    oracle = leaves(hidden, weight, bias, dtype=torch.float64)
    ref_logprobs, ref_entropy = reference(*oracle, labels)
    (ref_logprobs * grad_logp + ref_entropy * grad_ent).sum().backward()
    torch.testing.assert_close(logprobs.double(), ref_logprobs, **FP32_TOL)
    torch.testing.assert_close(entropy.double(), ref_entropy, **FP32_TOL)
    for got, expected in zip([hidden_leaf, weight_leaf, bias_leaf], oracle, strict=True):
        torch.testing.assert_close(got.grad.double(), expected.grad, **FP32_TOL)


def test_ignored_label_far_outside_the_vocabulary_does_not_raise():
    hidden, weight, _, labels = make_inputs()
    labels[[2, 3]] = 10**9
    logprobs = token_logprobs(hidden, weight, labels, ignore_index=10**9)
    assert logprobs[2] == 0 and logprobs[3] == 0
    expected = reference(hidden.double(), weight.double(), None, labels, ignore_index=10**9)[0]
    torch.testing.assert_close(logprobs.double(), expected, **FP32_TOL)


def test_all_rows_ignored_gives_zeros_and_zero_grads():
    hidden, weight, bias, labels = make_inputs()
    hidden, weight, bias = leaves(hidden, weight, bias)
    logprobs, entropy = token_logprobs(
        hidden, weight, torch.full_like(labels, -100), bias=bias, with_entropy=True
    )
    assert torch.all(logprobs == 0) and torch.all(entropy == 0)
    (logprobs.sum() + entropy.sum()).backward()
    for leaf in (hidden, weight, bias):
        assert torch.all(leaf.grad == 0)


def test_3d_inputs_match_the_flattened_computation():
    hidden, weight, bias, labels = make_inputs(n=4 * 9)
    labels[[3, 20]] = -100
    hidden_3d, labels_3d = hidden.view(4, 9, D), labels.view(4, 9)
    logprobs, entropy = token_logprobs(
        hidden_3d, weight, labels_3d, bias=bias, chunk_size=5, with_entropy=True
    )
    assert logprobs.shape == (4, 9) and entropy.shape == (4, 9)
    ref_logprobs, ref_entropy = reference(hidden_3d.double(), weight.double(), bias.double(), labels_3d)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, **FP32_TOL)
    torch.testing.assert_close(entropy.double(), ref_entropy, **FP32_TOL)


def test_large_logit_offsets_stay_accurate():
    # A bias of +1000 on every entry: logsumexp and E[z] are both ~1000 (fp32 ulp 6e-5).
    # The entropy is accumulated relative to the running max, so it loses no digits to
    # cancellation; the log-probs carry the ulp of the logits, as the unfused path does.
    hidden, weight, bias, labels = make_inputs()
    shifted_bias = bias + 1000.0
    ref_logprobs, ref_entropy = reference(hidden.double(), weight.double(), bias.double(), labels)
    logprobs, entropy = token_logprobs(
        hidden, weight, labels, bias=shifted_bias, vocab_chunk_size=10, with_entropy=True
    )
    # A log-prob is the difference of two float32 numbers near 1000 (the logit, the logsumexp),
    # each rounded at eps32·1000: ×10 ≈ 1.2e-3 (measured 1.3e-4). The entropy sees each logit's
    # rounding (half an ulp, 3e-5) once, as a p-weighted mean minus the logsumexp: ≤ ~6e-5, 1e-4
    # leaves ×1.7 (measured 2.4e-5); a cancelling E[z] - logsumexp would lose ~ulp(1000)·√V ≈ 6e-4.
    logprob_budget = rounding_budget(EPS32, terms=1, scale=1000.0)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, atol=logprob_budget, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-4, rtol=0)
    logprobs_only = token_logprobs(hidden, weight, labels, bias=shifted_bias, vocab_chunk_size=10)
    torch.testing.assert_close(logprobs_only.double(), ref_logprobs, atol=logprob_budget, rtol=0)


def test_logprob_only_and_entropy_only_gradients_match():
    hidden, weight, bias, labels = make_inputs()
    for use in ("logprobs", "entropy"):
        fused = leaves(hidden, weight, bias)
        oracle = leaves(hidden, weight, bias, dtype=torch.float64)
        outputs = token_logprobs(
            fused[0], fused[1], labels, bias=fused[2], vocab_chunk_size=40, with_entropy=True
        )
        ref_outputs = reference(*oracle, labels)
        pick = 0 if use == "logprobs" else 1
        outputs[pick].sum().backward()
        ref_outputs[pick].sum().backward()
        for got, expected in zip(fused, oracle, strict=True):
            torch.testing.assert_close(got.grad.double(), expected.grad, **FP32_TOL)


def test_without_entropy_returns_a_tensor_and_grads_only_where_required():
    hidden, weight, _, labels = make_inputs()
    weight_leaf = weight.clone().requires_grad_()
    logprobs = token_logprobs(hidden, weight_leaf, labels, temperature=2.0)
    assert isinstance(logprobs, torch.Tensor) and logprobs.shape == (N,)
    logprobs.sum().backward()
    oracle = weight.double().requires_grad_()
    reference(hidden.double(), oracle, None, labels, 2.0)[0].sum().backward()
    torch.testing.assert_close(weight_leaf.grad.double(), oracle.grad, **FP32_TOL)


def test_autocast_bf16_runs_the_gemm_in_bf16_and_returns_float32():
    hidden, weight, bias, labels = make_inputs()
    fused_leaves = leaves(hidden, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, entropy = token_logprobs(
            fused_leaves[0], fused_leaves[1], labels, bias=fused_leaves[2], chunk_size=10, with_entropy=True
        )
    assert logprobs.dtype == torch.float32
    oracle_leaves = leaves(hidden, weight, bias, dtype=torch.float64)
    ref_logprobs, ref_entropy = reference(*oracle_leaves, labels)
    assert not torch.allclose(logprobs.double(), ref_logprobs, atol=1e-6, rtol=0)  # really ran in bf16
    grad_logp, grad_ent = upstream(labels.shape)
    grads = torch.autograd.grad((logprobs * grad_logp + entropy * grad_ent).sum(), fused_leaves)
    ref_grads = torch.autograd.grad((ref_logprobs * grad_logp + ref_entropy * grad_ent).sum(), oracle_leaves)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    assert_close_bf16((logprobs, entropy, *grads), (ref_logprobs, ref_entropy, *ref_grads))


# ---- bad input: one test per case, each message names the argument -------------------------


def test_rejects_hidden_weight_dim_mismatch():
    hidden, weight, _, labels = make_inputs()
    with pytest.raises(ValueError, match=r"hidden has last dim 16.*weight has shape \(101, 8\)"):
        token_logprobs(hidden, weight[:, :8], labels)


def test_rejects_labels_shape_mismatch():
    hidden, weight, _, labels = make_inputs()
    with pytest.raises(ValueError, match=r"labels must have shape .*\(37,\), got \(36,\)"):
        token_logprobs(hidden, weight, labels[:-1])


@pytest.mark.parametrize("bad", [-1, V])
def test_rejects_labels_out_of_range(bad):
    hidden, weight, _, labels = make_inputs()
    labels[4] = bad
    with pytest.raises(
        ValueError, match=rf"labels must be in \[0, V\) = \[0, 101\).*got {bad} at flat position 4"
    ):
        token_logprobs(hidden, weight, labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_rejects_non_integer_labels(dtype):
    hidden, weight, _, labels = make_inputs()
    with pytest.raises(ValueError, match=rf"labels must be an integer tensor.*{dtype}"):
        token_logprobs(hidden, weight, labels.to(dtype))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_rejects_non_positive_temperature(temperature):
    hidden, weight, _, labels = make_inputs()
    with pytest.raises(ValueError, match=rf"temperature must be > 0.*{temperature}"):
        token_logprobs(hidden, weight, labels, temperature=temperature)


@pytest.mark.parametrize("name", ["chunk_size", "vocab_chunk_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_rejects_non_positive_chunk_sizes(name, value):
    hidden, weight, _, labels = make_inputs()
    with pytest.raises(ValueError, match=rf"{name} must be a positive int.*{value}"):
        token_logprobs(hidden, weight, labels, **{name: value})


def test_rejects_bias_of_wrong_shape():
    hidden, weight, bias, labels = make_inputs()
    with pytest.raises(ValueError, match=r"bias must have shape \(V,\) = \(101,\), got \(100,\)"):
        token_logprobs(hidden, weight, labels, bias=bias[:-1])


def test_rejects_integer_hidden():
    _, weight, _, labels = make_inputs()
    with pytest.raises(ValueError, match="hidden must be a floating-point tensor"):
        token_logprobs(torch.ones(N, D, dtype=torch.long), weight, labels)


# ---- Hugging Face helper -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm():
    pytest.importorskip("transformers")
    from softtrust.train.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer).float()
    return tokenizer, model


def test_completion_logprobs_match_the_model_logits_in_value_and_gradient(tiny_lm):
    tokenizer, model = tiny_lm
    texts = ["12+30=42", "7*6=42!!", "abc"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)  # left padding
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    keep, temperature = 5, 0.7
    completion_mask = attention_mask[:, -keep:].clone()
    completion_mask[0, -1] = 0

    logprobs, entropy = completion_logprobs(
        model,
        input_ids,
        attention_mask,
        keep,
        completion_mask=completion_mask,
        temperature=temperature,
        with_entropy=True,
        chunk_size=3,
    )
    assert logprobs.shape == (3, keep) and logprobs.dtype == torch.float32
    params = [model.get_output_embeddings().weight, model.model.layers[0].mlp.up_proj.weight]
    grad_logp, grad_ent = upstream(logprobs.shape)
    grad_logp, grad_ent = grad_logp.float(), grad_ent.float()
    grads = torch.autograd.grad((logprobs * grad_logp + entropy * grad_ent).sum(), params)

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -keep - 1 : -1]
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, K, V]
    active = completion_mask.bool()
    ref_logprobs = torch.where(active, log_probs.gather(-1, input_ids[:, -keep:, None]).squeeze(-1), 0)
    ref_entropy = torch.where(active, -(log_probs.exp() * log_probs).sum(-1), 0)
    ref_grads = torch.autograd.grad((ref_logprobs * grad_logp + ref_entropy * grad_ent).sum(), params)

    torch.testing.assert_close(logprobs, ref_logprobs, **FP32_TOL)
    torch.testing.assert_close(entropy, ref_entropy, **FP32_TOL)
    assert logprobs[0, -1] == 0
    for got, expected in zip(grads, ref_grads, strict=True):
        # float32 both ways, in another order: parameter gradients sum ~3 rows x 4 positions x 99
        # vocabulary entries (≈ 1e3) of products: 10·eps32·√1e3 ≈ 3.8e-5 relative (measured 7e-6)
        torch.testing.assert_close(
            got, expected, atol=FP32_TOL["atol"], rtol=rounding_budget(EPS32, terms=1e3)
        )
        assert got.abs().max() > 0


def grouped_batch(tokenizer, keep, group=3):
    """Two left-padded prompts, ``group`` random completions each (consecutive rows), one ending early."""
    prompts = tokenizer(["12+30=", "7*6="], return_tensors="pt", padding=True)  # left padding
    gen = torch.Generator().manual_seed(2)
    completions = torch.randint(3, tokenizer.vocab_size, (2 * group, keep), generator=gen)
    input_ids = torch.cat([prompts["input_ids"].repeat_interleave(group, 0), completions], 1)
    attention_mask = torch.cat(
        [prompts["attention_mask"].repeat_interleave(group, 0), torch.ones_like(completions)], 1
    )
    attention_mask[0, -1] = 0  # a completion that ended early
    return input_ids, attention_mask, prompts["input_ids"].shape[1]


def test_prompt_groups_finds_runs_of_one_prompt(tiny_lm):
    from softtrust._shared_prompt import prompt_groups

    input_ids, attention_mask, length = grouped_batch(tiny_lm[0], keep=4)
    first_rows, index = prompt_groups(input_ids, attention_mask, length)
    assert first_rows.tolist() == [0, 3] and index.tolist() == [0, 0, 0, 1, 1, 1]
    first_rows, index = prompt_groups(input_ids[1:], attention_mask[1:], length)  # runs of 2 and 3
    assert first_rows.tolist() == [0, 2] and index.tolist() == [0, 0, 1, 1, 1]
    assert prompt_groups(input_ids[2:4], attention_mask[2:4], length) is None  # two distinct prompts
    other_mask = attention_mask.clone()
    other_mask[1, 0] = 1 - other_mask[1, 0]  # same ids, another mask: not the same prompt
    assert prompt_groups(input_ids[:2], other_mask[:2], length) is None


@pytest.mark.parametrize("keep", [1, 4])
def test_shared_prompts_match_the_model_logits_in_value_and_every_parameter_gradient(tiny_lm, keep):
    """Rows in runs of one (left-padded) prompt: each prompt runs once, its KV cache is selected
    per row; log-probs and the gradient of every parameter equal the full model forward's."""
    tokenizer, model = tiny_lm
    model = model.double()
    input_ids, attention_mask, _ = grouped_batch(tokenizer, keep)
    gen = torch.Generator().manual_seed(3)
    upstream_grad = torch.randn(input_ids.shape[0], keep, generator=gen, dtype=torch.float64)
    params = list(model.parameters())

    def grads_of(logprobs):
        return torch.autograd.grad((logprobs * upstream_grad).sum(), params, allow_unused=True)

    logprobs = completion_logprobs(model, input_ids, attention_mask, keep)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -keep - 1 : -1]
    expected = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, -keep:, None]).squeeze(-1)
    # float64 in another order (the prompt's KV cache): ~100 terms of size ~5, 10·eps64·10·5 ≈ 1e-13
    torch.testing.assert_close(logprobs, expected, atol=1e-12, rtol=1e-12)
    # HF's RMSNorm casts to float32 even in a float64 model, so its backward rounds the G
    # copies' summed gradient at float32 precision: one float32 rounding of the largest entry,
    # 10·eps32 ≈ 1.2e-6 of it (measured 1.7e-8 of it), and 10·eps32·√G relative per entry
    for got, want in zip(grads_of(logprobs), grads_of(expected), strict=True):
        if want is None:
            assert got is None or got.abs().max() == 0
            continue
        scale = want.abs().max().item()
        torch.testing.assert_close(
            got,
            want,
            atol=rounding_budget(EPS32, terms=1, scale=scale) + 1e-12,
            rtol=rounding_budget(EPS32, terms=3),
        )
    model.float()


@pytest.mark.parametrize("micro_batch_size", [3, 5, None])
def test_behaviour_forward_runs_the_learners_micro_batches_bit_for_bit(tiny_lm, micro_batch_size):
    """The trainer's behaviour log-probs equal the learner's, piece by piece, exactly: lag-0 ratios
    stay 1 even when a micro-batch splits a group (where a row's shared prompt runs in another
    batch shape than over the whole mini-batch; here that moves log-probs by ~5e-7)."""
    from softtrust.train.rollout import RolloutBatch
    from softtrust.train.scoring import Scoring, completion_logprobs_of, row_pieces
    from softtrust.train.staleness import behaviour_logprobs

    tokenizer, model = tiny_lm
    input_ids, attention_mask, _ = grouped_batch(tokenizer, keep=4, group=4)
    batch = RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=attention_mask[:, -4:],
        rollout_logprobs=torch.zeros(8, 4),
        rewards=torch.zeros(8),
    )
    behaviour = behaviour_logprobs(model, batch, Scoring(), micro_batch_size=micro_batch_size)
    assert not behaviour.requires_grad  # no autograd graph in the rollout's forward
    with torch.no_grad():
        learner = torch.cat(
            [
                completion_logprobs_of(model, input_ids[rows], attention_mask[rows], 4).logprobs
                for rows in row_pieces(8, micro_batch_size)
            ]
        )
    assert torch.equal(behaviour, learner)


def test_activation_checkpointing_and_dropout_run_every_row_in_full(tiny_lm):
    """torch's checkpoint_wrapper recomputes a layer in backward (a cache would be written twice);
    active dropout would give a group's copies one draw: both take the plain forward."""
    import copy
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from softtrust._shared_prompt import can_share

    tokenizer, model = tiny_lm
    input_ids, attention_mask, _ = grouped_batch(tokenizer, keep=4)
    wrapped = copy.deepcopy(model)
    layer = type(wrapped.model.layers[0])
    apply_activation_checkpointing(
        wrapped,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda module: isinstance(module, layer),
    )
    assert can_share(model.model) and not can_share(wrapped.model)
    logprobs = completion_logprobs(wrapped, input_ids, attention_mask, 4)
    logprobs.sum().backward()  # no second write into a cache
    torch.testing.assert_close(logprobs, completion_logprobs(model, input_ids, attention_mask, 4), **FP32_TOL)
    dropout = copy.deepcopy(model).train()
    dropout.model.layers[0].mlp.register_module("drop", torch.nn.Dropout(0.1))
    assert not can_share(dropout.model)
    assert can_share(dropout.model.eval())


def test_completion_logprobs_rejects_bad_logits_to_keep(tiny_lm):
    _, model = tiny_lm
    input_ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"logits_to_keep must be an int in \(0, 4\).*got 4"):
        completion_logprobs(model, input_ids, None, 4)


def test_default_tiles_are_cache_sized_on_cpu_and_larger_elsewhere():
    from softtrust import logprobs

    assert logprobs.default_tile(torch.device("cpu")) == (1 << 22, 2048)  # 2048 x 2048 logits
    # off the CPU: 128 Mi logits, 8192 vocabulary entries wide (16384 tokens); no GPU needed to ask
    assert logprobs.default_tile(torch.device("cuda")) == (1 << 27, 8192)


def test_both_tile_logsumexp_formulas_agree_with_large_offsets():
    """The CPU formula (max, in-place shift, exp, sum) against ``torch.logsumexp`` (used off CPU)."""
    from softtrust._tiles import _tile_logsumexp

    tile = torch.randn(37, 300, dtype=torch.float64) * 5 + 1e4  # offsets that overflow a naive exp
    expected = torch.logsumexp(tile, 1)
    # float64 near 1e4, 300 terms in another order: 10·eps64·√300·1e4 ≈ 4e-10
    budget = rounding_budget(EPS64, terms=300, scale=1e4)
    torch.testing.assert_close(_tile_logsumexp(tile.clone()), expected, rtol=0, atol=budget)
    assert torch.isfinite(expected).all()


def test_fsdp_sharded_bodies_run_every_row_in_full(tiny_lm, tmp_path):
    """Under FSDP2 a second forward would all-gather every layer again: no sharing there."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from softtrust._shared_prompt import can_share

    sharded = copy.deepcopy(tiny_lm[1])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert can_share(sharded.model)
        fully_shard(sharded)  # (its forward runs through the trainer's wrapper: tests/test_distributed.py)
        assert not can_share(sharded.model)
    finally:
        dist.destroy_process_group()
