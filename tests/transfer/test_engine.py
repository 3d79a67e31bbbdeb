"""TransferEngine: routing (select -> reserve -> chunked legs -> release -> report) and the bounded
background job queue, on the real PathSelector and NodeAgent over mock topologies."""

from __future__ import annotations

import threading
import time

import pytest

from flexflow_sglang.monitor import NodeAgent
from flexflow_sglang.selector import PathSelector, SelectorConfig
from flexflow_sglang.topology import LinkType, NodeKind, Topology
from flexflow_sglang.transfer import Job, JobState, TransferEngine


def two_rail():
    t = Topology("two-rail")
    t.add_node("gpu0", NodeKind.GPU)
    t.add_node("cpu0", NodeKind.CPU)
    t.add_link("gpu0", "cpu0", LinkType.PCIE, 10.0)
    t.add_link("gpu0", "cpu0", LinkType.PCIE, 10.0)
    return t


@pytest.fixture
def eng():
    topo = two_rail()
    agent = NodeAgent(topo, source="mock")
    e = TransferEngine(PathSelector(topo, agent, SelectorConfig()), agent, chunk_bytes=4096, queue_bytes=1 << 20)
    yield e
    e.close()


def test_move_splits_chunks_releases_and_reports(eng):
    calls, seen_reserved = [], []
    reports = []
    orig = eng.agent.report_transfer
    eng.agent.report_transfer = lambda links, n, s, **kw: reports.append((tuple(links), n)) or orig(links, n, s, **kw)

    def leg(sub, u0, u1):
        calls.append((sub.type.value, u0, u1))
        seen_reserved.append(eng.agent.in_flight)

    st = eng.move("gpu0", "cpu0", 100, 1 << 20, leg)  # 100 MiB over two equal rails, chunks of 1 unit
    assert st.path_type == "SplitPath" and len(st.legs) == 2
    assert sum(b for _, b, _ in st.legs) == 100 << 20
    assert sorted((u0, u1) for _, u0, u1 in calls)[0] == (0, 1) and len(calls) == 100  # chunked
    assert {u for _, _, u in calls} >= {50, 100}  # shares meet at 50
    assert seen_reserved[0] == 2 and eng.agent.in_flight == 0  # both legs reserved, all released
    assert len(reports) == 2 and {n for _, n in reports} == {50 << 20}
    assert eng.bandwidth_by_type()["SplitPath"]["bytes"] == 100 << 20


def test_short_chunk_ends_the_move(eng):
    st = eng.move("gpu0", "cpu0", 10, 4096, lambda sub, u0, u1: 0 if u0 >= 3 else u1 - u0, chunked=True)
    assert st.nbytes == 3 * 4096  # the leading 3 units moved, nothing after the short chunk
    assert eng.agent.in_flight == 0


def test_failing_leg_releases_reservations(eng):
    def boom(sub, u0, u1):
        raise OSError("link gone")
    with pytest.raises(OSError):
        eng.move("gpu0", "cpu0", 10, 1 << 20, boom)
    assert eng.agent.in_flight == 0


def test_unrouted_move_still_runs(eng):
    got = []
    st = eng.move("nvme9", "cpu0", 4, 1024, lambda sub, u0, u1: got.append((sub, u0, u1)))
    assert got == [(None, 0, 4)] and st.path_type == "unrouted" and st.nbytes == 4 * 1024


def test_jobs_run_off_thread_in_priority_order(eng):
    eng.n_workers = 1
    gate = threading.Event()
    order, threads = [], set()
    started = threading.Event()
    assert eng.submit(Job("write_through", lambda j: started.set() or (gate.wait(5) and order.append("blocker"))))
    assert started.wait(5)  # the blocker occupies the worker; the rest queue behind it
    for k in ("write_through", "spill", "prefetch", "fetch"):
        assert eng.submit(Job(k, (lambda k: lambda j: order.append(k) or threads.add(threading.current_thread()))(k)))
    gate.set()
    assert eng.drain(5)
    done = eng.poll()
    assert len(done) == 5 and all(j.state == JobState.DONE for j in done)
    assert order == ["blocker", "fetch", "prefetch", "spill", "write_through"]
    assert threading.current_thread() not in threads


def test_write_backs_never_take_the_last_worker(eng):
    """Two workers, a write-back backlog on a slow link: the write-backs run one at a time and a
    prefetch queued after them starts while they are still blocked (the reserved worker)."""
    assert eng.n_workers == 2 and eng.writeback_limit == 1
    gate = threading.Event()
    started = []
    for i in range(3):
        assert eng.submit(Job("write_through", (lambda i: lambda j: started.append(i) or gate.wait(10))(i)))
    ran = threading.Event()
    pf = Job("prefetch", lambda j: ran.set())
    assert eng.submit(pf)
    assert ran.wait(5), "the prefetch waited behind the write-back backlog"
    # the prefetch's worker finishes its bookkeeping after ran.set(), and write-back 0's worker may
    # pop its job before calling it: wait for both, then look (the others stay queued while gated)
    assert pf.wait(5)
    deadline = time.monotonic() + 5
    while (not started or eng.stats()["running"] != 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started == [0] and eng.stats()["running"] == 1, (started, eng.stats())
    gate.set()
    assert eng.drain(10)
    assert sorted(started) == [0, 1, 2] and len(eng.poll()) == 4


def test_a_long_job_runs_queued_urgent_jobs_between_its_steps(eng):
    """Every worker busy (a write-back on a slow link, a prefetch reading piece after piece): a
    promotion queued meanwhile runs on the prefetch's worker at its next step (run_urgent), not after
    the prefetch ends; jobs that sort after the prefetch (a spill) still wait."""
    gate, wb_started, step, resume = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    assert eng.submit(Job("write_through", lambda j: wb_started.set() or gate.wait(10)))
    assert wb_started.wait(5)
    log = []

    def prefetch(j):
        log.append("piece 1")
        step.set()
        resume.wait(5)
        ran = eng.run_urgent("prefetch")
        log.append(f"piece 2 after {ran} urgent")
        return ran
    pf = Job("prefetch", prefetch)
    assert eng.submit(pf) and step.wait(5)
    assert eng.submit(Job("promote", lambda j: log.append("promote") or threading.current_thread().name,
                          bounded=False))
    assert eng.submit(Job("spill", lambda j: log.append("spill")))
    resume.set()
    assert pf.wait(5) and pf.result == 1
    assert log == ["piece 1", "promote", "piece 2 after 1 urgent"]
    gate.set()
    assert eng.drain(5) and log[-1] == "spill"
    done = {j.kind: j for j in eng.poll()}
    assert done["promote"].state == JobState.DONE and done["promote"].result.startswith(eng.name)
    assert eng.stats()["held_bytes"] == 0 and eng.stats()["running"] == 0


def test_a_write_back_pauses_between_pieces_while_a_prefetch_runs(eng):
    """yield_to_foreground: a write-back between two pieces waits while a prefetch runs on the other
    worker (the CPU goes to what a request waits on), runs queued fetches itself meanwhile, and goes
    on when the prefetch ends; with no foreground work it does not wait at all."""
    log, pf_started, pf_release = [], threading.Event(), threading.Event()
    assert eng.yield_to_foreground(1.0) < 0.05  # idle engine: no pause

    def prefetch(j):
        pf_started.set()
        pf_release.wait(5)
        log.append("prefetch done")

    def write_back(j):
        assert pf_started.wait(5)
        assert eng.submit(Job("fetch", lambda j2: log.append("fetch")))
        threading.Timer(0.3, pf_release.set).start()
        waited = eng.yield_to_foreground(5.0)
        log.append("piece 2")
        return waited

    assert eng.submit(Job("prefetch", prefetch)) and pf_started.wait(5)
    wb = Job("write_through", write_back)
    assert eng.submit(wb)
    assert wb.wait(10)
    assert 0.2 < wb.result < 4.0, wb.result
    assert log.index("prefetch done") < log.index("piece 2") and "fetch" in log
    assert eng.stats()["writeback_yields"] == 1 and eng.stats()["writeback_yield_ms"] >= 200


def test_a_write_back_pause_is_bounded(eng):
    release = threading.Event()
    assert eng.submit(Job("prefetch", lambda j: release.wait(5)))
    t0 = time.monotonic()
    eng.yield_to_foreground(0.2)  # the prefetch never ends in time: the write-back goes on anyway
    assert 0.15 < time.monotonic() - t0 < 2.0
    release.set()
    assert eng.drain(5)


def test_queued_foreground_count_follows_submits_pops_and_cancels(eng):
    """yield_to_foreground asks `_foreground_busy` on every check: it reads a count kept at push, pop
    and cancel instead of scanning the queue. The count must equal the scan at every step, and a
    foreground job of a kind the priority table does not know (sorted after write-backs) counts too."""
    gate = threading.Event()

    def scan():
        with eng._cv:
            return sum(e[2].kind != "spill" and e[2].kind != "write_through" for e in eng._heap), eng._queued_fg
    blockers = [Job("prefetch", lambda j: gate.wait(5)) for _ in range(eng.n_workers)]
    for b in blockers:  # every worker busy: what comes next stays queued
        assert eng.submit(b)
    deadline = time.monotonic() + 5
    while eng.stats()["running"] < eng.n_workers and time.monotonic() < deadline:
        time.sleep(0.01)
    for kind in ("write_through", "spill", "custom_copy", "fetch", "write_through"):
        assert eng.submit(Job(kind, lambda j: None))
        want, got = scan()
        assert got == want
    assert scan() == (2, 2)
    assert eng.cancel_queued({"fetch"}) == 1
    assert scan() == (1, 1)  # the unknown kind is still a foreground job behind two write-backs
    with eng._cv:
        assert eng._foreground_busy()
    gate.set()
    assert eng.drain(5)
    assert scan() == (0, 0)
    with eng._cv:
        assert not eng._foreground_busy()


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_of_jobs_run_between_a_write_backs_pieces_is_counted_once(eng):
    """run_urgent runs queued fetches on the write-back's own thread: their CPU belongs to the
    fetch's kind, not to the write-back's as well (the write-through CPU of a serving run looked
    several times what its writes cost)."""
    gate, started = threading.Event(), threading.Event()
    blockers = [Job("prefetch", lambda j: (started.set(), gate.wait(10))) for _ in range(eng.n_workers - 1)]
    for b in blockers:  # every other worker busy: only run_urgent can take the fetch
        assert eng.submit(b)
    assert not blockers or started.wait(5)
    fetch = Job("fetch", lambda j: _burn(0.2))

    def write_back(j):
        assert eng.submit(fetch)
        assert eng.run_urgent("prefetch") == 1  # the fetch ran here, inside this job
        _burn(0.05)
    wb = Job("write_through", write_back)
    assert eng.submit(wb) and wb.wait(10) and fetch.wait(1)
    gate.set()
    assert eng.drain(5)
    assert fetch.cpu_s >= 0.19
    assert 0.04 <= wb.cpu_s < 0.15, (wb.cpu_s, fetch.cpu_s)
    eng.poll()  # the per-kind counters are settled when the owner polls the finished jobs
    by = eng.stats()["by_kind"]
    assert by["write_through"]["cpu_ms"] < 150 <= by["fetch"]["cpu_ms"]


def test_full_queue_drops_never_blocks(eng):
    gate = threading.Event()
    big = Job("write_through", lambda j: gate.wait(5), nbytes=900 << 10)
    assert eng.submit(big)
    t0 = time.perf_counter()
    assert not eng.submit(Job("spill", lambda j: None, nbytes=200 << 10))  # 900 + 200 KiB > 1 MiB
    # a submit that waited for room would wait for the gate (5 s); the margin absorbs a loaded machine
    assert time.perf_counter() - t0 < 2.0
    # gated too: a job that ran to completion before stats() would no longer be held
    assert eng.submit(Job("spill", lambda j: gate.wait(5), nbytes=100 << 10))
    st = eng.stats()
    assert st["dropped"] == 1 and st["dropped_bytes"] == 200 << 10 and st["held_bytes"] == 1000 << 10
    assert eng.grant(big, 1 << 20) == 24 << 10  # a running job can grow only into what is left
    gate.set()
    assert eng.drain(5) and eng.stats()["held_bytes"] == 0


def test_an_unbounded_job_is_counted_but_never_refused(eng):
    """A job carrying memory that exists already (a finished prefetch's staging, on its way into
    the host tier) is never refused by the queue bound, but what it holds is counted: later bounded
    jobs and grants see less room."""
    gate = threading.Event()
    assert eng.submit(Job("prefetch", lambda j: gate.wait(5), nbytes=900 << 10))
    assert not eng.submit(Job("spill", lambda j: None, nbytes=200 << 10))  # bounded: refused
    promote = Job("promote", lambda j: gate.wait(5), nbytes=600 << 10, bounded=False)
    assert eng.submit(promote)
    assert eng.stats()["held_bytes"] == 1500 << 10
    assert not eng.submit(Job("prefetch", lambda j: None, nbytes=1 << 10))
    gate.set()
    assert eng.drain(5) and promote.state == JobState.DONE and eng.stats()["held_bytes"] == 0


def test_failed_and_cancelled_jobs_come_back(eng):
    gate = threading.Event()
    eng.n_workers = 1
    started = threading.Event()
    assert eng.submit(Job("write_through", lambda j: started.set() or gate.wait(5)))
    assert started.wait(5)
    bad = Job("fetch", lambda j: 1 / 0)
    queued = Job("spill", lambda j: None)
    assert eng.submit(bad) and eng.submit(queued)
    assert eng.cancel_queued(kinds={"spill"}) == 1
    gate.set()
    assert eng.drain(5)
    states = {j.kind: j.state for j in eng.poll()}
    assert states == {"write_through": JobState.DONE, "fetch": JobState.FAILED, "spill": JobState.CANCELLED}
    assert "ZeroDivisionError" in bad.error


def test_sync_mode_runs_inline():
    topo = two_rail()
    agent = NodeAgent(topo, source="mock")
    e = TransferEngine(PathSelector(topo, agent, SelectorConfig()), agent, mode="sync")
    where = []
    j = Job("write_through", lambda j: where.append(threading.current_thread()))
    assert e.submit(j) and j.finished and where == [threading.current_thread()]
    assert e.poll() == [j] and not e._threads
    with pytest.raises(ValueError, match="mode"):
        TransferEngine(None, None, mode="later")


def test_close_cancels_and_refuses(eng):
    gate = threading.Event()
    eng.n_workers = 1
    started = threading.Event()
    assert eng.submit(Job("write_through", lambda j: started.set() or gate.wait(0.2)))
    assert started.wait(5)
    q = Job("spill", lambda j: None)
    assert eng.submit(q)
    eng.close()
    assert q.state == JobState.CANCELLED and not eng.submit(Job("spill", lambda j: None))
    assert all(not th.is_alive() for th in eng._threads)


def test_ticket_for_legs_run_elsewhere_posts_releases_and_reports_once(eng):
    """The API PD rails, the simulator and the contention lab use: open, posted per chunk,
    release_leg or leg_done(progress_reported=True), close."""
    progress, transfers = [], []
    eng.agent.report_progress = lambda links, n, seconds=None: progress.append((tuple(links), n))
    orig = eng.agent.report_transfer
    eng.agent.report_transfer = lambda links, n, s, **kw: transfers.append((n, kw)) or orig(links, n, s, **kw)
    t = eng.open("gpu0", "cpu0", 64 << 20)
    assert t.decision is not None and len(t.subpaths) == 2 and eng.agent.in_flight == 2
    t.posted(0, 1 << 20)
    t.posted(0, 0)  # nothing to post: not reported
    assert progress == [(tuple(t.subpaths[0].links), 1 << 20)]
    t.leg_done(0, 32 << 20, 0.01, progress_reported=True)
    assert eng.agent.in_flight == 1 and transfers == [(32 << 20, {"relays": 0, "progress_reported": True})]
    t.release_leg(1)
    t.release_leg(1)  # twice is harmless
    assert eng.agent.in_flight == 0 and len(transfers) == 1  # released without a report
    st = t.close()
    assert st.nbytes == 32 << 20 and t.closed and eng.bandwidth_by_type()["SplitPath"]["moves"] == 1


@pytest.mark.skipif(not hasattr(__import__("os"), "setpriority"), reason="per-thread niceness is Linux-only")
def test_worker_nice_lowers_only_the_workers_priority():
    import os
    topo = two_rail()
    agent = NodeAgent(topo, source="mock")
    e = TransferEngine(PathSelector(topo, agent, SelectorConfig()), agent, worker_nice=5)
    try:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        job = Job("spill", lambda j: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert e.submit(job) and job.wait(10)
        assert job.result == min(19, mine + 5)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller is untouched
    finally:
        e.close()


def test_a_leg_may_ask_for_larger_chunks_never_smaller(eng):
    calls = []
    eng.move("nvme9", "cpu0", 64, 1024, lambda sub, u0, u1: calls.append((u0, u1)), chunk_bytes=16 << 10)
    assert calls == [(0, 16), (16, 32), (32, 48), (48, 64)]  # 16 KiB chunks of 1 KiB units
    calls.clear()
    eng.move("nvme9", "cpu0", 8, 1024, lambda sub, u0, u1: calls.append((u0, u1)), chunk_bytes=1)
    assert calls == [(0, 4), (4, 8)]  # the engine's 4 KiB chunk is the floor
