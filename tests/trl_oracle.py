"""A TRL oracle for parity tests: TRL 1.16.0's own ``GRPOTrainer._compute_loss`` on crafted tensors.

softtrust re-implements TRL's GRPO-family policy losses from their formulas. To prove
parity, tests call TRL's code itself at run time through this harness:

* :func:`make_trl_trainer` builds a real :class:`trl.GRPOTrainer` (CPU, no vLLM, no
  logging, no Hub access) around the tiny local Qwen2 and character tokenizer of
  :mod:`softtrust.train.tiny`, a small in-memory prompt dataset and a constant reward.
* :func:`trl_loss_and_grad` feeds crafted ``(B, T)`` per-token log-probabilities to
  ``trainer._compute_loss`` by replacing, on the instance and only for the call, the model
  forward ``_get_per_token_logps_and_entropies``; it returns TRL's loss and
  ``d loss / d logprobs``.

Everything here is test scaffolding: nothing in ``src/`` imports it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

TRL_VERSION = "1.16.0"

# Small, CPU-friendly defaults; every one can be overridden through ``config_overrides``.
_DEFAULT_CONFIG: dict[str, Any] = {
    "use_cpu": True,
    "bf16": False,
    "fp16": False,
    "activation_checkpointing": False,  # transformers 5.x name of gradient_checkpointing
    "report_to": "none",
    "logging_strategy": "no",
    "save_strategy": "no",
    "eval_strategy": "no",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
    "dataloader_pin_memory": False,
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 4,
    "num_generations": 2,
    "max_completion_length": 8,
    "use_vllm": False,
    "seed": 0,
}

# Plain-text prompts: GRPO then tokenizes them directly, no chat template involved.
_PROMPTS = ("1+1=", "2+3=", "4+4=", "7-2=")

# A trivial chat template, so conversational code paths of TRL (if ever reached) work too.
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _constant_reward(completions, **kwargs) -> list[float]:
    """A reward function TRL accepts; never called by :func:`trl_loss_and_grad`."""
    return [0.0 for _ in completions]


def make_trl_trainer(output_dir: str | os.PathLike, trainer_class: Any = None, **config_overrides: Any):
    """Build a real ``trl.GRPOTrainer`` on the tiny local model, offline and on CPU.

    Args:
        output_dir: Where the ``GRPOConfig`` points ``output_dir`` (nothing is written
            there unless ``beta != 0``, see below). Use a pytest ``tmp_path``.
        trainer_class: ``trl.GRPOTrainer`` (default) or a subclass built the same way
            (``SoftTrustGRPOTrainer``: its ``_compute_loss`` then runs on the same inputs).
        **config_overrides: Extra ``trl.GRPOConfig`` fields, overriding the CPU defaults
            (``per_device_train_batch_size=4``, ``num_generations=2``,
            ``max_completion_length=8``, ``use_cpu=True``, bf16/fp16 and gradient
            checkpointing off, ``report_to="none"``, no logging/saving/eval). Any loss
            setting goes here: ``loss_type``, ``epsilon``, ``epsilon_high``, ``delta``,
            ``importance_sampling_level``, ``beta``, ``use_bias_correction_kl``,
            ``sapo_temperature_pos``/``_neg``, ``vespo_k_pos``/``vespo_lambda_pos``/
            ``vespo_k_neg``/``vespo_lambda_neg``, ``off_policy_mask_threshold``,
            ``top_entropy_quantile``, ``gradient_accumulation_steps``,
            ``steps_per_generation``, ``num_iterations``, ...

    Returns:
        The trainer. With ``beta != 0`` TRL builds its reference model from
        ``model.config._name_or_path``, so the tiny policy is first saved under
        ``output_dir/tiny_policy`` and the reference model is loaded from there (local
        files only).
    """
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from softtrust.train.tiny import build_char_tokenizer, build_tiny_model

    settings = {**_DEFAULT_CONFIG, **config_overrides}
    args = GRPOConfig(output_dir=str(output_dir), **settings)

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    model = build_tiny_model(tokenizer)
    if args.beta != 0.0:
        policy_dir = os.path.join(str(output_dir), "tiny_policy")
        model.save_pretrained(policy_dir)
        model.config._name_or_path = policy_dir

    dataset = Dataset.from_dict({"prompt": list(_PROMPTS)})
    return (trainer_class or GRPOTrainer)(
        model=model,
        reward_funcs=_constant_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name = value`` for the block, then restore the previous state exactly."""
    had_own = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def trl_loss_and_grad(
    trainer,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    train: bool = True,
    apply_vllm_is_correction: bool | None = None,
    exact_scalars: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's GRPO loss on crafted per-token log-probabilities, and its gradient.

    Runs ``trainer._compute_loss(trainer.model, inputs)`` (TRL 1.16.0) with the model
    forward ``trainer._get_per_token_logps_and_entropies`` replaced, on the instance and
    for this call only, by a function returning ``(leaf, entropies, None)`` where
    ``leaf = logprobs.detach().clone().requires_grad_()``. The loss is then
    back-propagated to ``leaf`` only (``torch.autograd.grad``), so the model's
    parameters never receive gradients.

    Args:
        trainer: from :func:`make_trl_trainer`.
        logprobs: ``(B, T)`` per-token log-probs of the current policy, ``log π_θ``.
        old_logprobs: ``(B, T)`` log-probs of the policy that sampled the data
            (``old_per_token_logps``), or ``None`` for on-policy: TRL then uses
            ``logprobs.detach()``, i.e. every ratio is exactly 1.
        advantages: ``(B,)`` (TRL's shape) or ``(B, T)``.
        mask: ``(B, T)`` of 0/1: ``completion_mask``. Passed to TRL as ``long``, as TRL
            builds it.
        ref_logprobs: ``(B, T)`` reference log-probs, required when ``beta != 0``.
        importance_sampling_ratio: vLLM-vs-trainer IS ratio, ``(B, T)`` (token modes) or
            ``(B, 1)`` (sequence modes), as TRL's ``_generate_and_score_completions``
            produces it after ``vllm_importance_sampling_mode`` clipping/masking (this
            harness does not apply the mode; pass the final ratio). VESPO reads it
            (``get_gamma_weights``) whenever given. For the other losses TRL multiplies
            ``per_token_loss`` by it only if ``trainer.use_vllm and
            vllm_importance_sampling_correction``: see ``apply_vllm_is_correction``.
        sampling_logprobs: ``sampling_per_token_logps`` (vLLM's log-probs); only read by
            the off-policy sequence mask (``off_policy_mask_threshold``), which falls back
            to the old log-probs when absent.
        num_items_in_batch: TRL's ``num_items_in_batch``: the number of loss tokens
            (``completion_mask`` [* ``tool_mask``] summed) in the **whole generation
            batch, summed over processes** (``steps_per_generation`` micro-batches of
            ``per_device_train_batch_size``, times ``num_processes``). Default:
            ``mask.sum() * steps_per_generation`` (train) or ``mask.sum()`` (eval), which
            is exact when every micro-batch of the generation batch has as many tokens as
            this one and there is one process. Only the ``dapo``/``cispo``/``vespo``
            normalisers read it.
        entropies: ``(B, T)`` per-token entropies returned by the patched forward
            (default zeros). Only matter with ``top_entropy_quantile < 1``
            (``get_high_entropy_mask``) or an entropy bonus (``entropy_coef``).
        train: ``True`` (default) reproduces a training micro-step: ``trainer.model`` in
            train mode and ``trainer.current_gradient_accumulation_steps`` set to
            ``args.gradient_accumulation_steps`` (what ``Trainer._inner_training_loop``
            sets, ``len(batch_samples)``, for every full accumulation window).
            ``False``: eval mode, where TRL divides by no accumulation factor.
        apply_vllm_is_correction: Whether TRL's ``per_token_loss *=
            importance_sampling_ratio`` step (``if self.use_vllm and
            self.vllm_importance_sampling_correction and loss_type != "vespo"``) runs. The
            trainer is built without vLLM, so this temporarily sets ``trainer.use_vllm =
            True`` (and ``vllm_importance_sampling_correction = True``); ``_compute_loss``
            reads ``use_vllm`` nowhere else. Default: ``importance_sampling_ratio is not
            None``.
        exact_scalars: TRL builds some tensors in the *default* dtype (float32): the
            coefficients made from Python floats with ``torch.where(cond, float, float)``
            (SAPO temperatures, VESPO ``k``/``λ``), so e.g. the default
            ``sapo_temperature_neg = 1.05`` becomes ``1.0499999523``; and the token counts
            ``long_tensor.clamp(min=1.0)`` (all normalisers), so the dapo/cispo/vespo
            factor ``· G / steps_per_generation`` is computed in float32. With ``True``
            (default) the default dtype is set to ``logprobs.dtype`` for the call (and
            restored), so a float64 call is float64 end to end; ``False`` keeps TRL's
            float32 constants (as in a real float32 run; relative differences ~1e-8).
            Not affected either way: ``get_high_entropy_mask`` computes its quantile
            threshold on ``entropies.float()``, and the logged metrics are float32.

    Returns:
        ``(loss, grad)``: the detached scalar loss TRL returns (what ``Trainer.training_step``
        back-propagates; TRL sets ``loss_is_scaled_for_ga = True`` so the Trainer does not
        divide it again) and ``d loss / d logprobs`` of shape ``(B, T)``, both in
        ``logprobs.dtype`` (float64 for float64 inputs: TRL's loss code is dtype-agnostic;
        the only float32 intermediates are the scalar constants above, the metrics, and
        the long mask).

    TRL's normaliser per ``loss_type`` (``grpo_trainer.py`` lines 3152-3184), with
    ``L_t`` the per-token loss after masks, IS correction and ``+ β·KL_t``, ``m`` the mask
    and ``G = current_gradient_accumulation_steps`` in train mode, 1 in eval mode:

    * ``grpo``, ``sapo``: ``mean_i( Σ_t L_it m_it / max(Σ_t m_it, 1) ) / G``
      (per-sequence mean, then mean over the local micro-batch).
    * ``bnpo``: ``Σ L m / max(Σ m, 1) / G`` (tokens of the local micro-batch).
    * ``dr_grpo``: ``Σ L m / (B · max_completion_length) / G``.
    * ``dapo``, ``cispo``, ``vespo``: ``Σ L m / N`` with
      ``N = max(num_items_in_batch, 1) / num_processes · G / steps_per_generation`` in
      train mode and ``max(num_items_in_batch, 1) / num_processes`` in eval mode. With the
      default ``num_items_in_batch`` and ``G == steps_per_generation`` (the config
      default) ``N = Σ m · G``.
    * ``luspo``: ``mean_i( Σ_t L_it m_it ) / G`` (per-sequence sum, then mean).

    The entropy bonus (``entropy_coef != 0`` or adaptive) subtracts
    ``coef · Σ H m' / max(Σ m', 1) / G`` whatever the loss type.
    """
    dtype = logprobs.dtype
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got {tuple(logprobs.shape)}")
    batch, length = logprobs.shape
    args = trainer.args
    device = trainer.accelerator.device

    leaf = logprobs.detach().clone().to(device).requires_grad_(True)
    ent = torch.zeros_like(leaf.detach()) if entropies is None else entropies.detach().to(device, dtype)

    def fake_forward(model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        if input_ids.shape[0] != batch or logits_to_keep != length:
            raise AssertionError("unexpected call to the patched _get_per_token_logps_and_entropies")
        return leaf, (ent if kw.get("compute_entropy", False) else None), None

    completion_mask = (mask.detach() != 0).to(device=device, dtype=torch.long)
    if not torch.equal(completion_mask.to(mask.dtype), mask.detach().to(device)):
        raise ValueError("mask must contain only 0 and 1")
    token = trainer.processing_class.convert_tokens_to_ids("a")
    prompt_len = 3
    inputs: dict[str, Any] = {
        "prompt_ids": torch.full((batch, prompt_len), token, dtype=torch.long, device=device),
        "prompt_mask": torch.ones((batch, prompt_len), dtype=torch.long, device=device),
        "completion_ids": torch.full((batch, length), token, dtype=torch.long, device=device)
        * completion_mask
        + trainer.processing_class.pad_token_id * (1 - completion_mask),
        "completion_mask": completion_mask,
        "advantages": advantages.detach().to(device, dtype),
    }
    if num_items_in_batch is None:
        factor = args.steps_per_generation if train else 1
        num_items_in_batch = completion_mask.sum() * factor * trainer.accelerator.num_processes
    elif isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.detach()
    elif isinstance(num_items_in_batch, int):
        num_items_in_batch = torch.tensor(num_items_in_batch, dtype=torch.long)
    else:
        num_items_in_batch = torch.tensor(float(num_items_in_batch), dtype=dtype)
    # A long count, as TRL's `gather(loss_mask.sum()).sum()`.
    inputs["num_items_in_batch"] = num_items_in_batch.to(device)
    if old_logprobs is not None:
        inputs["old_per_token_logps"] = old_logprobs.detach().to(device, dtype)
    if ref_logprobs is not None:
        inputs["ref_per_token_logps"] = ref_logprobs.detach().to(device, dtype)
    elif trainer.beta != 0.0:
        raise ValueError("beta != 0 needs ref_logprobs")
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio.detach().to(device, dtype)
    if sampling_logprobs is not None:
        inputs["sampling_per_token_logps"] = sampling_logprobs.detach().to(device, dtype)

    if apply_vllm_is_correction is None:
        apply_vllm_is_correction = importance_sampling_ratio is not None
    if apply_vllm_is_correction and importance_sampling_ratio is None:
        raise ValueError("apply_vllm_is_correction=True needs importance_sampling_ratio")

    was_training = trainer.model.training
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(trainer, "_get_per_token_logps_and_entropies", fake_forward))
        stack.enter_context(_patched(trainer, "use_vllm", bool(apply_vllm_is_correction)))
        if apply_vllm_is_correction:
            stack.enter_context(_patched(trainer, "vllm_importance_sampling_correction", True))
        if train:
            stack.enter_context(
                _patched(trainer, "current_gradient_accumulation_steps", args.gradient_accumulation_steps)
            )
        if exact_scalars:
            stack.enter_context(_default_dtype(dtype))
        trainer.model.train(train)
        try:
            loss = trainer._compute_loss(trainer.model, inputs)
        finally:
            trainer.model.train(was_training)
    grad = None
    if loss.requires_grad:
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    if grad is None:  # the loss does not depend on the log-probs (e.g. everything masked)
        grad = torch.zeros_like(leaf)
    return loss.detach().to(dtype), grad.detach().to(dtype)
