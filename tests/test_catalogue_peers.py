"""DPPO, DRO, KL-Cov and Clip-Cov against verl 0.9.1's recorded losses and gradients (float64).

The recording (``tests/data/catalogue_peer_losses.json``) was produced by running
verl's ``core_algos`` policy-loss functions; regenerate it with
``python tests/data/make_catalogue_peer_losses.py`` (its docstring lists what to install).
verl is not needed here. Clip-Cov's case picks every candidate (``ratio = 1``), so
verl's random permutation cannot matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import softtrust as st

from budgets import F64_PARITY, VERL_EPSILON
from helpers import loss_and_grad

pytestmark = pytest.mark.numerics  # peer parity: the outcome depends on float paths

RECORDING = json.loads((Path(__file__).parent / "data" / "catalogue_peer_losses.json").read_text())
INPUTS = {
    name: torch.tensor(value, dtype=torch.bool if name == "mask" else torch.float64)
    for name, value in RECORDING["inputs"].items()
}
CASES = RECORDING["cases"]

# the mechanism each case must exercise, so that agreement is not vacuous: metric -> it is in (0, 1)
ACTIVE = {"dppo": "dppo/masked", "kl-cov": "cov/selected", "clip-cov": "cov/picked"}


def case_id(case: dict) -> str:
    params = ",".join(f"{key}={value}" for key, value in case["params"].items())
    return f"{case['verl_loss_mode']}[{params}]-{case['aggregation']}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_softtrust_matches_verl_recording(case):
    loss_fn = st.PolicyLoss(case["method"], aggregation=case["aggregation"], **case["params"])
    loss, grad, metrics = loss_and_grad(
        loss_fn, INPUTS["logprobs"], INPUTS["old_logprobs"], INPUTS["advantages"], INPUTS["mask"]
    )
    assert loss.dtype == torch.float64
    # float64 parity, and verl's 1e-8 added to its token counts (budgets.VERL_EPSILON)
    assert loss.item() == pytest.approx(case["loss"], abs=F64_PARITY, rel=VERL_EPSILON)
    expected_grad = torch.tensor(case["grad"], dtype=torch.float64)
    torch.testing.assert_close(grad, expected_grad, atol=F64_PARITY, rtol=VERL_EPSILON)
    if case["method"] in ACTIVE:
        assert 0 < metrics[ACTIVE[case["method"]]] < 1


def test_recording_covers_every_verl_peer_and_both_advantage_signs():
    assert {case["verl_loss_mode"] for case in CASES} == {"dppo_tv", "dppo_kl", "dro", "kl_cov", "clip_cov"}
    advantages, mask = INPUTS["advantages"], INPUTS["mask"]
    assert (advantages > 0).any() and (advantages < 0).any()
    assert (~mask).any() and mask.any(dim=1).all()
