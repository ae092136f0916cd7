"""The layouts of a batch of prompt groups: which rows share a prompt (`RowGroups`), and where the
trainer's shared-prefix pass puts each position (`Packing`). A leaf: the lean forward
(`recipe.model.lean`) and its compiled pieces (`recipe.model.compiled`) both read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Where `shared_prefix_logits` puts each position: the U groups' P prompt positions first,
    group after group, then the B rows' T-1 completion inputs, row after row (N in all)."""

    ids_N: torch.Tensor
    cos_N1D: torch.Tensor
    """Per packed position, its rotary cos (and below its signed sin, see `LeanLlama._rope`)."""
    sin_N1D: torch.Tensor
    groups: RowGroups
    num_groups: int
    prompt_len: int
    num_rows: int
    new_len: int
    """Completion inputs per row: T - 1."""

    @staticmethod
    def of(
        prompt_ids_BP: torch.Tensor, tokens_BT: torch.Tensor, groups: RowGroups, cos_1: torch.Tensor, sin_1: torch.Tensor
    ) -> Packing:
        """`cos_1`/`sin_1`: the rotary tables of positions 0..P+T-2 as the lean forward makes them
        (`LeanLlama._rope`, [1, 1, P+T-1, D])."""
        prompt_UP = prompt_ids_BP.index_select(0, groups.first_U)
        (num_groups, prompt_len), (num_rows, num_new) = prompt_UP.shape, tokens_BT.shape
        new_len, device = num_new - 1, tokens_BT.device
        ids_N = torch.cat([prompt_UP.reshape(-1), tokens_BT[:, :-1].reshape(-1)])
        positions = torch.cat(
            [
                torch.arange(prompt_len, device=device).repeat(num_groups),
                torch.arange(prompt_len, prompt_len + new_len, device=device).repeat(num_rows),
            ]
        )
        cos, sin = cos_1[0, 0].index_select(0, positions)[:, None], sin_1[0, 0].index_select(0, positions)[:, None]
        return Packing(ids_N, cos, sin, groups, num_groups, prompt_len, num_rows, new_len)

    @property
    def split(self) -> int:
        """The number of prompt positions (the completions' start)."""
        return self.num_groups * self.prompt_len

    def prompts(self, t: torch.Tensor) -> torch.Tensor:
        """[N, heads, D] -> the prompt positions as [U, heads, P, D]."""
        return t[: self.split].view(self.num_groups, self.prompt_len, *t.shape[1:]).transpose(1, 2)

    def completions(self, t: torch.Tensor) -> torch.Tensor:
        """[N, heads, D] -> the completion positions as [B, heads, T-1, D]."""
        return t[self.split :].view(self.num_rows, self.new_len, *t.shape[1:]).transpose(1, 2)

    @staticmethod
    def packed(t: torch.Tensor) -> torch.Tensor:
        """[rows, heads, length, D] -> [rows * length, heads * D]."""
        return t.transpose(1, 2).reshape(-1, t.shape[1] * t.shape[3])

    def completion_mask(self) -> torch.Tensor:
        """[T-1, P+T-1], True where a completion input sees: its prompt and the completion inputs
        up to itself."""
        device = self.ids_N.device
        queries = torch.arange(self.prompt_len, self.prompt_len + self.new_len, device=device)
        return torch.arange(self.prompt_len + self.new_len, device=device)[None, :] <= queries[:, None]

    def predicting(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden]: the positions whose logits predict the T tokens: each group's last prompt
        position (for every row of the group), then the row's completion inputs."""
        last_BD = self.groups.spread(hidden_ND[self.prompt_len - 1 : self.split : self.prompt_len])[:, None]
        completion_BTD = hidden_ND[self.split :].view(self.num_rows, self.new_len, hidden_ND.shape[-1])
        return torch.cat([last_BD, completion_BTD], dim=1)


@dataclass(frozen=True)
class RowGroups:
    """Rows that repeat the row before them, as a batch of prompt groups has them."""

    first_U: torch.Tensor
    """The first row of each run of equal rows."""
    rows_B: torch.Tensor
    """Per row, the index (into `first_U`) of its run."""
    size: int | None
    """The length of every run where they are all the same (a batch of groups), else None."""

    def spread(self, per_group: torch.Tensor) -> torch.Tensor:
        """`per_group` [U, ...] row by row [B, ...]: each row gets its run's (a broadcast copy for
        runs of one size, cheaper than the gather of `index_select` and with the same values)."""
        if self.size is None:
            return per_group.index_select(0, self.rows_B)
        num_groups, *rest = per_group.shape
        return per_group.unsqueeze(1).expand(num_groups, self.size, *rest).reshape(num_groups * self.size, *rest)

    @staticmethod
    def of(ids_BP: torch.Tensor) -> RowGroups | None:
        """The runs of equal consecutive rows of `ids_BP`; None when no row repeats the one before."""
        if ids_BP.shape[0] < 2:
            return None
        starts_B = torch.ones(ids_BP.shape[0], dtype=torch.bool, device=ids_BP.device)
        starts_B[1:] = (ids_BP[1:] != ids_BP[:-1]).any(dim=1)
        first_U = starts_B.nonzero().squeeze(1)
        if first_U.shape[0] == ids_BP.shape[0]:
            return None
        num_rows, num_groups = ids_BP.shape[0], first_U.shape[0]
        size = num_rows // num_groups
        evenly = torch.arange(0, num_rows, size, device=ids_BP.device)
        uniform = num_rows % num_groups == 0 and bool((first_U == evenly).all())
        return RowGroups(first_U, starts_B.cumsum(0) - 1, size if uniform else None)
