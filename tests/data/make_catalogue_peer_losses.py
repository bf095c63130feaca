"""Record verl 0.9.1's DPPO, DRO, KL-Cov and Clip-Cov losses on fixed float64 inputs.

Regenerate (needs verl, which tests do not)::

    pip install verl==0.9.1 --no-deps
    pip install ray tensordict hydra-core omegaconf codetiming orjson
    python tests/data/make_catalogue_peer_losses.py   # writes tests/data/catalogue_peer_losses.json

Each case runs one ``verl.trainer.ppo.core_algos`` policy-loss function (by its
``loss_mode`` name) on the same inputs and records the loss and its gradient w.r.t.
the current log-probs; ``tests/test_catalogue_peers.py`` checks softtrust against the
recording. Inputs: B = 4 sequences of T = 6 tokens, some positions masked (no empty
row), advantages of both signs (one per sequence, broadcast over tokens as verl takes
them), the old log-probs off-policy by N(0, 0.6) so ratios and probability moves are
large enough for DPPO's masks and the clip to act. Clip-Cov's random pick is made
deterministic by ``clip_cov_ratio = 1``: the pick size ``max(1, ⌊ratio·N⌋) = N`` is at
least the number of candidates, so every candidate is picked in verl and in softtrust.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos

OUT = Path(__file__).with_name("catalogue_peer_losses.json")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")

# (softtrust method name, its parameters, verl loss_mode, verl actor config entries)
CASES = [
    ("dppo", {"divergence": "tv"}, "dppo_tv", {"clip_ratio": 0.15}),
    ("dppo", {"divergence": "tv", "delta_low": 0.1, "delta_high": 0.25, "cap": 1.5}, "dppo_tv",
     {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.25, "clip_ratio_c": 1.5}),
    ("dppo", {"divergence": "binary-kl"}, "dppo_kl", {"clip_ratio": 0.05}),
    ("dppo", {"divergence": "binary-kl", "delta_low": 0.02, "delta_high": 0.1, "cap": 2.0}, "dppo_kl",
     {"clip_ratio": 0.05, "clip_ratio_low": 0.02, "clip_ratio_high": 0.1, "clip_ratio_c": 2.0}),
    ("dro", {"beta": 0.05}, "dro", {"policy_loss": {"dro_beta": 0.05}}),
    ("dro", {"beta": 0.7}, "dro", {"policy_loss": {"dro_beta": 0.7}}),
    ("kl-cov", {}, "kl_cov", {"policy_loss": {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 1.0}}),
    ("kl-cov", {"ratio": 0.2, "coef": 0.5}, "kl_cov", {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}}),
    ("clip-cov", {"ratio": 1.0, "cov_low": 0.05, "cov_high": 5.0}, "clip_cov",
     {"clip_ratio": 0.2, "policy_loss": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}}),
    ("clip-cov", {"ratio": 1.0, "cov_low": 0.02, "cov_high": 0.3, "eps_low": 0.1, "eps_high": 0.3}, "clip_cov",
     {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3,
      "policy_loss": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.02, "clip_cov_ub": 0.3}}),
]  # fmt: skip


def inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2026)
    batch, length = 4, 6
    logprobs = -0.05 - 2.0 * torch.rand(batch, length, generator=gen, dtype=torch.float64)
    old = (logprobs + 0.6 * torch.randn(batch, length, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    advantages = torch.tensor([1.1, -0.8, 0.6, -1.4], dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) < 0.75
    mask[:, 0] = True
    return {"logprobs": logprobs, "old_logprobs": old, "advantages": advantages, "mask": mask}


def verl_loss(loss_mode, config_entries, aggregation, data):
    config = OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "clip_ratio_low": None,
            "clip_ratio_high": None,
            "global_batch_info": {},
            **{key: value for key, value in config_entries.items() if key != "policy_loss"},
            "policy_loss": {
                "loss_mode": loss_mode,
                "clip_cov_ratio": None,
                "clip_cov_lb": None,
                "clip_cov_ub": None,
                "kl_cov_ratio": None,
                "ppo_kl_coef": None,
                "dro_beta": None,
                **config_entries.get("policy_loss", {}),
            },
        }
    )
    leaf = data["logprobs"].clone().requires_grad_(True)
    token_advantages = data["advantages"][:, None].expand_as(leaf).contiguous()
    loss_fn = core_algos.get_policy_loss_fn(loss_mode)
    loss, _ = loss_fn(
        old_log_prob=data["old_logprobs"],
        log_prob=leaf,
        advantages=token_advantages,
        response_mask=data["mask"].to(torch.float64),
        loss_agg_mode=aggregation,
        config=config,
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.item(), grad


def main() -> None:
    torch.manual_seed(0)  # verl's Clip-Cov draws a permutation; with every candidate picked it cannot matter
    data = inputs()
    records = []
    for method, params, loss_mode, config in CASES:
        for aggregation in AGGREGATIONS:
            loss, grad = verl_loss(loss_mode, config, aggregation, data)
            records.append(
                {
                    "method": method,
                    "params": params,
                    "verl_loss_mode": loss_mode,
                    "verl_config": config,
                    "aggregation": aggregation,
                    "loss": loss,
                    "grad": grad.tolist(),
                }
            )
    payload = {
        "peer": "verl==0.9.1 verl.trainer.ppo.core_algos",
        "regenerate": "python tests/data/make_catalogue_peer_losses.py",
        "inputs": {name: tensor.tolist() for name, tensor in data.items()},
        "cases": records,
    }
    with tempfile.NamedTemporaryFile("w", dir=OUT.parent, suffix=".tmp", delete=False) as handle:
        json.dump(payload, handle, indent=1)
    os.chmod(handle.name, 0o644)
    os.replace(handle.name, OUT)  # atomic: never a half-written recording
    print(f"wrote {len(records)} cases to {OUT}")


if __name__ == "__main__":
    main()
