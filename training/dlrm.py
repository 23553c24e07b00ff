"""DLRM from small parts, as TorchRec builds it.

::

    dense (B, F_dense) ──DenseArch (bottom MLP)──▶ d (B, D) ─────────────┐
    ids/offsets per table ──SparseArch (tiered EBC)──▶ e (B, T, D) ──────┤
                                                                         ▼
                        InteractionArch: [d, upper-triangle of <x_i, x_j> over x = (d, e_1..e_T)]
                     or InteractionDCNArch: DCNv2 cross layers over concat(d, e_1..e_T)
                                                                         │
                                                  OverArch (top MLP) ──▶ one logit per sample

The dense parameters (every ``nn.Parameter`` here) train with an ordinary
torch optimizer; the embedding rows live in the store and are updated by the
EBC's fused optimizer inside ``backward`` (the EBC owns no parameters).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from embstore.errors import InvalidInputError

DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")


def _check_sizes(name: str, sizes: Sequence[int]) -> list[int]:
    out = list(sizes)
    if not out or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in out):
        raise InvalidInputError(f"{name} must be a non-empty list of positive ints (layer widths), got {sizes!r}")
    return out


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (and after the last one unless ``last_activation`` is False)."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int], last_activation: bool = True) -> None:
        sizes = _check_sizes("layer_sizes", layer_sizes)
        layers: list[nn.Module] = []
        for i, out in enumerate(sizes):
            layers.append(nn.Linear(in_features, out))
            if last_activation or i < len(sizes) - 1:
                layers.append(nn.ReLU())
            in_features = out
        super().__init__(*layers)


class DenseArch(nn.Module):
    """Bottom MLP: dense features (B, F) -> (B, D), D = the embedding dim so it can interact with the bags."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int]) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.model(dense)


class SparseArch(nn.Module):
    """The embedding bags: any module mapping (ids, offsets) to (B, T, D), e.g. a TieredEmbeddingBagCollection."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, ids: Any, offsets: Any) -> torch.Tensor:
        return self.ebc(ids, offsets)


class InteractionArch(nn.Module):
    """Pairwise dot products of (d, e_1..e_T), strictly upper triangle, after d: (B, D + (T+1)T/2)."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        f = num_sparse_features + 1
        rows, cols = torch.triu_indices(f, f, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def output_dim(self, dim: int) -> int:
        return dim + len(self.rows)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # (B, T+1, D)
        dots = torch.bmm(x, x.transpose(1, 2))  # (B, T+1, T+1)
        return torch.cat([dense, dots[:, self.rows, self.cols]], dim=1)


class InteractionDCNArch(nn.Module):
    """DCNv2 cross network over x0 = concat(d, e_1..e_T): x_{l+1} = x0 * (W_l x_l + b_l) + x_l.

    ``low_rank`` r > 0 factors each W_l = U_l V_l (the paper's low-rank mixture with
    one expert), cutting parameters from (F*D)^2 to 2*F*D*r per layer.
    """

    def __init__(self, num_sparse_features: int, dim: int, num_layers: int = 3, low_rank: int = 0) -> None:
        super().__init__()
        if num_layers < 1:
            raise InvalidInputError(f"dcn num_layers must be >= 1, got {num_layers}")
        if low_rank < 0:
            raise InvalidInputError(f"dcn low_rank must be >= 0 (0 = full rank), got {low_rank}")
        n = (num_sparse_features + 1) * dim
        self.width = n
        if low_rank:
            self.V = nn.ModuleList(nn.Linear(n, low_rank, bias=False) for _ in range(num_layers))
            self.U = nn.ModuleList(nn.Linear(low_rank, n) for _ in range(num_layers))
        else:
            self.W = nn.ModuleList(nn.Linear(n, n) for _ in range(num_layers))
        self.low_rank = low_rank
        self.num_layers = num_layers

    def output_dim(self, dim: int) -> int:
        return self.width

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense.unsqueeze(1), sparse], dim=1).flatten(1)
        x = x0
        for i in range(self.num_layers):
            wx = self.U[i](self.V[i](x)) if self.low_rank else self.W[i](x)
            x = x0 * wx + x
        return x


class OverArch(nn.Module):
    """Top MLP ending in one logit (no activation on the last layer)."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int]) -> None:
        super().__init__()
        sizes = _check_sizes("over_arch", layer_sizes)
        if sizes[-1] != 1:
            raise InvalidInputError(f"over_arch must end in 1 (one logit), got {sizes}")
        self.model = MLP(in_features, sizes, last_activation=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).squeeze(-1)


class DLRM(nn.Module):
    """Deep Learning Recommendation Model; ``forward(dense, ids, offsets)`` -> logits (B,)."""

    def __init__(self, ebc: nn.Module, num_tables: int, embedding_dim: int, dense_in_features: int,
                 dense_arch: Sequence[int], over_arch: Sequence[int], interaction: str = "dot",
                 dcn_layers: int = 3, dcn_low_rank: int = 0) -> None:
        super().__init__()
        dense_arch = _check_sizes("dense_arch", dense_arch)
        if dense_arch[-1] != embedding_dim:
            raise InvalidInputError(f"dense_arch must end in the embedding dim {embedding_dim} (the bottom MLP "
                                    f"output interacts with the bags), got {dense_arch}")
        self.dense_in_features = dense_in_features
        self.dense_arch = DenseArch(dense_in_features, dense_arch)
        self.sparse_arch = SparseArch(ebc)
        if interaction == "dot":
            self.inter_arch: nn.Module = InteractionArch(num_tables)
        elif interaction == "dcn":
            self.inter_arch = InteractionDCNArch(num_tables, embedding_dim, dcn_layers, dcn_low_rank)
        else:
            raise InvalidInputError(f"interaction must be 'dot' or 'dcn', got {interaction!r}")
        self.over_arch = OverArch(self.inter_arch.output_dim(embedding_dim), over_arch)

    def forward(self, dense: torch.Tensor, ids: Any, offsets: Any) -> torch.Tensor:
        if not (isinstance(dense, torch.Tensor) and dense.dtype == torch.float32 and dense.dim() == 2
                and dense.shape[1] == self.dense_in_features):
            got = f"{dense.dtype} of shape {tuple(dense.shape)}" if hasattr(dense, "shape") else type(dense).__name__
            raise InvalidInputError(f"dense must be a float32 tensor of shape (batch, {self.dense_in_features}), "
                                    f"got {got}")
        d = self.dense_arch(dense)
        e = self.sparse_arch(ids, offsets)
        if e.shape[0] != d.shape[0]:
            raise InvalidInputError(f"dense has {d.shape[0]} samples but the sparse features have {e.shape[0]} bags "
                                    "per table")
        return self.over_arch(self.inter_arch(d, e))

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every parameter outside the embedding bags (those the torch optimizer owns)."""
        skip = {id(p) for p in self.sparse_arch.parameters()}
        return [p for p in self.parameters() if id(p) not in skip]


def dense_optimizer(name: str, params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """A torch optimizer for the dense parameters by name."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise InvalidInputError(f"dense optimizer must be one of {', '.join(DENSE_OPTIMIZERS)}, got {name!r}")


__all__ = ["DENSE_OPTIMIZERS", "DLRM", "DenseArch", "InteractionArch", "InteractionDCNArch", "MLP", "OverArch",
           "SparseArch", "dense_optimizer"]
