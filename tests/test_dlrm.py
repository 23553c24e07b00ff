"""DLRM parts against brute-force references; dense parameters via torch, embeddings via the EBC."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embstore.errors import InvalidInputError
from embstore.training import TieredEmbeddingBagCollection
from embstore.training.dlrm import (DLRM, InteractionArch, InteractionDCNArch, MLP, OverArch, dense_optimizer)
from embstore.training.testing import make_store

TIERS = '[{ kind = "dram", capacity = "1MiB" }, { kind = "mmap" }]'


def test_interaction_is_upper_triangle_of_pairwise_dots():
    torch.manual_seed(0)
    d, e = torch.randn(3, 4), torch.randn(3, 2, 4)
    out = InteractionArch(2)(d, e)
    x = [d, e[:, 0], e[:, 1]]
    ref = torch.stack([(x[i] * x[j]).sum(1) for i in range(3) for j in range(i + 1, 3)], dim=1)
    assert out.shape == (3, 4 + 3)
    torch.testing.assert_close(out, torch.cat([d, ref], dim=1))


@pytest.mark.parametrize("low_rank", [0, 3])
def test_dcn_cross_layers_match_the_formula(low_rank):
    torch.manual_seed(1)
    arch = InteractionDCNArch(2, 4, num_layers=2, low_rank=low_rank)
    d, e = torch.randn(5, 4), torch.randn(5, 2, 4)
    x0 = torch.cat([d, e[:, 0], e[:, 1]], dim=1)
    x = x0
    for i in range(2):
        w = arch.U[i](arch.V[i](x)) if low_rank else arch.W[i](x)
        x = x0 * w + x
    torch.testing.assert_close(arch(d, e), x)
    assert arch.output_dim(4) == 12
    n_params = sum(p.numel() for p in arch.parameters())
    assert n_params == (2 * (12 * 3 + 3 * 12 + 12) if low_rank else 2 * (144 + 12))


def test_mlp_shapes_and_validation():
    m = MLP(5, [7, 3])
    assert [type(x).__name__ for x in m] == ["Linear", "ReLU", "Linear", "ReLU"]
    assert OverArch(3, [4, 1])(torch.randn(6, 3)).shape == (6,)
    with pytest.raises(InvalidInputError, match="one logit"):
        OverArch(3, [4, 2])
    with pytest.raises(InvalidInputError, match="layer widths"):
        MLP(3, [])


def small_dlrm(tmp_path, interaction="dot"):
    store = make_store(tmp_path / "s", [("a", 50, 4), ("b", 30, 4)], TIERS)
    ebc = TieredEmbeddingBagCollection(store, ["a", "b"], optimizer="sgd", lr=0.5)
    torch.manual_seed(0)
    return store, DLRM(ebc, 2, 4, 3, [8, 4], [8, 1], interaction=interaction)


def test_dense_arch_must_end_in_embedding_dim(tmp_path):
    store = make_store(tmp_path / "s", [("a", 10, 4)], TIERS)
    ebc = TieredEmbeddingBagCollection(store, ["a"])
    with pytest.raises(InvalidInputError, match="embedding dim"):
        DLRM(ebc, 1, 4, 3, [8, 5], [8, 1])
    with pytest.raises(InvalidInputError, match="interaction"):
        DLRM(ebc, 1, 4, 3, [8, 4], [8, 1], interaction="cat")


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_one_step_updates_dense_by_torch_and_rows_by_the_ebc(tmp_path, interaction):
    store, model = small_dlrm(tmp_path, interaction)
    params = model.dense_parameters()
    assert len(params) == len(list(model.parameters())) > 0
    before_dense = [p.detach().clone() for p in params]
    before_rows = store["a"].lookup(np.arange(50, dtype=np.int64)).copy()
    opt = dense_optimizer("adagrad", params, 0.1)
    ids = [torch.tensor([1, 2, 2, 7]), torch.tensor([3, 4])]
    offs = [torch.tensor([0, 2, 4]), torch.tensor([0, 1, 2])]
    dense, y = torch.randn(2, 3), torch.tensor([1.0, 0.0])
    # reference gradient for the rows: the same forward on a plain tensor copy of the rows
    a_rows = torch.from_numpy(before_rows).requires_grad_()
    b_rows = torch.from_numpy(store["b"].lookup(np.arange(30, dtype=np.int64)).copy()).requires_grad_()
    ref = [F.embedding_bag(ids[0], a_rows, offs[0], include_last_offset=True, mode="sum"),
           F.embedding_bag(ids[1], b_rows, offs[1], include_last_offset=True, mode="sum")]
    d = model.dense_arch(dense)
    z = model.over_arch(model.inter_arch(d, torch.stack(ref, dim=1)))
    F.binary_cross_entropy_with_logits(z, y).backward()
    model.zero_grad()

    logits = model(dense, ids, offs)
    torch.testing.assert_close(logits, z.detach())
    F.binary_cross_entropy_with_logits(logits, y).backward()
    opt.step()
    model.sparse_arch.ebc.flush()
    after_rows = store["a"].lookup(np.arange(50, dtype=np.int64))
    np.testing.assert_allclose(after_rows, before_rows - 0.5 * a_rows.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert not np.array_equal(after_rows[[1, 2, 7]], before_rows[[1, 2, 7]])
    assert any(not torch.equal(p, q) for p, q in zip(params, before_dense))


def test_malformed_dense_input_is_a_typed_error(tmp_path):
    """Wrong dense shapes, dtypes or a batch that disagrees with the bags: InvalidInputError, not torch's
    shape errors from deep inside the MLP or the interaction."""
    _, model = small_dlrm(tmp_path, "dot")
    ids = [torch.tensor([1, 2, 2, 7]), torch.tensor([3, 4])]
    offs = [torch.tensor([0, 2, 4]), torch.tensor([0, 1, 2])]
    assert model(torch.randn(2, 3), ids, offs).shape == (2,)
    for dense in (torch.randn(3, 3), torch.randn(2, 5), torch.randn(2), torch.ones(2, 3, dtype=torch.int64),
                  torch.randn(2, 3, dtype=torch.float64), np.zeros((2, 3), np.float32)):
        with pytest.raises(InvalidInputError, match="dense"):
            model(dense, ids, offs)
    assert model(torch.randn(2, 3), ids, offs).shape == (2,)  # a refused batch leaves nothing behind


def test_dense_optimizer_names():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(dense_optimizer("adam", p, 0.1), torch.optim.Adam)
    with pytest.raises(InvalidInputError, match="dense optimizer"):
        dense_optimizer("lamb", p, 0.1)
