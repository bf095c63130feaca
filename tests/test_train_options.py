"""The trainer options of issue 35 on the main job: each runs a few steps on the micro model and
does what it says (self-normalised corrections, the adaptive KL controller, the entropy terms,
the advantage estimators)."""

from __future__ import annotations

import pytest
import torch

from softtrust.train.trainer import train
from test_train import micro_config, read_metrics, write_micro_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


@pytest.mark.parametrize("micro_batch_size", [0, 3])
def test_self_normalized_tis_weights_average_one_over_each_mini_batch(
    micro_model_dir, tmp_path, micro_batch_size
):
    config = micro_config(
        micro_model_dir,
        tmp_path / "run",
        method="clip",
        correction="tis:cap=2,self_normalize=true",
        mismatch="bf16",
        staleness=2,
        micro_batch_size=micro_batch_size,
    )
    train(config)
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 4 and all(m["skipped"] == 0 for m in metrics)
    for m in metrics:  # token-weighted over the micro-batches: the whole mini-batch's mean weight
        assert m["loss/is_weight/mean"] == pytest.approx(1.0, abs=1e-5)
    assert any(m["loss/is_weight/batch_mean"] != pytest.approx(1.0, abs=1e-7) for m in metrics)
