"""PSPO, a method TRL does not have, inside TRL's GRPOTrainer. Runs on CPU in seconds.

    python examples/trl_pspo.py

PSPO (arXiv:2509.21282) replaces PPO's clipped ratio with the ratio of a smoothed policy,
``-((1-α)·r + α)·A``: no clip, no min. TRL's ``loss_type`` has no such option; with
softtrust it is one ``PolicyLoss`` argument, and every other part of the run (generation,
rewards, advantages, accumulation, logging) stays TRL's. The aggregation is chosen
independently of the method (here ``token-mean`` over the whole accumulation window).

To train a real model with vLLM, change the lines marked ``REAL:`` (docs/trl.md).
"""

from __future__ import annotations

import random
import tempfile

import torch
from datasets import Dataset
from transformers import PrinterCallback
from trl import GRPOConfig

import softtrust as st
from softtrust.integrations.trl import SoftTrustGRPOTrainer
from softtrust.train.tasks import SingleDigitAdditionTask
from softtrust.train.tiny import build_char_tokenizer, build_tiny_model

TASK = SingleDigitAdditionTask()  # "3+4=" -> "07"


def addition_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """The task's reward (1 for the exact sum, partial credit per correct digit) plus a small
    bonus for writing digits at all, so that a random tiny model gets a signal from step 1.
    TRL passes the dataset's ``answer`` column as a keyword argument."""
    return [
        TASK.reward(completion, target) + 0.1 * sum(c.isdigit() for c in completion) / max(len(completion), 1)
        for completion, target in zip(completions, answer, strict=True)
    ]


def main(max_steps: int = 4) -> SoftTrustGRPOTrainer:
    torch.set_num_threads(1)
    rng = random.Random(0)
    problems = [TASK.sample(rng) for _ in range(64)]
    dataset = Dataset.from_dict(
        {"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]}
    )

    # REAL: model, tokenizer = "Qwen/Qwen3-1.7B", None   (a Hub id or a local path; TRL loads both)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="softtrust-trl-pspo-"),  # REAL: your output directory
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,  # REAL: e.g. 2048
        gradient_accumulation_steps=2,
        steps_per_generation=8,  # one rollout feeds 4 optimizer steps: 3 of them off-policy
        max_steps=max_steps,
        learning_rate=3e-3,  # REAL: e.g. 1e-6
        logging_steps=1,
        use_cpu=True,  # REAL: remove
        bf16=False,  # TRL autocasts to bf16 by default, on a CPU too; REAL: bf16=True
        # REAL: use_vllm=True, vllm_mode="colocate",
        #       vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
        #       vllm_importance_sampling_clip_max=3.0,   (the TIS below mirrors these three settings)
        report_to="none",  # REAL: e.g. "wandb" or "tensorboard": softtrust/* metrics go there too
        save_strategy="no",
        disable_tqdm=True,
    )
    # With vLLM, correct for the sampler/trainer mismatch with TRL's cap (TIS on the per-token loss).
    correction = st.TIS(cap=args.vllm_importance_sampling_clip_max) if args.use_vllm else None
    policy_loss = st.PolicyLoss(st.PSPO(alpha=0.1), correction=correction, aggregation="token-mean")
    trainer = SoftTrustGRPOTrainer(
        model=model,
        reward_funcs=addition_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        policy_loss=policy_loss,
    )
    trainer.remove_callback(PrinterCallback)  # print our own summary below instead of TRL's raw dicts
    print(trainer.policy_loss)
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry and "softtrust/ratio/mean" in entry:
            print(
                f"step {entry['step']}: loss {entry['loss']:+.4f}  "
                f"ratio {entry['softtrust/ratio/mean']:.3f} [{entry['softtrust/ratio/min']:.3f}, "
                f"{entry['softtrust/ratio/max']:.3f}]  ess {entry['softtrust/ess']:.3f}  entropy {entry['entropy']:.3f}"
            )
    return trainer


if __name__ == "__main__":
    main()
