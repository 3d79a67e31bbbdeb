"""Rank agreement with real torch.distributed gloo groups: two processes, each with the real cache on
real pools, as two attention-TP ranks of one scheduler group. One rank is forced to miss or to fail a
load; both must end with the same result (and correct KV, and balanced invariants)."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.radix_cache")

pytestmark = pytest.mark.dist

WORLD = 2


def _worker(rank: int, tmp: str) -> None:
    import torch.distributed as dist

    import ffcache_env as E
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from flexflow_sglang.backend.rank_sync import RankSync

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    group = dist.new_group(list(range(WORLD)), backend="gloo")
    out = {}
    env = E.make_env(page_size=2, size=128, params_kw=dict(attn_tp_cache_group=group))
    try:
        tree, conn = env.tree, env.connector
        assert tree.rank_sync.active

        def evict_all():
            tree.evict(EvictParams(num_tokens=10**9))

        def record(name, served):
            out[name] = dict(host_hit=served.host_hit, loaded=served.loaded, prefix=served.prefix_len,
                             kv_ok=served.kv_ok, idle=env.idle_ok(), protected=tree.protected_size())

        # 1) both ranks hold the prefix: both load it
        a = list(range(100, 130))
        E.serve(env, "a", a)
        evict_all()
        record("both_hit", E.serve(env, "a2", a + [1, 2]))

        # 2) rank 1 lost the prefix (host eviction elsewhere): MIN -> both miss
        b = list(range(200, 230))
        E.serve(env, "b", b)
        evict_all()
        if rank == 1:
            conn.host.discard(conn.page_keys(b))
        record("one_rank_miss", E.serve(env, "b2", b + [1, 2]))

        # 3) rank 1 holds only the first half: both load the first half
        c = list(range(300, 330))
        E.serve(env, "c", c)
        evict_all()
        if rank == 1:
            conn.host.discard(conn.page_keys(c)[8:])
        record("partial", E.serve(env, "c2", c + [1, 2]))

        # 4) rank 1's load fails (checksum): both fall back to recomputation, slots freed on both
        d = list(range(400, 430))
        E.serve(env, "d", d)
        evict_all()
        if rank == 1:
            conn.host.words[conn.host.page_of(conn.page_keys(d)[3]), 0] ^= 1
        record("one_rank_load_fails", E.serve(env, "d2", d + [1, 2]))
        out["agreements"] = tree.metrics()["agreements"]

        # 5) PP forward: stage 0 reduces (alone here), stage 1 receives stage 0's value
        pp = RankSync(pp_group=group, pp_rank=rank, pp_size=WORLD)
        out["pp"] = pp.agree_min([rank + 5, 100 - rank])
        pp.close()
        dist.barrier(group=group)
    finally:
        env.close()
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()


def test_two_ranks_agree(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    for name in ("both_hit", "one_rank_miss", "partial", "one_rank_load_fails"):
        assert r0[name] == r1[name], (name, r0[name], r1[name])
        assert r0[name]["kv_ok"] and r0[name]["idle"] and r0[name]["protected"] == 0
    assert r0["both_hit"]["loaded"] == 30
    assert r0["one_rank_miss"]["host_hit"] == 0 and r0["one_rank_miss"]["prefix"] == 0
    assert r0["partial"]["host_hit"] == r0["partial"]["loaded"] == 16
    assert r0["one_rank_load_fails"]["host_hit"] == 30 and r0["one_rank_load_fails"]["loaded"] == 0
    assert r0["agreements"] == r1["agreements"] > 0
    assert r0["pp"] == [5, 100] and r1["pp"] == [5, 100]
