"""SoftTrustAsyncGRPOTrainer inside TRL 1.16.0's experimental ``AsyncGRPOTrainer`` (CPU, no vLLM, no GPU).

What stands in for the GPU and the vLLM server, so that TRL's real training loop runs here:

- TRL loads the policy with ``attn_implementation="tree_fa3"``, the FA3 varlen kernel from the
  Hub (a Hopper GPU). :func:`sdpa_tree_attention`, registered under that name, computes the same
  attention with PyTorch's SDPA: each packed segment attends to its root-to-segment path,
  causally aligned to the path's end, as FA3 does with ``causal=True``.
- ``rollout_worker=``: :class:`LaggingRolloutWorker` samples completions from a copy of the tiny
  model loaded with the weights of a past policy version (``lags``, cycled: 0 = the newest) and
  records the sampler's log-probs, as vLLM would; ``weight_transfer=``:
  :class:`SnapshotWeightTransfer` keeps every version the trainer sends.
- ``token_budget`` is set (unset, training start asks the vLLM server for ``max_model_len``).
- TRL 1.16.0's ``__init__`` reads ``torch.cuda.get_device_name`` (for MFU), which raises on a
  CPU-only torch: ``get_peak_flops_per_device`` is patched to None (MFU off).

The policy is float64; TRL's fused LM head computes log-probs in float32 whatever the model's
dtype (``trl/kernels/chunked_logprob.py``), so the losses are float32 numbers.
"""

from __future__ import annotations

import queue
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

import trl.experimental.async_grpo.async_grpo_trainer as trl_async_module
from datasets import Dataset
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

import softtrust as st
from softtrust.integrations.trl_async import (
    SoftTrustAsyncGRPOTrainer,
    async_normalisers,
    segment_layout,
    to_segments,
)
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

TINY = TinyModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)
GA, B, G, T_MAX = 2, 4, 2, 6  # accumulation, samples per micro-batch, generations per prompt, max new tokens
PROMPTS = [f"{i}+{i % 5}=" for i in range(12)]


# --- what stands in for the GPU and vLLM --------------------------------------------------------


def sdpa_tree_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    tree_kv_index,
    tree_cu_seqlens_q,
    tree_cu_seqlens_k,
    tree_max_seqlen_q,
    tree_max_seqlen_k,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """TRL's tree attention with SDPA: query segment s (rows ``cu_q[s]:cu_q[s+1]``) attends to the
    K/V rows ``tree_kv_index[cu_k[s]:cu_k[s+1]]`` (its path), query i to the first ``Lk - Lq + i + 1``."""
    assert sliding_window is None and softcap is None  # the tiny Qwen2 uses neither
    heads_per_kv = query.shape[1] // key.shape[1]  # query [1, H, N, D], key/value [1, H_kv, N, D]
    key = key.repeat_interleave(heads_per_kv, dim=1).index_select(2, tree_kv_index)  # [1, H, K, D]
    value = value.repeat_interleave(heads_per_kv, dim=1).index_select(2, tree_kv_index)  # [1, H, K, D]
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    outputs = []
    for s in range(len(cu_q) - 1):
        q = query[:, :, cu_q[s] : cu_q[s + 1]]
        k, v = key[:, :, cu_k[s] : cu_k[s + 1]], value[:, :, cu_k[s] : cu_k[s + 1]]
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(diagonal=k.shape[2] - q.shape[2])
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
        )
    return torch.cat(outputs, dim=2).transpose(1, 2), None  # [1, N, H, D]


def register_sdpa_tree_attention() -> None:
    AttentionInterface.register(trl_async_module.TREE_ATTENTION, sdpa_tree_attention)
    AttentionMaskInterface.register(trl_async_module.TREE_ATTENTION, lambda **kwargs: None)


@pytest.fixture(autouse=True, scope="module")
def cpu_stand_ins():
    """One thread; TRL's trainer registers the SDPA attention (not FA3) and skips the CUDA query."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trl_async_module, "register_tree_attention", register_sdpa_tree_attention)
        patch.setattr(trl_async_module, "get_peak_flops_per_device", lambda *args: None)
        yield
    torch.set_num_threads(threads)


def text_reward(text: str) -> float:
    """Deterministic, varied within a group (so advantages are non-zero)."""
    return (sum(map(ord, text)) % 11) / 10


class SnapshotWeightTransfer:
    """``WeightTransferProtocol``: keeps the weights of every version sent (version v = ``versions[v - 1]``)."""

    def __init__(self) -> None:
        self.versions: list[dict[str, torch.Tensor]] = []

    def init_weight_transfer(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def destroy(self) -> None: ...

    def send_weights(self, iterator) -> None:
        self.versions.append({name: tensor.detach().clone() for name, tensor in iterator})


class OnDemandQueue:
    """The rollout buffer: a group is generated when the trainer asks for a sample and none is left,
    so which weights generated which sample depends only on the training steps, never on timing."""

    def __init__(self, produce) -> None:
        self.produce, self.buffer = produce, []

    def get(self, timeout: float | None = None) -> RolloutSample:
        if not self.buffer:
            self.buffer = self.produce()
        return self.buffer.pop(0)

    def put_nowait(self, sample: RolloutSample) -> None:
        self.buffer.append(sample)

    def qsize(self) -> int:
        return len(self.buffer)


class LaggingRolloutWorker:
    """``RolloutWorkerProtocol``: each group of ``G`` completions comes from policy version
    ``max(1, current - lag)``, lags cycled; every sample is kept in ``samples`` (with its version)."""

    def __init__(self, transfer: SnapshotWeightTransfer, lags: tuple[int, ...]) -> None:
        self.tokenizer = build_char_tokenizer()
        self.sampler = build_tiny_model(self.tokenizer, TINY).double()
        self.transfer, self.lags = transfer, lags
        self.version, self.groups = 0, 0
        self.generator = torch.Generator().manual_seed(0)
        self.rollout_buffer, self.metrics_queue = OnDemandQueue(self.next_group), queue.Queue()
        self.samples: list[RolloutSample] = []

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def check_health(self, stale_after_s: float) -> None: ...

    def update_model_version(self, version: int) -> None:
        self.version = version

    @torch.no_grad()
    def complete(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        """Sample up to ``T_MAX`` tokens; the sampler's log-prob of each (0 for the prompt)."""
        ids, logprobs = list(prompt_ids), [0.0] * len(prompt_ids)
        for _ in range(T_MAX):
            logits = self.sampler(torch.tensor([ids])).logits[0, -1]  # [V], temperature 1
            logp = torch.log_softmax(logits, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token == self.tokenizer.eos_token_id:
                break
        return ids, logprobs

    def next_group(self) -> list[RolloutSample]:
        version = max(1, self.version - self.lags[self.groups % len(self.lags)])
        missing, unexpected = self.sampler.load_state_dict(self.transfer.versions[version - 1], strict=False)
        assert missing == ["lm_head.weight"] and not unexpected  # the head is tied to the embedding
        prompt = PROMPTS[self.groups % len(PROMPTS)]
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        completions = [self.complete(prompt_ids) for _ in range(G)]
        texts = [self.tokenizer.decode(ids[len(prompt_ids) :]) for ids, _ in completions]
        rewards = np.array([text_reward(text) for text in texts])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        group = [
            RolloutSample(
                prompt=[{"role": "user", "content": prompt}],
                completion=[{"role": "assistant", "content": text}],
                input_ids=np.array(ids),
                completion_mask=np.array([0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))),
                old_log_probs=np.array(logprobs),
                advantage=float(advantage),
                model_version=version,
                group_id=self.groups,
                metrics={"reward": float(reward)},
            )
            for (ids, logprobs), text, advantage, reward in zip(
                completions, texts, advantages, rewards, strict=True
            )
        ]
        self.samples += group
        self.groups += 1
        return group

    def sample_of(self, sampler_logprobs: list[float]) -> RolloutSample:
        """The sample whose completion tokens have these sampler log-probs (float32, as TRL packs them)."""
        key = np.float32(sampler_logprobs).tolist()
        matches = [
            s for s in self.samples if np.float32(s.old_log_probs[s.completion_mask == 1]).tolist() == key
        ]
        assert matches, "no recorded sample has these sampler log-probs"
        assert len({(s.model_version, s.advantage) for s in matches}) == 1  # duplicates: one group's
        return matches[0]


# --- trainers ------------------------------------------------------------------------------------


class Recording:
    """Test mixin: each micro-batch's loss, and for each ``compute_loss`` the policy version trained,
    the weights it starts from and TRL's packed inputs."""

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro_losses.append(loss.item())
        return loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
        self.at_loss.append((self.model_version, weights, inputs))
        return super().compute_loss(model, inputs, *args, **kwargs)


class RecordingTRLTrainer(Recording, AsyncGRPOTrainer):
    pass


class RecordingTrainer(Recording, SoftTrustAsyncGRPOTrainer):
    pass


class RecordingLoss:
    """Wraps the trainer's PolicyLoss: keeps each call's inputs and output."""

    def __init__(self, policy_loss: st.PolicyLoss) -> None:
        self.policy_loss, self.calls = policy_loss, []

    def __call__(self, *args: Any, **kwargs: Any) -> st.LossOutput:
        out = self.policy_loss(*args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy_loss, name)


def async_config(output_dir, **overrides) -> AsyncGRPOConfig:
    settings = {
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "per_device_train_batch_size": B,
        "num_generations": G,
        "max_completion_length": T_MAX,
        "gradient_accumulation_steps": GA,
        "max_steps": 4,
        "seed": 0,
        "optim": "sgd",  # SGD: a float rounding difference in a gradient stays one
        "learning_rate": 1.0,  # ratios move far from 1 within a few steps
        "lr_scheduler_type": "constant",
        "epsilon_high": 0.28,
        "token_budget": 0,  # FixedCountBatcher: B samples per micro-batch (> 0: TokenBudgetBatcher)
        "max_staleness": 2,
        "model_init_kwargs": {"dtype": torch.float64},
        **overrides,
    }
    return AsyncGRPOConfig(output_dir=str(output_dir / "out"), **settings)


def build_trainer(cls, tmp_path, lags: tuple[int, ...], policy_loss=None, **overrides):
    """The trainer on the tiny policy (saved to ``tmp_path``: TRL loads the model from a path)."""
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, TINY).save_pretrained(tmp_path / "policy")
    transfer = SnapshotWeightTransfer()
    worker = LaggingRolloutWorker(transfer, lags)
    kwargs = {} if policy_loss is None else {"policy_loss": policy_loss}
    trainer = cls(
        model=str(tmp_path / "policy"),
        args=async_config(tmp_path, **overrides),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        rollout_worker=worker,
        weight_transfer=transfer,
        **kwargs,
    )
    trainer.micro_losses, trainer.at_loss, trainer.worker = [], [], worker
    if isinstance(trainer, SoftTrustAsyncGRPOTrainer):
        trainer.policy_loss = RecordingLoss(trainer.policy_loss)
    return trainer


def logged(trainer, key: str) -> list[float]:
    return [
        entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry
    ]


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in trainer.model.named_parameters()}


def test_imports_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # `import vllm` now raises ImportError
        "import softtrust.integrations.trl_async as m\n"
        "assert m.SoftTrustAsyncGRPOTrainer.__mro__[1].__name__ == 'AsyncGRPOTrainer'\n"
        "assert sys.modules['vllm'] is None\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_sdpa_tree_attention_matches_plain_attention_on_an_unshared_row():
    """The stand-in itself: one segment per sample (nothing shared) is plain causal attention per sample."""
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 5]
    query = torch.randn(1, 2, 8, 4, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(1, 1, 8, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    out, _ = sdpa_tree_attention(
        None,
        query,
        key,
        value,
        None,
        tree_kv_index=torch.arange(8),
        tree_cu_seqlens_q=torch.tensor([0, 3, 8]),
        tree_cu_seqlens_k=torch.tensor([0, 3, 8]),
        tree_max_seqlen_q=5,
        tree_max_seqlen_k=5,
    )
    start = 0
    for length in lengths:
        piece = slice(start, start + length)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, piece], key[:, :, piece].expand(1, 2, -1, -1), value[:, :, piece].expand(1, 2, -1, -1),
            is_causal=True,
        )  # fmt: skip
        torch.testing.assert_close(out[:, piece], expected.transpose(1, 2), atol=1e-12, rtol=0)
        start += length


# --- 1. clip: TRL's own async loss is the oracle -----------------------------------------------


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """TRL's AsyncGRPOTrainer, 4 steps; lags (0, 1) with max_staleness=2: no sample is ever too stale."""
    trainer = build_trainer(RecordingTRLTrainer, tmp_path_factory.mktemp("trl_async"), lags=(0, 1))
    trainer.train()
    return trainer


def assert_same_training(trl_trainer, st_trainer) -> None:
    """Same samples, micro-batch losses, logged losses and entropy, and final parameters, to 1e-6."""
    assert [s.input_ids.tolist() for s in st_trainer.worker.samples] == [
        s.input_ids.tolist() for s in trl_trainer.worker.samples
    ]
    assert len(st_trainer.micro_losses) == len(trl_trainer.micro_losses) == 4 * GA
    torch.testing.assert_close(
        torch.tensor(st_trainer.micro_losses), torch.tensor(trl_trainer.micro_losses), atol=1e-6, rtol=0
    )
    for key in ("loss", "entropy"):
        torch.testing.assert_close(
            torch.tensor(logged(st_trainer, key)), torch.tensor(logged(trl_trainer, key)), atol=1e-6, rtol=0
        )
    theirs, ours = parameters(trl_trainer), parameters(st_trainer)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, atol=1e-6, rtol=0, msg=name)


def test_default_loss_matches_trls_async_trainer(tmp_path, trl_run):
    trainer = build_trainer(RecordingTrainer, tmp_path, lags=(0, 1))
    assert repr(trainer.policy_loss.policy_loss) == repr(
        st.PolicyLoss(st.Clip(eps_low=0.2, eps_high=0.28), aggregation="token-mean")
    )
    trainer.train()
    assert_same_training(trl_run, trainer)
    # Really off-policy: ratios left [1 - ε, 1 + ε] after the first step, and the weights moved.
    assert logged(trainer, "softtrust/ratio/min")[0] == pytest.approx(1.0, abs=1e-5)
    assert (
        min(logged(trainer, "softtrust/ratio/min")) < 0.8
        and max(logged(trainer, "softtrust/ratio/max")) > 1.28
    )
    assert (
        max(logged(trainer, "softtrust/clip/high")) > 0
        and max(logged(trainer, "softtrust/staleness/max")) == 2
    )
    initial = dict(build_tiny_model(build_char_tokenizer(), TINY).double().named_parameters())
    assert (
        max((value - initial[name]).abs().max().item() for name, value in parameters(trainer).items()) > 1e-2
    )


def test_parity_check_detects_a_different_loss(tmp_path, trl_run):
    """The comparison above can fail: a clip that differs from TRL's only in aggregation."""
    other = st.PolicyLoss(st.Clip(eps_low=0.2, eps_high=0.28), aggregation="seq-mean-token-mean")
    trainer = build_trainer(RecordingTrainer, tmp_path, lags=(0, 1), policy_loss=other)
    trainer.train()
    with pytest.raises(AssertionError):
        assert_same_training(trl_run, trainer)


# --- 2. VESPO: sequence-level, so each sample's terms must be regrouped --------------------------


def unpacked_logprobs(weights: dict[str, torch.Tensor], samples: list[RolloutSample]) -> list[torch.Tensor]:
    """Each sample's completion log-probs from a plain forward of the sample alone (no packing,
    float64), under ``weights``."""
    model = build_tiny_model(build_char_tokenizer(), TINY).double()
    model.load_state_dict(weights)
    rows = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor(sample.input_ids)[None]  # [1, n]
            logp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)  # [n - 1, V]: predicts ids[1:]
            token_logp = logp.gather(1, ids[0, 1:, None])[:, 0]  # [n - 1]
            rows.append(token_logp[torch.tensor(sample.completion_mask[1:]) == 1])  # [completion tokens]
    return rows


def grid(rows: list[torch.Tensor | list[float]], width: int) -> torch.Tensor:
    """Rows of unequal length, right-padded with 0, as one [S, width] float64 tensor."""
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for s, row in enumerate(rows):
        out[s, : len(row)] = torch.as_tensor(row, dtype=torch.float64)
    return out


def samples_of(trainer, inputs: dict[str, torch.Tensor]) -> list[RolloutSample]:
    """The samples of a packed micro-batch (one rank), in ``segment_id`` order, read from TRL's raw
    inputs with no softtrust code: a sample's terms are those with its ``segment_id``."""
    terms = inputs["token_index"][0] >= 0
    segment, sampler = inputs["segment_id"][0][terms], inputs["old_log_probs"][0][terms]
    return [trainer.worker.sample_of(sampler[segment == s].tolist()) for s in range(int(segment.max()) + 1)]


def test_vespo_loss_equals_an_unpacked_per_sample_computation(tmp_path):
    vespo = st.PolicyLoss("vespo")
    assert vespo.level == "sequence-sum"
    # token_budget > 0: TRL's TokenBudgetBatcher, a varying number of samples per packed row
    trainer = build_trainer(
        RecordingTrainer, tmp_path, lags=(0, 1), policy_loss=vespo, token_budget=40, max_staleness=8
    )
    trainer.train()
    calls = trainer.policy_loss.calls
    assert len(calls) == len(trainer.at_loss) == 4 * GA
    assert sum(logged(trainer, "softtrust/stale_dropped_total")) == 0  # every sample trained
    assert len({len(samples_of(trainer, inputs)) for _, _, inputs in trainer.at_loss}) > 1
    flat_differs = []
    for (args, kwargs, out), (_, weights, inputs) in zip(calls, trainer.at_loss, strict=True):
        logprobs, old, advantages, mask = args
        samples = samples_of(trainer, inputs)
        reference = unpacked_logprobs(weights, samples)
        width = max(len(row) for row in reference)
        assert tuple(logprobs.shape) == (len(samples), width)
        expected_mask = grid([torch.ones(len(row)) for row in reference], width).bool()
        assert torch.equal(mask, expected_mask)
        # TRL's fused head computes in float32: |log p| < 8 rounds by < 5e-7 per term (seen: <= 5.5e-7)
        torch.testing.assert_close(logprobs.double(), grid(reference, width), atol=5e-6, rtol=0)
        sampler = grid([s.old_log_probs[s.completion_mask == 1] for s in samples], width)
        advantage = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
        expected = vespo(
            grid(reference, width),
            sampler,
            advantage,
            expected_mask,
            num_tokens=expected_mask.sum() * GA,  # TRL: the micro-batch's terms (one rank), times GA
        )
        torch.testing.assert_close(out.loss.double(), expected.loss, atol=1e-5, rtol=0)  # the same, summed
        # Without the regrouping (all terms as one sequence) VESPO's sequence weight is another number.
        flat = vespo(
            logprobs[mask][None], old[mask][None], advantages[mask][None], torch.ones(1, int(mask.sum())),
            num_tokens=kwargs["num_tokens"],
        )  # fmt: skip
        flat_differs.append(abs(flat.loss.item() - out.loss.item()))
    assert max(flat_differs) > 1e-3
    assert max(logged(trainer, "softtrust/staleness/max")) >= 1  # off-policy samples were trained
    assert min(logged(trainer, "softtrust/phi/mean")) < 0.99  # VESPO's weight acted


# --- 3. a behaviour correction: TIS in the decoupled objective ------------------------------------


def test_tis_weighs_the_current_policy_against_the_sampler(tmp_path):
    loss = st.PolicyLoss(st.Clip(eps_low=0.2, eps_high=0.28), correction=st.TIS(cap=2.0))
    trainer = build_trainer(RecordingTrainer, tmp_path, lags=(0, 1, 2), policy_loss=loss)
    before = parameters(trainer)
    trainer.train()
    for (args, kwargs, out), (_, _, inputs) in zip(trainer.policy_loss.calls, trainer.at_loss, strict=True):
        logprobs, old, advantages, mask = args
        assert torch.equal(old, logprobs.detach())  # pi_old = pi_prox: the weights this update starts from
        samples = samples_of(trainer, inputs)
        sampler = grid([s.old_log_probs[s.completion_mask == 1] for s in samples], logprobs.shape[1])
        torch.testing.assert_close(
            kwargs["rollout_logprobs"].double(), sampler.float().double(), atol=0, rtol=0
        )
        expected = loss(logprobs, logprobs.detach(), advantages, mask, sampler, num_tokens=mask.sum() * GA)
        torch.testing.assert_close(out.loss, expected.loss, atol=1e-7, rtol=0)
    for key in ("softtrust/ratio/min", "softtrust/ratio/max"):  # the trust region sees pi_theta / pi_prox = 1
        assert logged(trainer, key) == pytest.approx([1.0] * 4, abs=1e-6)
    assert min(logged(trainer, "softtrust/is_weight/min")) < 0.9  # min(pi_prox / mu, 2) acted
    assert max(logged(trainer, "softtrust/is_weight/max")) > 1.1
    assert max(logged(trainer, "softtrust/is_weight/max")) <= 2.0 + 1e-6
    assert (
        max((value - before[name]).abs().max().item() for name, value in parameters(trainer).items()) > 1e-2
    )


# --- 4. the staleness bound holds at the update ---------------------------------------------------


def test_no_sample_staler_than_max_staleness_reaches_the_loss(tmp_path):
    """TRL checks staleness when a sample leaves the queue; the dataloader fetches a micro-batch
    ahead, so some samples are trained one update later. The trainer masks those."""
    trainer = build_trainer(RecordingTrainer, tmp_path, lags=(0, 1, 2), max_staleness=1, max_steps=6)
    trainer.train()
    lags, masked = [], []
    for (args, _, _), (version, _, inputs) in zip(trainer.policy_loss.calls, trainer.at_loss, strict=True):
        mask = args[3]
        for s, sample in enumerate(samples_of(trainer, inputs)):
            lag = version - sample.model_version  # updates between the generating and the trained weights
            terms = int((sample.completion_mask[1:] == 1).sum())
            lags.append(lag)
            masked.append(not mask[s].any())
            assert bool(mask[s, :terms].all()) != (lag > 1), (lag, mask[s])
    assert any(lag > 1 for lag in lags)  # TRL's check let these through ...
    assert max(logged(trainer, "sample/staleness_max")) <= 1  # ... as it measured them at the queue
    assert sum(logged(trainer, "sample/dropped_stale_total")) > 0  # and dropped the stalest there
    assert sum(masked) == sum(logged(trainer, "softtrust/stale_dropped_total")) > 0
    assert 1 in [
        lag for lag, dropped in zip(lags, masked, strict=True) if not dropped
    ]  # the bound is inclusive
    assert max(logged(trainer, "softtrust/staleness/max")) == 1


# --- 5. refusals, before TRL loads the model -------------------------------------------------------

BATCH_STATE_METHODS = sorted(name for name in st.METHODS if st.PolicyLoss(name).selects_over_batch)


def test_the_batch_state_methods_are_those_the_brief_names():
    assert {"m2po", "kl-cov", "clip-cov", "bapo"} <= set(BATCH_STATE_METHODS)


@pytest.mark.parametrize(
    ("policy_loss", "match"),
    [
        *[(st.PolicyLoss(name), "selects over a whole mini-batch") for name in BATCH_STATE_METHODS],
        (st.PolicyLoss("clip", kl=st.KL(0.1)), "no reference model"),
        (st.PolicyLoss("clip", aggregation="seq-mean-token-sum-norm"), "max_completion_length"),
        ("clip", "must be a softtrust.PolicyLoss"),
    ],
    ids=[*BATCH_STATE_METHODS, "kl", "sum-norm", "string"],
)
def test_unsupported_losses_are_refused_before_the_model_loads(tmp_path, policy_loss, match):
    # No model at this path: had TRL started loading it, the error would be an OSError.
    with pytest.raises(ValueError, match=match):
        SoftTrustAsyncGRPOTrainer(
            model=str(tmp_path / "no-model-here"),
            args=async_config(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            policy_loss=policy_loss,
        )


# --- 6. the pieces ----------------------------------------------------------------------------------


def test_segment_layout_puts_each_samples_terms_on_its_row_in_packing_order():
    segment_id = torch.tensor([1, 0, 1, 2, 0, 1])  # sample 3 has no term (e.g. an empty completion)
    values = torch.tensor([10.0, 20.0, 11.0, 30.0, 21.0, 12.0], requires_grad=True)
    layout = segment_layout(segment_id, num_samples=4)
    rows = to_segments(values, layout)
    expected = torch.tensor([[20.0, 21.0, 0.0], [10.0, 11.0, 12.0], [30.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(rows, expected)
    rows.sum().backward()  # differentiable: each term's gradient comes back to it
    assert torch.equal(values.grad, torch.ones(6))
    empty = segment_layout(torch.zeros(0, dtype=torch.long), num_samples=2)
    assert to_segments(torch.zeros(0), empty).shape == (2, 0)


def test_async_normalisers_divide_the_micro_batch_counts_over_ranks_and_accumulation():
    inputs = {"global_n_tokens": torch.tensor([40.0, 40.0]), "global_n_samples": torch.tensor([6.0, 6.0])}
    assert async_normalisers("token-mean", inputs, 4, 2)["num_tokens"].item() == 40 / 2 * 4
    for aggregation in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert async_normalisers(aggregation, inputs, 4, 2)["num_sequences"].item() == 6 / 2 * 4
    assert async_normalisers("token-sum", inputs, 4, 2) == {}
    nothing = {"global_n_tokens": torch.tensor([0.0]), "global_n_samples": torch.tensor([0.0])}
    assert async_normalisers("token-mean", nothing, 1, 1)["num_tokens"].item() == 1.0  # never 0


# --- entropy terms: the packed forward's entropies, regrouped like the log-probs ---------------------


def test_entropy_options_get_the_packed_forwards_entropies_per_sample(tmp_path):
    """``entropy_quantile``/``entropy_coef`` inside the async trainer: each call gets ``entropy=``
    regrouped as the log-probs ([S, L], finite on every term), keeps about half of the terms, and
    the loss is the PolicyLoss's on those inputs (per packed micro-batch: trl.md)."""
    loss = st.PolicyLoss("clip", entropy_quantile=0.5, entropy_coef=0.01)
    trainer = build_trainer(RecordingTrainer, tmp_path, lags=(0, 1), policy_loss=loss)
    trainer.train()
    calls = trainer.policy_loss.calls
    assert len(calls) == 4 * GA
    for args, kwargs, out in calls:
        logprobs, old, advantages, mask = args
        entropy = kwargs["entropy"]
        assert entropy.shape == logprobs.shape and bool(torch.isfinite(entropy[mask]).all())
        assert bool((entropy[mask] > 0).all())  # a softmax over the vocabulary, never one-hot here
        again = loss(logprobs.detach(), old, advantages, mask, **kwargs)
        torch.testing.assert_close(again.loss, out.loss.detach(), rtol=0, atol=0)
        assert 0.4 <= out.metric_values()["entropy/kept"] <= 0.75  # ties aside: half, rounded up
    assert logged(trainer, "softtrust/entropy/mean")
