"""Record peer losses: verl 0.9.1's built-in policy losses and the official VESPO function.

Writes ``tests/data/peer_losses.json``: fixed float64 inputs and, per case, the peer's
loss and its gradient w.r.t. ``log_prob``, with the softtrust spelling of the same loss.
``tests/test_peer_losses.py`` checks :class:`softtrust.PolicyLoss` against it without
verl; ``tests/test_verl_integration.py`` replays every case through verl's registry
(``get_policy_loss_fn("softtrust.<method>")``) when verl is installed.

Regenerate (needs verl 0.9.1 importable, e.g. ``bash scripts/setup.sh``, and a checkout
of the official VESPO code, FloyedShen/VESPO, whose ``recipe/vespo/code/core_algos.py``
is loaded from that checkout and run, never copied)::

    .venv/bin/python tests/data/make_peer_losses.py --vespo /path/to/VESPO

Peers and what each case fixes (B = 5 sequences, T = 8 tokens, one fully masked row,
masked entries holding garbage, both advantage signs, ratios inside and outside every
clip range):

| peer (verl loss_mode)    | softtrust                   | aggregation recorded                    | rollout IS weights |
| ------------------------ | --------------------------- | --------------------------------------- | ------------------ |
| ``vanilla`` (dual-clip)  | ``clip`` (``dual_clip=c``)  | all five, local and global normalisers  | none, token TIS, sequence TIS, token IcePop |
| ``gspo``                 | ``gspo``                    | all five, local and global              | none, sequence TIS (token: see below) |
| ``cispo``                | ``cispo`` (1 ± ε bounds)    | all five, local and global              | none, token TIS, sequence TIS |
| ``gpg``                  | ``reinforce``               | all five, local and global              | none, token TIS, sequence TIS |
| ``sapo``                 | ``sapo``                    | seq-mean-token-mean (hard-coded by verl), local and global | none, token TIS, sequence TIS |
| ``geo_mean``             | ``gmpo``                    | mean over the micro-batch's B sequences (hard-coded) | none, sequence TIS |
| official VESPO           | ``vespo`` (sequence-sum)    | token-mean, seq-mean-token-mean, seq-mean-token-sum (local) | none, token TIS |

verl's geo_mean takes the geometric mean of token weights, the official VESPO sums the
logs of whatever weight arrives per token, and verl's gspo gives token t its own weight
w_t in the gradient, so each is recorded only where that equals the softtrust reading
(sequence weights for geo_mean and gspo, token weights for VESPO).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

B, T = 5, 8
OUT = Path(__file__).with_name("peer_losses.json")
AGGREGATIONS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
TIS_CAP = 2.0
ICEPOP = (0.5, 2.0)


def make_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed float64 inputs: masked garbage, an empty row, both signs, far off-policy tokens."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = -2.5 * torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.05
    old = logprobs + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    rollout = old + 0.25 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.6, 0.9], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 6:] = False
    mask[1, 3] = False
    mask[2, 5:] = False
    mask[4, :] = False  # a fully masked row
    old[1, 0] -= 1.5  # r = e^1.5 ≈ 4.5 with A < 0: past verl's dual clip c = 3
    old[0, 2] += 0.9  # r < 1 - ε with A > 0
    old[3, 1] += 1.0  # r ≈ 0.37 with A < 0: clipped low
    old[2, 1] -= 0.6  # r > 1 + ε with A > 0: clipped high
    # garbage at masked positions: must not leak into any loss or gradient
    old[0, 7], logprobs[1, 3], rollout[2, 6] = -40.0, -35.0, 25.0
    return {"logprobs": logprobs, "old": old, "rollout": rollout, "advantages": advantages, "mask": mask}


def _token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's [B, T] advantages: the sequence advantage on every active token, 0 elsewhere."""
    return advantages.unsqueeze(-1) * mask


def _weights(inputs, level: str, threshold) -> torch.Tensor:
    """verl's rollout_is_weights, computed by verl from log(π_old / π_rollout)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    log_ratio = inputs["old"] - inputs["rollout"]
    weights, _ = compute_rollout_correction_weights(log_ratio, inputs["mask"].double(), level, threshold)
    return weights


def _correction(kind: str | None, level: str | None):
    if kind is None:
        return None, None
    if kind == "tis":
        return TIS_CAP, {"kind": "TIS", "cap": TIS_CAP, "level": level}
    low, high = ICEPOP
    return f"{low}_{high}", {"kind": "MIS", "low": low, "high": high, "level": level}


def _actor_config(fields: dict, global_info: dict):
    from verl.workers.config import FSDPActorConfig

    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)
    config.global_batch_info.update(global_info)
    return config


def _run(fn, inputs, weights, aggregation, config):
    leaf = inputs["logprobs"].clone().requires_grad_(True)
    loss, _ = fn(
        old_log_prob=inputs["old"],
        log_prob=leaf,
        advantages=_token(inputs["advantages"], inputs["mask"]),
        response_mask=inputs["mask"],
        loss_agg_mode=aggregation,
        config=config,
        rollout_is_weights=weights,
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.item(), grad


def _global_info(inputs, scaled: bool) -> tuple[dict, dict]:
    """(verl's global_batch_info, softtrust's normalisers): local, or as rank 0 of 2 with a 3x larger batch."""
    mask = inputs["mask"]
    if not scaled:
        active = int((mask.sum(-1) > 0).sum())
        return {}, {"num_tokens": None, "num_sequences": active, "scale": 1}
    tokens, sequences = 3 * int(mask.sum()), 3 * B
    info = {"dp_size": 2, "batch_num_tokens": tokens, "global_batch_size": sequences, "loss_scale_factor": 12}
    return info, {"num_tokens": tokens, "num_sequences": sequences, "scale": 2, "max_completion_length": 12}


VERL_PEERS = {
    # loss_mode: (softtrust method, its parameters, verl actor fields, aggregations, corrections)
    "vanilla": (
        "clip",
        {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0},
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0},
        AGGREGATIONS,
        [(None, None), ("tis", "token"), ("tis", "sequence"), ("icepop", "token")],
    ),
    "gspo": (
        "gspo",
        {"eps_low": 0.08, "eps_high": 0.1},
        {"clip_ratio_low": 0.08, "clip_ratio_high": 0.1},
        AGGREGATIONS,
        # token weights: same loss, different gradient (verl gives token t its own w_t through
        # sg(s_i)·π_t/sg(π_t); softtrust's w_t multiplies ℓ_i, whose gradient reaches every token
        # of the row through the mean log-ratio): see docs/verl.md
        [(None, None), ("tis", "sequence")],
    ),
    "cispo": (
        "cispo",
        {"ratio_low": 0.8, "ratio_high": 1.28},
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
        AGGREGATIONS,
        [(None, None), ("tis", "token"), ("tis", "sequence")],
    ),
    "gpg": (
        "reinforce",
        {},
        {},
        AGGREGATIONS,
        [(None, None), ("tis", "token"), ("tis", "sequence")],
    ),
    "sapo": (
        "sapo",
        {"tau_pos": 1.0, "tau_neg": 1.05},
        {"tau_pos": 1.0, "tau_neg": 1.05},
        ("seq-mean-token-mean",),
        [(None, None), ("tis", "token"), ("tis", "sequence")],
    ),
}


def verl_cases(inputs) -> list[dict]:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    cases = []
    for mode, (method, params, fields, aggregations, corrections) in VERL_PEERS.items():
        for aggregation in aggregations:
            for scaled in (False, True):
                info, normalisers = _global_info(inputs, scaled)
                for kind, level in corrections:
                    threshold, correction = _correction(kind, level)
                    weights = None if kind is None else _weights(inputs, level, threshold)
                    loss, grad = _run(
                        get_policy_loss_fn(mode), inputs, weights, aggregation, _actor_config(fields, info)
                    )
                    cases.append(
                        _case(
                            f"verl:{mode}", method, params, aggregation, normalisers, correction, loss, grad
                        )
                        | {"verl": {"loss_mode": mode, "fields": fields, "global_batch_info": info}}
                    )
    # geo_mean: its own mean over the B sequences of the micro-batch, no global normalisers
    for kind, level in [(None, None), ("tis", "sequence")]:
        threshold, correction = _correction(kind, level)
        weights = None if kind is None else _weights(inputs, level, threshold)
        fields = {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
        loss, grad = _run(
            get_policy_loss_fn("geo_mean"), inputs, weights, "token-mean", _actor_config(fields, {})
        )
        normalisers = {"num_tokens": None, "num_sequences": B, "scale": 1}
        cases.append(
            _case(
                "verl:geo_mean",
                "gmpo",
                {"eps": 0.4},
                "seq-mean-token-mean",
                normalisers,
                correction,
                loss,
                grad,
            )
            | {"verl": {"loss_mode": "geo_mean", "fields": fields, "global_batch_info": {}}}
        )
    return cases


def vespo_cases(inputs, repo: Path) -> list[dict]:
    path = repo / "recipe" / "vespo" / "code" / "core_algos.py"
    spec = importlib.util.spec_from_file_location("official_vespo_core_algos", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers verl loss_mode "vespo"
    official = module.compute_policy_loss_vespo
    cases = []
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        info, normalisers = _global_info(inputs, scaled=False)
        for kind, level in [(None, None), ("tis", "token")]:
            threshold, correction = _correction(kind, level)
            weights = None if kind is None else _weights(inputs, level, threshold)
            loss, grad = _run(official, inputs, weights, aggregation, _actor_config({}, info))
            case = _case("official-vespo", "vespo", {}, aggregation, normalisers, correction, loss, grad)
            cases.append(case | {"verl": {"loss_mode": None, "fields": {}, "global_batch_info": info}})
    return cases


def _case(peer, method, params, aggregation, normalisers, correction, loss, grad) -> dict:
    return {
        "peer": peer,
        "softtrust": {
            "method": method,
            "params": params,
            "aggregation": aggregation,
            "correction": correction,
            **normalisers,
        },
        "loss": loss,
        "grad": grad.tolist(),
    }


def _git_commit(repo: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vespo", type=Path, required=True, help="a checkout of FloyedShen/VESPO")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")  # the peers alone, not softtrust's plugin
    import verl

    torch.manual_seed(0)
    inputs = make_inputs()
    cases = verl_cases(inputs) + vespo_cases(inputs, args.vespo)
    record = {
        "about": "peer losses; regenerate: .venv/bin/python tests/data/make_peer_losses.py --vespo /path/to/VESPO",
        "verl": verl.__version__,
        "vespo_commit": _git_commit(args.vespo) or "unknown",
        "torch": torch.__version__,
        "inputs": {name: x.tolist() for name, x in inputs.items()},
        "cases": cases,
    }
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=None, separators=(",", ":")) + "\n")
    os.replace(tmp, args.out)  # atomic: never a half-written file
    print(
        f"wrote {len(cases)} cases to {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr
    )


if __name__ == "__main__":
    main()
