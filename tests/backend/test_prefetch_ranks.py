"""Prefetch readiness is agreed across ranks: two gloo processes as two attention-TP ranks, rank 1's
deep tier slow. Neither rank admits the queued request before both prefetches ended, both admit it
in the same scheduler tick and load the same prefix."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.radix_cache")

pytestmark = pytest.mark.dist

WORLD = 2


def _worker(rank: int, tmp: str) -> None:
    import threading
    import time

    import torch.distributed as dist

    import test_prefetch as T

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    group = dist.new_group(list(range(WORLD)), backend="gloo")
    out = {}
    env, tier = T.make(policy="wait_complete", params_kw=dict(attn_tp_cache_group=group))
    try:
        assert env.tree.rank_sync.active
        ids = list(range(500, 540))
        T.only_in_tier(env, tier, ids)
        if rank == 1:
            tier.gate.clear()
            threading.Timer(0.5, tier.gate.set).start()
        req = T.arrive(env, "b", ids + [1])
        ticks, t0 = 0, time.monotonic()
        while not T.admitted(env, req):  # every iteration ticks: one collective on both ranks
            ticks += 1
            time.sleep(0.01)
        out.update(ticks=ticks, waited=time.monotonic() - t0)
        r = T.E.serve(env, "b", ids + [1], req=req)
        out.update(loaded=r.loaded, kv_ok=r.kv_ok, idle=env.idle_ok())
        dist.barrier(group=group)
    finally:
        tier.gate.set()
        env.close()
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()


def test_ranks_admit_together(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    assert r0["ticks"] == r1["ticks"] > 0
    assert r0["waited"] >= 0.45  # rank 0's own fetch was quick; it waited for rank 1's
    assert r0["loaded"] == r1["loaded"] == 40 and r0["kv_ok"] and r1["kv_ok"] and r0["idle"] and r1["idle"]
