"""A trained model is kept in its store and scores the same after reopening."""

from __future__ import annotations

import pytest
import torch

import embstore
from embstore.errors import InvalidInputError
from embstore.training.registry import list_models, load_model, predict
from embstore.training.trainer import Batches, train
from test_trainer import load


def test_trained_model_scores_from_its_store(tmp_path) -> None:
    cfg = load(tmp_path, batches=30)
    res = train(cfg, tmp_path / "run", progress=False)
    store_path = tmp_path / "run" / "store"
    assert list_models(store_path) == ["dlrm"]
    batch = next(Batches(cfg, 1).holdout())
    with embstore.open(store_path) as store:
        model = load_model(store, "dlrm")
        p1 = predict(model, batch.dense, batch.ids, batch.offsets)
        p2 = predict(model, batch.dense, batch.ids, batch.offsets)
        with pytest.raises(InvalidInputError, match="dense must have shape"):
            predict(model, batch.dense[:, :3], batch.ids, batch.offsets)
        with pytest.raises(InvalidInputError, match="no model 'other'"):
            load_model(store, "other")
    assert p1.shape == (batch.size,) and torch.equal(p1, p2)  # eval mode: scoring changes nothing
    assert ((p1 > 0) & (p1 < 1)).all()
    # the served model ranks held-out clicks as well as the training run's own evaluation did
    from embstore.training.metrics import evaluate

    ev = evaluate(batch.labels.numpy(), torch.logit(p1.double()).numpy())
    assert ev.auc > 0.7 and abs(ev.auc - res.evals[-1][1].auc) < 0.1
