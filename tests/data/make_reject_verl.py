"""Record verl 0.9.1's rejection-sampling masks (``rollout_rs``) on fixed inputs, for tests/test_selection.py.

Regenerate::

    pip install verl==0.9.1 --no-deps && pip install ray tensordict hydra-core omegaconf codetiming orjson
    python tests/data/make_reject_verl.py   # writes tests/data/reject_verl.json

Runs ``verl.trainer.ppo.rollout_corr_helper.compute_rollout_rejection_mask`` (verl's own
code) with ``log_ratio = old - rollout`` (as verl's ``compute_rollout_correction_and_rejection_mask``
passes it) for every option verl supports; the test maps each option to a softtrust
``Reject`` with the spelling of docs/methods.md and compares the masks token for token.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

OPTIONS = {  # option: threshold spec
    "token_k1": "0.8_1.25",
    "token_k2": "0.02",
    "token_k3": "0.01",
    "seq_sum_k1": "0.5_2.0",
    "seq_sum_k2": "0.25",
    "seq_sum_k3": "0.25",
    "seq_mean_k1": "0.99_1.03",
    "seq_mean_k2": "0.03",
    "seq_mean_k3": "0.03",
    "seq_max_k2": "0.1",
    "seq_max_k3": "0.1",
}


def main() -> None:
    gen = torch.Generator().manual_seed(71)
    log_rho = 0.25 * torch.randn(16, 12, generator=gen, dtype=torch.float64)
    mask = torch.rand(16, 12, generator=gen) < 0.75
    mask[:, 0] = True
    masks = {
        option: compute_rollout_rejection_mask(log_rho, mask.double(), option, spec)[0].tolist()
        for option, spec in OPTIONS.items()
    }
    record = {
        "peer": "verl==0.9.1",
        "log_rho": log_rho.tolist(),
        "mask": mask.tolist(),
        "thresholds": OPTIONS,
        "verl_masks": masks,
    }
    out = Path(__file__).with_name("reject_verl.json")
    with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as handle:
        json.dump(record, handle)
    os.chmod(handle.name, 0o644)
    os.replace(handle.name, out)  # atomic: never a half-written file
    print(f"wrote {out} ({len(masks)} options)")


if __name__ == "__main__":
    main()
