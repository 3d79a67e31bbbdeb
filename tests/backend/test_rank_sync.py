"""Rank agreement with real torch.distributed gloo groups: two processes, each with the real cache on
real pools, first as two attention-TP ranks of one scheduler group, then as two pipeline stages
(PP=2, each with its own shared-memory host tier). One rank is forced to miss or to fail a load;
both must end with the same result (and correct KV, balanced invariants, no pins left). For PP,
stage 1's missing or corrupt page makes stage 0 turn the hit into a miss before either allocates
(stage 0 checks and pins stage 1's pages in its tier: backend/pp_stages.py)."""

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

    os.environ["FLEXFLOW_SHM_DIR"] = tmp  # the stages' shared tiers live in the test's directory
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    group = dist.new_group(list(range(WORLD)), backend="gloo")
    out = {}
    try:
        out["tp"] = _scenarios(E, EvictParams, rank, E.make_env(page_size=2, size=128,
                                                                 params_kw=dict(attn_tp_cache_group=group)))
        out["pp"] = _scenarios(E, EvictParams, rank, _stage_env(E, rank, group))
        # PP forward: stage 0 reduces (alone here), stage 1 receives stage 0's value
        pp = RankSync(pp_group=group, pp_rank=rank, pp_size=WORLD)
        out["bare"] = pp.agree_min([rank + 5, 100 - rank])
        pp.close()
        dist.barrier(group=group)
    finally:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()


def _stage_env(E, rank, group):
    """E.make_env as PP stage `rank`: its own fingerprint and a shared host tier, as the factory
    builds it for --pp-size > 1."""
    from dataclasses import replace

    from flexflow_sglang.backend.cache import FlexFlowRadixCache
    from flexflow_sglang.connector import FlexFlowConnector, KVLayout

    kv, alloc, req_pool, params = E.make_pools(page_size=2, size=128,
                                               params_kw=dict(pp_cache_group=group, pp_rank=rank, pp_size=WORLD))
    cfg = E.test_config(2)
    cfg = replace(cfg, host_tier=replace(cfg.host_tier, shared=True))
    conn = FlexFlowConnector(KVLayout.from_pool(kv, 2), cfg, fingerprint={"test": True, "pp_rank": rank},
                             start_agent=False)
    return E.Env(FlexFlowRadixCache(params, connector=conn), kv, alloc, req_pool, 128, 2, conn)


def _scenarios(E, EvictParams, rank, env) -> dict:
    import torch.distributed as dist

    def barrier():
        # ranks only meet at agreements; in the real PP loop a later stage stores a request's pages
        # after stage 0 does, and stage 0 then (correctly) calls a hit on them a miss until it has
        dist.barrier()

    out = {}
    try:
        tree, conn = env.tree, env.connector
        assert tree.rank_sync.active

        def evict_all():
            tree.evict(EvictParams(num_tokens=10**9))

        def record(name, served):
            out[name] = dict(host_hit=served.host_hit, loaded=served.loaded, prefix=served.prefix_len,
                             kv_ok=served.kv_ok, idle=env.idle_ok(), protected=tree.protected_size(),
                             pins=conn.host.stats().get("pages_pinned_by_jobs", 0))

        # 1) both ranks hold the prefix: both load it
        a = list(range(100, 130))
        E.serve(env, "a", a)
        evict_all()
        barrier()  # the other rank has stored (and damaged) its pages too
        record("both_hit", E.serve(env, "a2", a + [1, 2]))

        # 2) rank 1 lost the prefix (host eviction elsewhere): MIN -> both miss
        b = list(range(200, 230))
        E.serve(env, "b", b)
        evict_all()
        if rank == 1:
            conn.host.discard(conn.page_keys(b))
        barrier()  # the other rank has stored (and damaged) its pages too
        record("one_rank_miss", E.serve(env, "b2", b + [1, 2]))

        # 3) rank 1 holds only the first half: both load the first half
        c = list(range(300, 330))
        E.serve(env, "c", c)
        evict_all()
        if rank == 1:
            conn.host.discard(conn.page_keys(c)[8:])
        barrier()  # the other rank has stored (and damaged) its pages too
        record("partial", E.serve(env, "c2", c + [1, 2]))

        # 4) rank 1's load fails (checksum): both fall back to recomputation, slots freed on both
        d = list(range(400, 430))
        E.serve(env, "d", d)
        evict_all()
        if rank == 1:
            conn.host.words[conn.host.page_of(conn.page_keys(d)[3]), 0] ^= 1
        barrier()  # the other rank has stored (and damaged) its pages too
        record("one_rank_load_fails", E.serve(env, "d2", d + [1, 2]))
        out["agreements"] = tree.metrics()["agreements"]
    finally:
        env.close()
    return out


def test_two_ranks_agree(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True, start_method="spawn")
    d0, d1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    for mode in ("tp", "pp"):  # the later rank / stage vetoes in both layouts
        r0, r1 = d0[mode], d1[mode]
        for name in ("both_hit", "one_rank_miss", "partial", "one_rank_load_fails"):
            assert r0[name] == r1[name], (mode, name, r0[name], r1[name])
            assert r0[name]["kv_ok"] and r0[name]["idle"] and r0[name]["protected"] == 0
            assert r0[name]["pins"] == 0, (mode, name)  # every pin stage 0 took was released
        assert r0["both_hit"]["loaded"] == 30, (mode, r0)
        assert r0["one_rank_load_fails"]["host_hit"] == 30 and r0["one_rank_load_fails"]["loaded"] == 0
        assert r0["agreements"] == r1["agreements"] > 0
    tp, pp = d0["tp"], d0["pp"]
    assert tp["one_rank_miss"]["host_hit"] == 0 and tp["one_rank_miss"]["prefix"] == 0
    assert tp["partial"]["host_hit"] == tp["partial"]["loaded"] == 16
    # PP: stage 0's hit length goes down the pipeline; stage 1's gap turns the load into a miss
    assert pp["one_rank_miss"]["host_hit"] == 30 and pp["one_rank_miss"]["loaded"] == 0
    assert pp["one_rank_miss"]["prefix"] == 0
    assert pp["partial"]["host_hit"] == 30 and pp["partial"]["loaded"] == 0
    assert d0["bare"] == [5, 100] and d1["bare"] == [5, 100]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("flexflow-kv-")]  # segments unlinked
