"""SGLang's HiCache storage backends as a flexflow deep tier, with real servers (tiny model, CPU):
two servers share KV through a Mooncake Store (master on loopback, TCP): the second server's first
request of each prompt loads what the first computed from the store, outputs identical to a plain
server's. Then the master is killed mid-run: misses, no hang, identical outputs; and it comes back:
the store is written and read again. Structure and helpers as test_deeper_tiers_server.py."""

import time

import pytest

from server_helpers import (MAX_TOTAL_TOKENS, PROMPTS, flexflow_metrics, verify, wait_transfers_settled,
                            write_config)
from test_deeper_tiers_server import _offloaded

from flexflow_sglang.tools.server_utils import generate

pytestmark = [pytest.mark.server]


def _mooncake_master(tmp_path):
    from mooncake_fixture import MooncakeMaster, need_mooncake
    need_mooncake()
    return MooncakeMaster(tmp_path).start()


def _wait_store_writable(url, label, timeout_s=180.0) -> bool:
    """Send throwaway prompts to the server until one of them is written to the store (its tier's
    pages_written grows): its Mooncake client is connected to the master again."""
    written = _tier_metric(wait_transfers_settled(url), "pages_written")
    deadline, i = time.time() + timeout_s, 0
    while time.time() < deadline:
        generate(url, " ".join([f"{label} probe {i} waits for the store after the master restart"] * 5), 2)
        if _tier_metric(wait_transfers_settled(url), "pages_written") > written:
            return True
        i += 1
        time.sleep(2)
    return False


def _tier_metric(m, name):
    """A deep-tier counter of the mooncake tier from /metrics (summed over ranks)."""
    return m.get(f"flexflow_deeper_tiers_hicache_mooncake_{name}", 0)


@pytest.mark.timeout(1800)  # plain baseline (session fixture) + two servers + three verify runs on two cores
def test_two_servers_share_kv_through_mooncake(plain_baseline, tiny_model, start_server, tmp_path):
    master = _mooncake_master(tmp_path)
    try:
        # wait_complete: a fresh server holds each request until its prefetch from the store ended
        # (as test_storage_tier_survives_restart: this test is about sharing, not fetch deadlines)
        cfg = write_config(tmp_path, "mooncake",
                           hicache_storage={"enabled": True, "backend": "mooncake", "timeout_ms": 5000,
                                            "retry_after_s": 2, "extra_config": master.extra_config(128)},
                           transfer={"prefetch_policy": "wait_complete"})
        a = start_server(tiny_model, name="mooncake-a", radix_cache_backend="flexflow", flexflow_config=cfg,
                         max_total_tokens=MAX_TOTAL_TOKENS, extra_args=["--enable-metrics"])
        rc, stdout, stderr, last = verify("--phase", "test", "--url", a.url, "--prompts", PROMPTS,
                                          "--baseline", plain_baseline)
        assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + a.tail_log()
        m = wait_transfers_settled(a.url)
        assert _tier_metric(m, "pages_written") > 0, {k: v for k, v in m.items() if "deeper" in k}
        # A stays up: its Mooncake client holds a segment of the store (objects live in clients' segments)
        b = start_server(tiny_model, name="mooncake-b", radix_cache_backend="flexflow", flexflow_config=cfg,
                         max_total_tokens=MAX_TOTAL_TOKENS, extra_args=["--enable-metrics"])
        rc, stdout, stderr, last = verify("--phase", "test", "--url", b.url, "--prompts", PROMPTS,
                                          "--baseline", plain_baseline)
        assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + b.tail_log()
        _, deep_r1 = _offloaded(stdout, "R1")
        mb = flexflow_metrics(b.url, until=lambda mm: _tier_metric(mm, "hits") > 0)
        # B's FIRST request per prompt was served from what A put in the store
        assert sum(1 for s in deep_r1 if s > 0) >= len(deep_r1) // 2, \
            stdout + str({k: v for k, v in mb.items() if "deeper" in k or "prefetch" in k})
        assert _tier_metric(mb, "hits") > 0 and _tier_metric(mb, "corrupt_dropped") == 0

        # the master dies mid-run: the tier misses (no hang), B still serves identical outputs
        master.kill()
        t0 = time.time()
        rc, stdout, stderr, last = verify("--phase", "test", "--url", b.url, "--prompts", PROMPTS,
                                          "--baseline", plain_baseline)
        took = time.time() - t0
        assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + b.tail_log()
        # B's host tier holds every page of PROMPTS (their write-throughs all landed before the kill),
        # so that verify may not touch the store at all; a prompt B has not seen makes new pages, whose
        # write-through must now fail as an error or a timeout, and the request is still answered
        dead = generate(b.url, " ".join(["while the store master is down a new page is written through"] * 5), 8)
        assert dead["meta_info"]["completion_tokens"] > 0, dead
        md = flexflow_metrics(b.url, until=lambda mm: _tier_metric(mm, "backend_errors") + _tier_metric(mm, "timeouts") > 0,
                              timeout=30.0)
        assert _tier_metric(md, "backend_errors") + _tier_metric(md, "timeouts") > 0, \
            {k: v for k, v in md.items() if "deeper" in k}
        assert took < 600, f"verify against a dead master took {took:.0f} s"

        # the master comes back (empty metadata): after retry_after_s the tiers use the store again; a
        # prompt neither server has seen, computed on B, is a deep-tier hit on A (B's own prompts are
        # already in its host tier: their pages are not written twice)
        master.start()
        time.sleep(3)
        # Each Mooncake client reconnects on its own schedule (after 4 failed pings, seconds apart):
        # an idle server can take tens of seconds. Wait until A writes to the store again (CI once
        # asked A right after B's write, while A's client was still disconnected: put -900).
        assert _wait_store_writable(a.url, "A"), "server A's Mooncake client did not reconnect"
        # A prompt neither server has seen, computed on B and written to the store, then asked on A. A
        # tier that met an error while its client reconnected backs off for retry_after_s and misses:
        # a few fresh prompts, seconds apart, give it that time; one of them must be a store hit on A.
        deadline, i, on_a, again, fresh, mr, ma = time.time() + 180, 0, None, None, None, {}, {}
        while time.time() < deadline:
            written = _tier_metric(wait_transfers_settled(b.url), "pages_written")
            text = " ".join([f"after restart {i} the radix cache keeps every prefix page of the model"] * 5)
            i += 1
            fresh = generate(b.url, text, 8)
            mr = wait_transfers_settled(b.url)
            if _tier_metric(mr, "pages_written") <= written:
                time.sleep(1)
                continue
            again = generate(b.url, text, 8)                     # B: a device hit
            on_a = generate(a.url, text, 8)                      # A: loaded from the store
            if int((on_a["meta_info"].get("cached_tokens_details") or {}).get("storage") or 0) > 0:
                break
            ma = flexflow_metrics(a.url)
            time.sleep(3)
        assert on_a is not None, ("B never wrote to the store again", {k: v for k, v in mr.items() if "deeper" in k})
        det = on_a["meta_info"].get("cached_tokens_details") or {}
        assert int(det.get("storage") or 0) > 0, (i, on_a["meta_info"], fresh["meta_info"],
                                                  {k: v for k, v in ma.items() if "deeper" in k or "prefetch" in k})
        if on_a["meta_info"]["cached_tokens"] == again["meta_info"]["cached_tokens"]:
            assert on_a["output_ids"] == again["output_ids"]
    finally:
        master.kill()


def test_unreachable_store_is_one_line_and_the_server_serves(plain_baseline, tiny_model, start_server, tmp_path):
    """hicache_storage names a master nobody runs: the tier is left out with one log line at start,
    and the server serves identical outputs from its host tier."""
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    cfg = write_config(tmp_path, "nomaster",
                       hicache_storage={"enabled": True, "backend": "mooncake",
                                        "extra_config": {"master_server_address": "127.0.0.1:9", "protocol": "tcp"}})
    srv = start_server(tiny_model, name="nomaster", radix_cache_backend="flexflow", flexflow_config=cfg,
                       max_total_tokens=MAX_TOTAL_TOKENS)
    rc, stdout, stderr, last = verify("--phase", "test", "--url", srv.url, "--prompts", PROMPTS,
                                      "--baseline", plain_baseline)
    assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + srv.tail_log()
    with open(srv.log_path, errors="replace") as f:
        log = f.read()
    lines = [ln for ln in log.splitlines() if "deep tier 'hicache_storage' left out" in ln]
    assert len(lines) == 1 and "mooncake" in lines[0], log[-3000:]
