"""Peer parity from recorded data: softtrust's PolicyLoss against verl 0.9.1 and the official VESPO.

``tests/data/peer_losses.json`` holds fixed float64 inputs and, per case, the loss and
gradient that a peer computed on them (verl's vanilla, gspo, cispo, gpg, sapo and geo_mean
losses, in the aggregation each applies, and the official VESPO function), with the
softtrust spelling of the same loss. It was produced by running the peers:
``tests/data/make_peer_losses.py`` (its docstring has the command). No peer is needed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import softtrust as st

from budgets import F64_PARITY, VERL_EPSILON

pytestmark = pytest.mark.numerics  # peer parity: the outcome depends on float paths

DATA = json.loads((Path(__file__).parent / "data" / "peer_losses.json").read_text())
INPUTS = {name: torch.tensor(value, dtype=torch.float64) for name, value in DATA["inputs"].items()}
INPUTS["mask"] = INPUTS["mask"].bool()
CASES = DATA["cases"]


def case_id(case: dict) -> str:
    spec = case["softtrust"]
    correction = spec["correction"]
    weights = "none" if correction is None else f"{correction['kind']}-{correction['level']}"
    scope = "global" if spec["scale"] != 1 else "local"
    return f"{case['peer']}-{spec['aggregation']}-{scope}-{weights}"


def correction_of(spec: dict | None):
    if spec is None:
        return None
    kind = {"TIS": st.TIS, "MIS": st.MIS}[spec["kind"]]
    return kind(**{k: v for k, v in spec.items() if k != "kind"})


def softtrust_loss_and_grad(spec: dict) -> tuple[float, torch.Tensor]:
    loss_fn = st.PolicyLoss(
        spec["method"],
        correction=correction_of(spec["correction"]),
        aggregation=spec["aggregation"],
        max_completion_length=spec.get("max_completion_length"),
        **spec["params"],
    )
    leaf = INPUTS["logprobs"].clone().requires_grad_(True)
    rollout = INPUTS["rollout"] if spec["correction"] is not None else None
    out = loss_fn(
        leaf,
        INPUTS["old"],
        INPUTS["advantages"],
        INPUTS["mask"],
        rollout_logprobs=rollout,
        num_tokens=spec["num_tokens"],
        num_sequences=spec["num_sequences"],
    )
    loss = out.loss * spec["scale"]  # verl's losses carry the data-parallel size (see docs/verl.md)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.item(), grad


def test_recording_covers_every_peer():
    peers = {case["peer"] for case in CASES}
    assert peers == {
        "verl:vanilla",
        "verl:gspo",
        "verl:cispo",
        "verl:sapo",
        "verl:gpg",
        "verl:geo_mean",
        "official-vespo",
    }
    assert DATA["verl"] == "0.9.1"
    # the inputs exercise what they claim: a masked entry, an empty row, both advantage signs
    assert not INPUTS["mask"].all() and not INPUTS["mask"][4].any()
    assert (INPUTS["advantages"] > 0).any() and (INPUTS["advantages"] < 0).any()


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_policy_loss_matches_recorded_peer(case):
    loss, grad = softtrust_loss_and_grad(case["softtrust"])
    expected_grad = torch.tensor(case["grad"], dtype=torch.float64)
    # float64 parity (budgets.F64_PARITY, 1e-12); verl's geo_mean adds 1e-8 to each length
    relative = VERL_EPSILON if case["peer"] == "verl:geo_mean" else F64_PARITY
    assert loss == pytest.approx(case["loss"], abs=F64_PARITY, rel=relative)
    torch.testing.assert_close(grad, expected_grad, atol=F64_PARITY, rtol=relative)
    assert expected_grad.abs().sum() > 0  # a case with no gradient would test nothing
    assert torch.all(grad[~INPUTS["mask"]] == 0)  # masked garbage never leaks
