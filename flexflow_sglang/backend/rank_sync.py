"""Agreement across the ranks that schedule the same batch.

Every value that steers scheduling (host hit length, load success, completed store count) must be
identical on those ranks, or their batches diverge and the next collective hangs. As SGLang's
UnifiedRadixCache does: MIN over the attention-CP group, then the attention-TP group (gloo CPU
groups from CacheInitParams), on PP stage 0 only; later PP stages receive stage 0's result through
isend/recv down the pipeline (a blocking all-reduce over the PP group would deadlock against the
stages' pipelined send/recv). Never over the whole TP group when attention DP is on: replicas
schedule different requests.

Scheduler thread only, on every rank in the same call order. With world size 1 nothing is sent.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

#: point-to-point tag for the PP forward (SGLang's HiCache uses b"PpHi")
PP_SYNC_TAG = int.from_bytes(b"PpFf", byteorder="big")


def _size(group) -> int:
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


class RankSync:
    def __init__(self, attn_tp_group=None, attn_cp_group=None, pp_group=None, pp_rank: int = 0, pp_size: int = 1,
                 tp_group=None):
        groups = [g for g in (attn_cp_group, attn_tp_group) if _size(g) > 1]
        if not groups and attn_cp_group is None and attn_tp_group is None and _size(tp_group) > 1:
            groups = [tp_group]  # callers that only know the (attention) TP group
        self.groups = groups
        self.pp_group = pp_group if pp_size > 1 and _size(pp_group) > 1 else None
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self._works: List = []
        self.calls = 0

    @classmethod
    def from_params(cls, params) -> "RankSync":
        return cls(attn_tp_group=getattr(params, "attn_tp_cache_group", None),
                   attn_cp_group=getattr(params, "attn_cp_cache_group", None),
                   pp_group=getattr(params, "pp_cache_group", None),
                   pp_rank=getattr(params, "pp_rank", 0), pp_size=getattr(params, "pp_size", 1),
                   tp_group=getattr(params, "tp_cache_group", None))

    @property
    def active(self) -> bool:
        return bool(self.groups) or self.pp_group is not None

    def agree_min(self, values: Sequence[int]) -> List[int]:
        """Element-wise MIN of `values` over the scheduling ranks (identity when alone)."""
        if not self.active:
            return [int(v) for v in values]
        self.calls += 1
        self._drain()
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        if self.pp_rank == 0:
            for g in self.groups:
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=g)
        self._pp_forward(t)
        return t.tolist()

    def agree_all(self, ok: bool) -> bool:
        """True only if every rank says True."""
        return bool(self.agree_min([1 if ok else 0])[0])

    def _pp_forward(self, t: torch.Tensor) -> None:
        if self.pp_group is None:
            return
        if self.pp_rank > 0:
            torch.distributed.recv(t, group_src=self.pp_rank - 1, group=self.pp_group, tag=PP_SYNC_TAG)
        if self.pp_rank + 1 < self.pp_size:
            self._works.append(torch.distributed.isend(t.clone(), group_dst=self.pp_rank + 1, group=self.pp_group,
                                                       tag=PP_SYNC_TAG))

    def _drain(self) -> None:
        # the previous sends; waiting here bounds the list and applies back-pressure to a lagging stage
        for w in self._works:
            w.wait()
        self._works.clear()

    def close(self) -> None:
        self._drain()


def describe(sync: Optional[RankSync]) -> str:
    if sync is None or not sync.active:
        return "single rank"
    return f"MIN over {len(sync.groups)} group(s)" + (f", PP forward {sync.pp_rank}/{sync.pp_size}"
                                                      if sync.pp_group is not None else "")
