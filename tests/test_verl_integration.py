"""softtrust inside verl 0.9.1: the plugin, the registry names, peer parity through verl's registry.

Peer parity replays every case of ``tests/data/peer_losses.json`` (recorded from verl's own
losses and the official VESPO function, see ``tests/data/make_peer_losses.py``) through
``get_policy_loss_fn("softtrust.<method>")`` with verl's config fields, not softtrust's, and
re-runs verl's own losses live to check that the recording is what verl computes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

import verl
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPActorConfig

import softtrust as st
from softtrust.integrations import verl as st_verl

from budgets import F64_PARITY, VERL_EPSILON

DATA = json.loads((Path(__file__).parent / "data" / "peer_losses.json").read_text())
INPUTS = {name: torch.tensor(value, dtype=torch.float64) for name, value in DATA["inputs"].items()}
INPUTS["mask"] = INPUTS["mask"].bool()


def actor_config(fields=None, global_info=None, softtrust=None, rollout_correction=None):
    policy_loss = {"softtrust": softtrust or {}}
    if rollout_correction is not None:
        policy_loss["rollout_correction"] = rollout_correction
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=st_verl.SoftTrustPolicyLossConfig(**policy_loss),
        **(fields or {}),
    )
    config.global_batch_info.update(global_info or {})
    return config


def verl_weights(correction):
    if correction is None:
        return None
    threshold = (
        correction["cap"] if correction["kind"] == "TIS" else f"{correction['low']}_{correction['high']}"
    )
    log_ratio = INPUTS["old"] - INPUTS["rollout"]
    weights, _ = compute_rollout_correction_weights(
        log_ratio, INPUTS["mask"].double(), correction["level"], threshold
    )
    return weights


def run(fn, aggregation, config, weights, logprobs=None, mask=None, advantages=None, old=None):
    mask = INPUTS["mask"] if mask is None else mask
    advantages = INPUTS["advantages"] if advantages is None else advantages
    leaf = (INPUTS["logprobs"] if logprobs is None else logprobs).clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=INPUTS["old"] if old is None else old,
        log_prob=leaf,
        advantages=advantages.unsqueeze(-1) * mask,
        response_mask=mask,
        loss_agg_mode=aggregation,
        config=config,
        rollout_is_weights=weights,
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


def case_id(case):
    correction = case["softtrust"]["correction"]
    weights = "none" if correction is None else f"{correction['kind']}-{correction['level']}"
    scope = "global" if case["verl"]["global_batch_info"] else "local"
    return f"{case['peer']}-{case['softtrust']['aggregation']}-{scope}-{weights}"


def test_entry_point_registers_every_method_on_plain_import_verl():
    """A fresh `import verl` (what each Ray worker does) finds softtrust.<name> for every method."""
    code = (
        "import verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(sorted(k for k in R if k.startswith('softtrust.')))\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(sorted(f"softtrust.{name}" for name in st.METHODS))
    assert not out.stderr.strip() or "softtrust" not in out.stderr  # loaded without a warning


def test_one_loss_mode_per_registered_method():
    assert sorted(st_verl.loss_mode(name) for name in st.METHODS) == st_verl.REGISTERED
    for name in st.METHODS:
        assert POLICY_LOSS_REGISTRY[f"softtrust.{name}"].__name__ == f"softtrust_{name.replace('-', '_')}"


def test_verl_field_table_names_real_parameters():
    """Every mapping entry of a method that exists names parameters of that method's class."""
    present = [name for name in st_verl.VERL_FIELDS if name in st.METHODS]
    assert {"clip", "gspo", "cispo", "sapo", "gmpo"} <= set(present)
    for name in present:
        fields = {f.name for f in dataclasses.fields(st.METHODS[name])}
        assert set(st_verl.VERL_FIELDS[name]) <= fields, name


@pytest.mark.numerics
@pytest.mark.parametrize("case", DATA["cases"], ids=[case_id(c) for c in DATA["cases"]])
def test_softtrust_loss_mode_matches_recorded_peer(case):
    """softtrust.<method> through verl's registry, configured by verl's fields, equals the peer."""
    spec, setup = case["softtrust"], case["verl"]
    correction = spec["correction"]
    weights = verl_weights(correction)
    softtrust = {} if correction is None else {"rollout_is": correction["level"]}
    fields = setup["fields"]
    info = setup["global_batch_info"]
    if setup["loss_mode"] == "geo_mean":  # its mean counts every row, as a run's global_batch_size does
        info = {"global_batch_size": INPUTS["mask"].shape[0]}
    config = actor_config(fields, info, softtrust)
    fn = get_policy_loss_fn(st_verl.loss_mode(spec["method"]))
    loss, grad, metrics = run(fn, spec["aggregation"], config, weights)
    expected_grad = torch.tensor(case["grad"], dtype=torch.float64)
    # float64 parity through verl's aggregation (its counts + 1e-8): budgets.VERL_EPSILON
    assert loss.item() == pytest.approx(case["loss"], abs=F64_PARITY, rel=VERL_EPSILON)
    torch.testing.assert_close(grad, expected_grad, atol=F64_PARITY, rtol=VERL_EPSILON)
    assert metrics and all(
        isinstance(v, float) and k.startswith("actor/softtrust/") for k, v in metrics.items()
    )
    if setup["loss_mode"] is not None:  # the recording is what verl computes today
        peer_config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)
        peer_config.global_batch_info.update(setup["global_batch_info"])
        peer_loss, peer_grad, _ = run(
            get_policy_loss_fn(setup["loss_mode"]), "token-mean", peer_config, weights
        )
        if setup["loss_mode"] != "geo_mean":
            peer_loss, peer_grad, _ = run(
                get_policy_loss_fn(setup["loss_mode"]), spec["aggregation"], peer_config, weights
            )
        # the same verl code on the same float64 inputs as the recording (measured: 9e-16)
        assert peer_loss.item() == pytest.approx(case["loss"], abs=F64_PARITY, rel=F64_PARITY)
        torch.testing.assert_close(peer_grad, expected_grad, atol=F64_PARITY, rtol=F64_PARITY)


@pytest.mark.numerics
def test_vespo_folds_a_sequence_weight_once():
    """A sequence-level weight arrives repeated on every token: VESPO adds log w_i once, not n_i times."""
    correction = {"kind": "TIS", "cap": 2.0, "level": "sequence"}
    weights = verl_weights(correction)
    fn = get_policy_loss_fn("softtrust.vespo")
    loss, grad, _ = run(fn, "token-mean", actor_config(softtrust={"rollout_is": "sequence"}), weights)
    # the same through verl's own rollout-correction field (what bypass mode or an interpolation sets)
    via_verl = actor_config(rollout_correction={"rollout_is": "sequence"})
    loss_verl, grad_verl, _ = run(fn, "token-mean", via_verl, weights)
    reference = st.PolicyLoss("vespo", correction=st.TIS(cap=2.0, level="sequence"))
    leaf = INPUTS["logprobs"].clone().requires_grad_(True)
    out = reference(
        leaf, INPUTS["old"], INPUTS["advantages"], INPUTS["mask"], rollout_logprobs=INPUTS["rollout"]
    )
    (expected_grad,) = torch.autograd.grad(out.loss, leaf)
    for value, gradient in ((loss, grad), (loss_verl, grad_verl)):  # verl's aggregation: counts + 1e-8
        assert value.item() == pytest.approx(out.loss.item(), abs=F64_PARITY, rel=VERL_EPSILON)
        torch.testing.assert_close(gradient, expected_grad, atol=F64_PARITY, rtol=VERL_EPSILON)
    # read as token weights (the official code's reading) the result differs: the level matters
    token_loss, _, _ = run(fn, "token-mean", actor_config(softtrust={"rollout_is": "token"}), weights)
    assert abs(token_loss.item() - loss.item()) > 1e-3


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("method", "mode", "fields", "aggregations"),
    [
        ("gspo", "gspo", {"clip_ratio_low": 0.08, "clip_ratio_high": 0.1}, st.AGGREGATIONS),
        # geo_mean hard-codes a mean over the micro-batch's rows: softtrust's seq-mean over B rows
        ("gmpo", "geo_mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, ("seq-mean-token-mean",)),
    ],
)
@pytest.mark.parametrize("global_info", [False, True])
@pytest.mark.parametrize(
    "correction",
    [
        {"kind": "TIS", "cap": 2.0, "level": "token"},
        {"kind": "MIS", "low": 0.8, "high": 1.25, "level": "token"},  # IcePop: zeros outside the band
    ],
    ids=["tis", "icepop"],
)
def test_token_level_weights_on_sequence_methods_match_verl_live(
    method, mode, fields, aggregations, global_info, correction
):
    """Token IS weights on GSPO and GMPO: verl's own gspo / geo_mean, run now on the same inputs.

    verl's gspo gives token t its own weight through GSPO-token's ratio (the adapter runs
    GSPO at ``sequence-mean-token``); geo_mean multiplies each sequence by the geometric
    mean of its token weights (the adapter reads them per sequence for GMPO)."""
    weights = verl_weights(correction)
    if correction["kind"] == "MIS":
        assert (weights[INPUTS["mask"]] == 0).any()  # some tokens are rejected
    mask = INPUTS["mask"]
    info = {}
    if global_info:
        info = {"dp_size": 2, "batch_num_tokens": 3 * int(mask.sum()), "global_batch_size": 3 * mask.shape[0]}
    if mode == "geo_mean":
        info = {"global_batch_size": mask.shape[0]}
    peer_config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)
    peer_config.global_batch_info.update(info)
    for aggregation in aggregations:
        loss, grad, _ = run(
            get_policy_loss_fn(f"softtrust.{method}"), aggregation, actor_config(fields, info), weights
        )
        peer_aggregation = "token-mean" if mode == "geo_mean" else aggregation
        peer_loss, peer_grad, _ = run(get_policy_loss_fn(mode), peer_aggregation, peer_config, weights)
        # float64 parity with verl's own loss (counts + 1e-8: budgets.VERL_EPSILON)
        assert loss.item() == pytest.approx(peer_loss.item(), abs=F64_PARITY, rel=VERL_EPSILON), aggregation
        torch.testing.assert_close(grad, peer_grad, atol=F64_PARITY, rtol=VERL_EPSILON)
        assert grad.abs().sum() > 0
    # the plain sequence-mean reading gives each token its row's mean weight: another gradient
    if method == "gspo":
        plain = actor_config(fields, info, softtrust={"level": "sequence-mean"})
        _, plain_grad, _ = run(get_policy_loss_fn("softtrust.gspo"), "token-mean", plain, weights)
        _, peer_grad, _ = run(get_policy_loss_fn("gspo"), "token-mean", peer_config, weights)
        assert (plain_grad - peer_grad).abs().max() > 1e-4


def test_vespo_refuses_weights_of_unknown_level():
    """verl's untouched default rollout_correction (rollout_is='sequence' whatever the algorithm uses) is not read."""
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    weights = verl_weights({"kind": "TIS", "cap": 2.0, "level": "token"})
    with pytest.raises(ValueError, match="rollout_is"):
        run(get_policy_loss_fn("softtrust.vespo"), "token-mean", config, weights)
    # methods that multiply the loss by the weight need no level
    run(get_policy_loss_fn("softtrust.clip"), "token-mean", config, weights)


# verl calls the loss once per micro-batch with no batch-wide state: methods that select over the
# batch (Method.batch_state) select within each micro-batch there, as verl's own kl_cov/clip_cov do
ADDITIVE = sorted(name for name, cls in st.METHODS.items() if cls.batch_state is st.Method.batch_state)


@pytest.mark.numerics
@pytest.mark.parametrize("method", ADDITIVE)
@pytest.mark.parametrize("aggregation", st.AGGREGATIONS)
def test_micro_batches_and_ranks_add_up_to_the_batch(method, aggregation):
    """Two micro-batches with verl's global_batch_info sum to the whole batch; two 'ranks' average to it."""
    mask = INPUTS["mask"]
    full_info = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0]}
    fn = get_policy_loss_fn(st_verl.loss_mode(method))
    full_loss, full_grad, _ = run(fn, aggregation, actor_config(global_info=full_info), None)
    for dp_size in (1, 2):  # dp 2: each rank's loss carries dp_size; FSDP averages the ranks' gradients
        info = {**full_info, "dp_size": dp_size}
        parts = [slice(0, 2), slice(2, None)]
        total, grad = 0.0, torch.zeros_like(full_grad)
        for part in parts:
            loss, part_grad, _ = run(
                fn,
                aggregation,
                actor_config(global_info=info),
                None,
                logprobs=INPUTS["logprobs"][part],
                mask=mask[part],
                advantages=INPUTS["advantages"][part],
                old=INPUTS["old"][part],
            )
            total += loss.item() / dp_size
            grad[part] = part_grad / dp_size
        # float64, the same sums split in two (measured 5.6e-17)
        assert total == pytest.approx(full_loss.item(), abs=F64_PARITY)
        torch.testing.assert_close(grad, full_grad, atol=F64_PARITY, rtol=F64_PARITY)
    assert full_grad.abs().sum() > 0


def test_parameters_come_from_verl_fields_then_the_softtrust_dict():
    config = actor_config(
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 4.0},
        softtrust={"eps_high": 0.25, "level": "sequence-mean"},
    )
    params, options = st_verl.method_settings("clip", config)
    assert params == {"eps_low": 0.1, "eps_high": 0.25, "dual_clip": 4.0}
    assert options == {"level": "sequence-mean"}
    assert st_verl.method_settings("cispo", config)[0] == {
        "ratio_low": pytest.approx(0.9),
        "ratio_high": pytest.approx(1.3),
        "eps_high": 0.25,
    }
    assert st_verl.method_settings("vespo", actor_config(softtrust={"k_pos": 2.5}))[0] == {"k_pos": 2.5}


def test_bad_settings_fail_with_a_clear_message():
    weights = None
    gmpo = get_policy_loss_fn("softtrust.gmpo")
    asymmetric = actor_config({"clip_ratio_low": 0.2, "clip_ratio_high": 0.3})
    with pytest.raises(ValueError, match="clip_ratio_low=0.2 != clip_ratio_high=0.3"):
        run(gmpo, "token-mean", asymmetric, weights)
    run(
        gmpo,
        "token-mean",
        actor_config({"clip_ratio_low": 0.2, "clip_ratio_high": 0.3}, softtrust={"eps": 0.4}),
        None,
    )
    with pytest.raises(ValueError, match="k_pos"):
        run(get_policy_loss_fn("softtrust.clip"), "token-mean", actor_config(softtrust={"k_pos": 1.0}), None)
    with pytest.raises(ValueError, match="dp_size=2"):
        run(
            get_policy_loss_fn("softtrust.clip"), "token-mean", actor_config(global_info={"dp_size": 2}), None
        )
    with pytest.raises(ValueError, match="config"):
        get_policy_loss_fn("softtrust.clip")(
            INPUTS["old"], INPUTS["logprobs"], INPUTS["advantages"], INPUTS["mask"]
        )


def test_wrong_verl_version_registers_refusing_losses_and_warns(monkeypatch):
    monkeypatch.setattr(verl, "__version__", "0.8.0")
    with pytest.warns(RuntimeWarning, match="verl 0.8.0 is installed"):
        names = st_verl.register()
    assert names == st_verl.REGISTERED  # every name, none half-registered
    with pytest.raises(RuntimeError, match=r"support verl 0\.9\.1, but verl 0\.8\.0"):
        run(get_policy_loss_fn("softtrust.vespo"), "token-mean", actor_config(), None)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st_verl.register()  # the supported version restores the real losses
    run(get_policy_loss_fn("softtrust.vespo"), "token-mean", actor_config(), None)


def test_metrics_are_floats_from_tensors_or_floats():
    assert st_verl._metric_value(torch.tensor(0.25)) == 0.25
    assert st_verl._metric_value(0.5) == 0.5


def test_hydra_override_example_from_the_docs():
    """The override lines of docs/verl.md compose with verl's own config and give a SoftTrustPolicyLossConfig."""
    block = (Path(__file__).parents[1] / "docs" / "verl.md").read_text().split("```")[1]
    overrides = [
        line.strip().rstrip("\\").strip().strip("'")
        for line in block.splitlines()[1:]
        if "=" in line and "main_ppo" not in line
    ]
    assert any("_target_" in line for line in overrides)
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, st_verl.SoftTrustPolicyLossConfig)
    assert actor.policy_loss.loss_mode == "softtrust.vespo"
    params, options = st_verl.method_settings("vespo", actor)
    assert params == {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
    assert options["rollout_is"] == "token"
    get_policy_loss_fn(actor.policy_loss.loss_mode)  # registered under that name


@pytest.mark.numerics
def test_verl_ppo_loss_step_with_softtrust_vespo():
    """verl's own actor loss step (workers.utils.losses.ppo_loss, what the FSDP engine calls per
    micro-batch) with loss_mode=softtrust.vespo: global_batch_info comes from the batch, the
    log-probs from the model's flat (unpadded) output, and loss and gradient equal PolicyLoss."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    gen = torch.Generator().manual_seed(0)
    B, P, T = 3, 3, 5
    lengths = [5, 3, 4]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    logp = -2 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 0.7], dtype=torch.float64)
    # the model's output: one flat row of prompt + response log-probs, responses shifted by one
    segments = []
    for i, n in enumerate(lengths):
        segment = -torch.rand(P + n, generator=gen, dtype=torch.float64)
        segment[P - 1 : P - 1 + n] = logp[i, :n]
        segments.append(segment)
    flat = torch.cat(segments).requires_grad_(True)
    data = tu.get_tensordict(
        tensor_dict={
            "prompts": torch.ones(B, P, dtype=torch.long),
            "responses": torch.ones(B, T, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], dim=1),
            "response_mask": mask.long(),
            "old_log_probs": old,
            "advantages": advantages[:, None] * mask,
        },
        non_tensor_dict={"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": B},
    )
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=st_verl.SoftTrustPolicyLossConfig(loss_mode="softtrust.vespo"),
    )
    loss, metrics = ppo_loss(config, {"log_probs": flat}, data)
    (flat_grad,) = torch.autograd.grad(loss, flat)
    leaf = logp.clone().requires_grad_(True)
    expected = st.PolicyLoss("vespo")(leaf, old, advantages, mask)
    (expected_grad,) = torch.autograd.grad(expected.loss, leaf)
    assert loss.item() == pytest.approx(expected.loss.item(), abs=F64_PARITY)  # float64, another layout
    offset = 0
    for i, n in enumerate(lengths):
        torch.testing.assert_close(
            flat_grad[offset + P - 1 : offset + P - 1 + n],
            expected_grad[i, :n],
            atol=F64_PARITY,
            rtol=F64_PARITY,
        )
        offset += P + n
    assert "actor/softtrust/phi/mean" in metrics and "actor/pg_loss" in metrics


def test_a_loss_that_cannot_be_built_refuses_every_name_and_warns(monkeypatch):
    def broken(method):
        raise ValueError(f"cannot build {method}")

    monkeypatch.setattr(st_verl, "policy_loss_fn", broken)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert st_verl.register() == st_verl.REGISTERED
    with pytest.raises(RuntimeError, match="cannot build"):
        run(get_policy_loss_fn("softtrust.clip"), "token-mean", actor_config(), None)
    monkeypatch.undo()
    st_verl.register()
    run(get_policy_loss_fn("softtrust.clip"), "token-mean", actor_config(), None)


def test_a_verl_of_another_layout_warns_at_load(tmp_path):
    """A verl without 0.9.1's modules: a warning naming both versions, then the ImportError (no registry)."""
    (tmp_path / "verl").mkdir()
    (tmp_path / "verl" / "__init__.py").write_text('__version__ = "0.7.0"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    code = "import softtrust.integrations.verl"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.returncode != 0
    assert "support verl 0.9.1, but verl 0.7.0 is installed" in out.stderr
    assert "RuntimeWarning" in out.stderr


@pytest.mark.numerics
def test_rejected_weights_stay_zero_with_a_small_log_ratio_clamp():
    """IcePop's zero weights are exact zeros also when log_ratio_clamp is small (e^-5 is not 1e-8)."""
    (case,) = [
        c
        for c in DATA["cases"]
        if c["peer"] == "verl:vanilla"
        and c["softtrust"]["aggregation"] == "token-mean"
        and not c["verl"]["global_batch_info"]
        and (c["softtrust"]["correction"] or {}).get("kind") == "MIS"
    ]
    weights = verl_weights(case["softtrust"]["correction"])
    assert (weights[INPUTS["mask"]] == 0).any()  # the case really rejects tokens
    config = actor_config(case["verl"]["fields"], softtrust={"log_ratio_clamp": 5.0})
    loss, grad, _ = run(get_policy_loss_fn("softtrust.clip"), "token-mean", config, weights)
    expected_grad = torch.tensor(case["grad"], dtype=torch.float64)
    assert loss.item() == pytest.approx(case["loss"], abs=F64_PARITY, rel=VERL_EPSILON)  # as above
    torch.testing.assert_close(grad, expected_grad, atol=F64_PARITY, rtol=VERL_EPSILON)


def test_token_weights_enter_as_the_methods_engine_token_weights_says(monkeypatch):
    """verl.py reads ``engine_token_weights`` from the method class, not a list of names: declared
    ``"geometric-mean"`` on Clip, token weights w act as the per-sequence weight exp(mean_t log w_t)
    repeated on every token (what ``"per-token"`` makes of that repeated weight), and differ from
    Clip's own per-token reading. Fails if verl.py keys the rule on a method name (GMPO's)."""
    config = actor_config({"clip_ratio_low": 0.2, "clip_ratio_high": 0.2})
    mask = INPUTS["mask"]
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    weights = torch.exp(0.3 * noise) * mask
    log_w = torch.where(mask, torch.log(weights + st_verl.GEO_MEAN_EPS), 0.0)
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    geometric = torch.exp(log_w.sum(-1, keepdim=True) / count) * mask  # [B, T]
    clip = get_policy_loss_fn("softtrust.clip")
    per_token = run(clip, "token-mean", config, weights)
    repeated = run(clip, "token-mean", config, geometric)
    monkeypatch.setattr(st.Clip, "engine_token_weights", "geometric-mean")
    as_geometric_mean = run(clip, "token-mean", config, weights)
    torch.testing.assert_close(as_geometric_mean[0], repeated[0], rtol=F64_PARITY, atol=F64_PARITY)
    torch.testing.assert_close(as_geometric_mean[1], repeated[1], rtol=F64_PARITY, atol=F64_PARITY)
    assert not torch.allclose(per_token[0], as_geometric_mean[0])


@pytest.mark.parametrize("bad", [float("nan"), -0.5, float("inf")], ids=["nan", "negative", "inf"])
@pytest.mark.parametrize("method", ["clip", "vespo"])
def test_an_invalid_rollout_is_weight_is_an_error_naming_rollout_is_weights(method, bad):
    """A NaN or negative weight became weight 0 (its tokens dropped, the loss finite); an inf one
    gave an error naming ``rollout_logprobs``, which verl users never pass."""
    mask = INPUTS["mask"]
    weights = torch.ones(mask.shape, dtype=torch.float64)
    row, column = (index[0].item() for index in mask.nonzero(as_tuple=True))
    weights[row, column] = bad
    config = actor_config(softtrust={"rollout_is": "token"})
    with pytest.raises(ValueError, match=r"rollout_is_weights must be finite and >= 0 at active") as error:
        run(get_policy_loss_fn(f"softtrust.{method}"), "token-mean", config, weights)
    assert "rollout_logprobs" not in str(error.value) and f"at index {(row, column)}" in str(error.value)
    # at a masked position any value is ignored, as every masked input is
    masked = torch.where(mask, 1.0, float("nan")).double()
    loss, grad, _ = run(get_policy_loss_fn(f"softtrust.{method}"), "token-mean", config, masked)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_errors_inside_the_loss_name_the_arguments_verl_passed():
    """A bad input is reported with verl's names (old_log_prob, response_mask), not softtrust's."""
    clip = get_policy_loss_fn("softtrust.clip")
    with pytest.raises(ValueError, match=r"^softtrust\.clip: old_log_prob must have shape") as error:
        run(clip, "token-mean", actor_config(), None, old=INPUTS["old"][:, :-1])
    assert "old_logprobs" not in str(error.value)
    with pytest.raises(ValueError, match=r"^softtrust\.clip: response_mask must be bool or contain only 0"):
        run(clip, "token-mean", actor_config(), None, mask=INPUTS["mask"].double() * 2)
    assert st_verl.in_verl_terms("logprobs and old_logprobs, mask (unmasked)") == (
        "log_prob and old_log_prob, response_mask (unmasked)"
    )


def test_verl_bypass_mode_takes_the_sampler_logprobs_as_old_and_replaces_a_softtrust_loss_mode():
    """What docs/verl.md and docs/training.md say of verl's bypass mode (softtrust's
    ``--old-logprobs sampler``), checked against verl 0.9.1 itself: ``apply_bypass_mode`` makes
    ``old_log_probs`` the rollout's log-probs and rewrites ``loss_mode`` to its own ``bypass_mode``
    loss, so a ``softtrust.*`` mode does not run under ``rollout_correction.bypass_mode=true``."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    sampler = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    batch = DataProto.from_dict(tensors={"rollout_log_probs": sampler})
    policy_loss = OmegaConf.create({"loss_mode": st_verl.loss_mode("vespo")})
    apply_bypass_mode(batch, RolloutCorrectionConfig.bypass_ppo_clip(), policy_loss)
    assert torch.equal(batch.batch["old_log_probs"], sampler)
    assert policy_loss.loss_mode == "bypass_mode"
