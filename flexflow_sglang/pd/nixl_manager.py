"""FlexFlow's subclass of SGLang's NIXL PD KV manager (handed out by the get_kv_class hook).

What it changes, and nothing else:

1. Host-resident KV pools. SGLang's NIXL manager registers the KV pool as VRAM unconditionally
   (prefill never sets ``kv_data_mem_kinds``; decode sets VRAM), which fails on a CPU server
   (``--device cpu``). When the pool lives in host memory we register it as DRAM on both sides.
2. Rails (prefill side, ``pd.rails`` non-empty, ``pd.policy`` adaptive / first_rail). One extra
   NIXL agent per rail, its UCX backend bound to that device (``device_list``), the KV pool
   registered with it and every decode peer's metadata loaded into it. Each KV chunk that SGLang's
   transfer worker hands to ``send_kvcache`` is planned by the :class:`RailRouter`: the whole
   chunk on the best rail, or its pages split over two rails in the selector's shares. Each leg is
   posted on its rail's agent through SGLang's own descriptor builder (``_send_kvcache_generic``
   with ``bypass_prepped``), so MHA / MLA / PP layouts stay SGLang's. The legs come back to the
   worker as one :class:`RoutedXfer`, which ``_await_handles`` understands; a leg that cannot be
   posted on its rail falls back to SGLang's agent (the transfer never fails because of routing).
   Aux data, state buffers, staging, DCP and heterogeneous-TP transfers are left on SGLang's agent.

Completion is still SGLang's: the worker waits for every leg, then sends its KV_STATUS message; the
decode side needs no change (its agent is the WRITE target whichever local agent wrote).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any, List, Optional, Tuple

logger = logging.getLogger(__name__)

_CLASS_CACHE: dict = {}


class RoutedXfer:
    """The legs of one routed KV chunk: [(agent, handle, rail, nbytes, t_posted)], and the transfer
    engine ticket (from RailRouter.plan) that holds their reservations: leg k is the plan's share
    `share[k]`; each leg releases and reports through the ticket as it settles."""

    __slots__ = ("legs", "t_done", "failed", "path_type", "t0", "recorded", "ticket", "share")

    def __init__(self, path_type: str, t0: float, ticket=None):
        self.legs: List[Tuple[Any, Any, int, int, float]] = []
        self.t_done: List[Optional[float]] = []
        self.failed = False
        self.path_type = path_type
        self.t0 = t0
        self.recorded = False
        self.ticket = ticket
        self.share: List[int] = []  # the plan's share (= ticket subpath) index of each leg

    def add(self, agent, handle, rail: int, nbytes: int, t_posted: float, share: int = -1) -> None:
        self.legs.append((agent, handle, rail, nbytes, t_posted))
        self.t_done.append(None)
        self.share.append(share)


_ENV_LOCK = threading.Lock()


#: worker threads of each rail's UCX backend (0: one worker). Rail agents have no NIXL progress thread:
#: it busy-spins a core per agent even when idle (shared notes: nixl-nvml-cython.md), which starved the
#: prefill forward on small hosts; SGLang's transfer worker polls the legs (`_await_handles`), which
#: progresses them.
RAIL_THREADS = int(os.environ.get("FLEXFLOW_PD_RAIL_THREADS", "0"))


def create_rail_backend(agent, dev: str, sysfs_root: str = "/sys", num_threads: int = RAIL_THREADS) -> None:
    """A UCX backend bound to one device. NIXL's ``device_list`` takes HCA names (it appends the
    port, ``mlx5_0`` -> ``mlx5_0:1``), so it is used for InfiniBand/RoCE devices; Ethernet devices
    go through UCX_NET_DEVICES, which UCX reads once, when the backend's context is created."""
    params = {"num_threads": str(num_threads)} if num_threads > 0 else {}
    if os.path.isdir(os.path.join(sysfs_root, "class", "infiniband", dev)):
        agent.create_backend("UCX", dict(params, device_list=dev))
        return
    with _ENV_LOCK:
        saved = os.environ.get("UCX_NET_DEVICES")
        os.environ["UCX_NET_DEVICES"] = dev
        try:
            agent.create_backend("UCX", params)
        finally:
            if saved is None:
                os.environ.pop("UCX_NET_DEVICES", None)
            else:
                os.environ["UCX_NET_DEVICES"] = saved


def _exporter(engine_rank):
    """flexflow_pd_* gauges on SGLang's /metrics (multiprocess collector); None when unavailable."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None  # --enable-metrics is off: nothing would collect the gauges
    try:
        from ..monitor.prometheus import PromExporter
        return PromExporter({"engine_rank": str(engine_rank)}, min_interval_s=0.0, prefix="flexflow_pd")
    except Exception:
        logger.exception("flexflow PD: Prometheus exporter unavailable")
        return None


def kv_on_host(server_args) -> bool:
    return str(getattr(server_args, "device", "") or "").lower() == "cpu"


class _Chunk:
    """One KV chunk SGLang's transfer worker hands to ``send_kvcache``."""

    __slots__ = ("peer_name", "src_indices", "dst_ptrs", "dst_indices", "dst_gpu_id", "dst_mem_kind",
                 "per_item", "nbytes", "t0")

    def __init__(self, peer_name, src_indices, dst_ptrs, dst_indices, dst_gpu_id, dst_mem_kind,
                 per_item: int, t0: float):
        self.peer_name, self.src_indices, self.dst_ptrs = peer_name, src_indices, dst_ptrs
        self.dst_indices, self.dst_gpu_id, self.dst_mem_kind = dst_indices, dst_gpu_id, dst_mem_kind
        self.per_item, self.t0 = per_item, t0
        self.nbytes = per_item * len(src_indices)


class FlexFlowNixlRails:
    """The methods FlexFlow adds to SGLang's ``NixlKVManager`` (mixed in before it, so ``super()``
    is SGLang's class). Kept at module level, the combined class is made by
    :func:`flexflow_nixl_manager_class` only when SGLang's NIXL module is importable."""

    is_flexflow = True

    # SGLang assigns self.agent in NixlKVManager.__init__ and reads it everywhere; a transfer
    # worker posting a leg on a rail swaps in that rail's agent for its own thread only.
    @property
    def agent(self):
        tl = self.__dict__.get("_ff_tls")
        override = getattr(tl, "agent", None) if tl is not None else None
        return override if override is not None else self.__dict__["_ff_primary_agent"]

    @agent.setter
    def agent(self, value):
        self.__dict__["_ff_primary_agent"] = value

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **kwargs):
        from sglang.srt.disaggregation.utils import DisaggregationMode

        from .settings import pd_settings

        self.__dict__["_ff_tls"] = threading.local()
        self._ff_settings = pd_settings()
        self._ff_rails: List[Tuple[str, Any]] = []  # (device, nixl agent)
        self._ff_rail_peers: List[set] = []
        self._ff_router = None
        self._ff_stats = None
        if kv_on_host(server_args):
            n = len(getattr(args, "kv_data_ptrs", None) or [])
            args.kv_data_mem_kinds = ["DRAM"] * n
            st = getattr(args, "state_data_ptrs", None) or []
            if st and hasattr(args, "state_data_mem_kinds"):
                args.state_data_mem_kinds = ["DRAM"] * len(st)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)
        cfg = self._ff_settings
        if disaggregation_mode == DisaggregationMode.PREFILL:
            if cfg.rails and cfg.policy in ("adaptive", "first_rail"):
                self._ff_setup_rails(cfg)
            from .stats import ChunkStats
            self._ff_stats = ChunkStats(len(self._ff_rails), cfg.policy if self._ff_rails else "primary",
                                        exporter=_exporter(getattr(self.kv_args, "engine_rank", 0)))
        if self._ff_router is not None:
            caps = [l.capacity_gbps for l in self._ff_router.topology.links if l.b == "decode" or l.a == "decode"]
            logger.info("flexflow PD: rail capacities %s GB/s, load source %s, selector %s", caps,
                        self._ff_router.agent.source_mode, self._ff_router.selector.impl)
        logger.info("flexflow PD: NIXL KV manager (%s), KV memory %s, policy %s, rails %s",
                    disaggregation_mode.value if hasattr(disaggregation_mode, "value") else disaggregation_mode,
                    "DRAM" if kv_on_host(server_args) else "VRAM", cfg.policy,
                    [d for d, _ in self._ff_rails] or "none (SGLang's agent)")

    # ------------------------------------------------------------------ rails
    def _ff_setup_rails(self, cfg) -> None:
        from ..tiers.base import skip_ucx_rdma_modules_without_devices
        skip_ucx_rdma_modules_without_devices()  # before UCX loads (exit-time segfault, see there)
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        from .rails import RailRouter
        from .settings import flexflow_settings

        full = flexflow_settings()
        kv_addrs = [(ptr, ln, 0 if kind == "DRAM" else self.kv_args.gpu_id, "")
                    for ptr, ln, kind in zip(self.kv_args.kv_data_ptrs, self.kv_args.kv_data_lens,
                                             self.kv_args.kv_data_mem_kinds)]
        kinds = set(self.kv_args.kv_data_mem_kinds)
        if len(kinds) != 1:
            logger.warning("flexflow PD: mixed KV memory kinds %s; rails disabled", sorted(kinds))
            return
        mem_kind = kinds.pop()
        for i, dev in enumerate(cfg.rails):
            try:
                agent = nixl_agent(f"{self.__dict__['_ff_primary_agent'].name}-ff{i}-{uuid.uuid4().hex[:6]}",
                                   nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=RAIL_THREADS,
                                                     sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
                create_rail_backend(agent, dev, full.monitor.sysfs_root)
                if not agent.register_memory(kv_addrs, mem_kind):
                    raise RuntimeError("register_memory returned nothing")
            except Exception as e:  # a bad rail must not stop the server: SGLang's agent remains
                logger.warning("flexflow PD: rail %d (pd.rails[%d] = %r) unusable, skipped: %s", i, i, dev, e)
                continue
            self._ff_rails.append((dev, agent))
            self._ff_rail_peers.append(set())
        if not self._ff_rails:
            return
        # decode peers that registered while the rails were being built
        for name, info in list(self.decode_kv_args_table.items()):
            self._ff_add_peer_to_rails(name, info.agent_metadata)
        s = full.selector
        self._ff_router = RailRouter(
            [d for d, _ in self._ff_rails], s, policy=cfg.policy, default_gbps=cfg.rail_gbps,
            latency_us=cfg.rail_latency_us, sysfs_root=full.monitor.sysfs_root,
            sample_interval_ms=full.monitor.sample_interval_ms,
            feedback_half_life_ms=full.monitor.feedback_half_life_ms, impl=full.selector_impl,
            elastic_share=full.monitor.elastic_share, elastic_probe_s=full.monitor.elastic_probe_s)

    def _ff_add_peer_to_rails(self, peer_name: str, metadata: bytes) -> None:
        for i, (dev, agent) in enumerate(self._ff_rails):
            try:
                if not agent.check_remote_metadata(peer_name):
                    agent.add_remote_agent(metadata)
                self._ff_rail_peers[i].add(peer_name)
            except Exception as e:
                self._ff_rail_peers[i].discard(peer_name)
                logger.warning("flexflow PD: rail %r cannot reach decode peer %s: %s", dev, peer_name, e)

    def _add_remote_peer(self, decode_kv_args):
        super()._add_remote_peer(decode_kv_args)
        if self._ff_rails and decode_kv_args.agent_name in self.decode_kv_args_table:
            self._ff_add_peer_to_rails(decode_kv_args.agent_name, decode_kv_args.agent_metadata)

    def _reload_invalidated_peers(self, room_transfer_infos):
        super()._reload_invalidated_peers(room_transfer_infos)
        for name in list(room_transfer_infos or {}):
            info = self.decode_kv_args_table.get(name)
            if info is not None and self._ff_rails:
                self._ff_add_peer_to_rails(name, info.agent_metadata)

    # ------------------------------------------------------------------ routed send
    def send_kvcache(self, peer_name, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_gpu_id,
                     dst_mem_kind="VRAM"):
        n = len(prefill_kv_indices)
        if self._ff_stats is None or n == 0:
            return super().send_kvcache(peer_name, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices,
                                        dst_gpu_id, dst_mem_kind)
        chunk = _Chunk(peer_name, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, dst_gpu_id, dst_mem_kind,
                       per_item=int(sum(self.kv_args.kv_item_lens)), t0=time.perf_counter())
        usable = [i for i, peers in enumerate(self._ff_rail_peers) if peer_name in peers]
        plan = None
        if self._ff_router is not None and usable:
            try:
                plan = self._ff_router.plan(chunk.nbytes)
            except Exception:  # routing must never fail a transfer: SGLang's own path remains
                logger.exception("flexflow PD: rail planning failed; chunk goes via SGLang's agent")
        if plan is None:
            return self._ff_via_sglang(chunk)
        return self._ff_send_routed(chunk, plan, usable)

    def _ff_via_sglang(self, chunk: "_Chunk"):
        """The whole chunk on SGLang's own agent, still timed as one (rail -1) leg."""
        h = super().send_kvcache(chunk.peer_name, chunk.src_indices, chunk.dst_ptrs, chunk.dst_indices,
                                 chunk.dst_gpu_id, chunk.dst_mem_kind)
        if h is None:
            return None
        xfer = RoutedXfer("sglang", chunk.t0)
        xfer.add(self.__dict__["_ff_primary_agent"], h, -1, chunk.nbytes, chunk.t0)
        return xfer

    def _ff_send_routed(self, chunk: "_Chunk", plan, usable: List[int]):
        """Post each leg of the plan on its rail's agent (SGLang's descriptor builder, thread-local
        agent swap); a leg that cannot be posted before any other is in flight sends the whole chunk
        via SGLang's agent instead."""
        from .rails import split_by_shares
        router = self._ff_router
        ticket = plan.ticket
        xfer = RoutedXfer(plan.path_type, chunk.t0, ticket)
        tl = self.__dict__["_ff_tls"]
        share_of = {s.rail: i for i, s in enumerate(plan.shares)}  # a plan names each rail once
        for rail, a, b in split_by_shares(len(chunk.src_indices), plan.shares):
            leg_bytes = chunk.per_item * (b - a)
            agent = self._ff_rails[rail][1] if rail in usable else None
            share = share_of[rail]
            if agent is None:  # this rail cannot reach the peer: its share goes via SGLang's agent
                router.leg_done(ticket, share, -1, 0, 0.0, ok=False)
                rail = -1
            try:
                tl.agent = agent  # None = SGLang's agent
                if rail >= 0:
                    router.leg_posted(ticket, share, rail, leg_bytes)
                t_post = time.perf_counter()
                h = self._send_kvcache_generic(
                    peer_name=chunk.peer_name, src_data_ptrs=self.kv_args.kv_data_ptrs,
                    dst_data_ptrs=chunk.dst_ptrs, item_lens=self.kv_args.kv_item_lens,
                    prefill_data_indices=chunk.src_indices[a:b], dst_data_indices=chunk.dst_indices[a:b],
                    dst_gpu_id=chunk.dst_gpu_id, src_mem_kind=self.src_mem_kind,
                    dst_mem_kind=chunk.dst_mem_kind, bypass_prepped=True)
            except Exception as e:
                if rail < 0 or xfer.legs:
                    router.finish(ticket)  # the chunk fails as a whole: release every leg's reservation
                    raise  # SGLang's own path failed, or legs are in flight: SGLang's failure handling
                logger.warning("flexflow PD: posting on rail %r failed (%s); chunk goes via SGLang's agent",
                               self._ff_rails[rail][0], e)
                tl.agent = None
                router.finish(ticket)
                return self._ff_via_sglang(chunk)
            finally:
                tl.agent = None
            if h is not None:
                xfer.add(agent if agent is not None else self.__dict__["_ff_primary_agent"], h, rail,
                         leg_bytes, t_post, share)
            else:
                router.leg_done(ticket, share, rail, 0, 0.0, ok=False)
        if not xfer.legs:
            router.finish(ticket)
            return None
        return xfer

    def _ff_state(self, handle) -> Tuple[bool, bool]:
        """(settled, failed) of a plain NIXL handle or a RoutedXfer; finished legs feed back."""
        if not isinstance(handle, RoutedXfer):
            st = self.__dict__["_ff_primary_agent"].check_xfer_state(handle)
            return st in ("DONE", "ERR"), st == "ERR"
        for k, (agent, h, rail, nbytes, t_post) in enumerate(handle.legs):
            if handle.t_done[k] is not None:
                continue
            st = agent.check_xfer_state(h)
            if st in ("DONE", "ERR"):
                now = time.perf_counter()
                handle.t_done[k] = now
                if st == "ERR":
                    handle.failed = True
                if handle.ticket is not None and self._ff_router is not None:
                    self._ff_router.leg_done(handle.ticket, handle.share[k], rail, nbytes, now - t_post,
                                             ok=st == "DONE")
        settled = all(t is not None for t in handle.t_done)
        if settled and handle.ticket is not None and self._ff_router is not None:
            self._ff_router.finish(handle.ticket)  # idempotent
        if settled and not handle.recorded and self._ff_stats is not None:
            handle.recorded = True
            self._ff_stats.record(handle.path_type,
                                  [(rail, nb, tp, td) for (_, _, rail, nb, tp), td in zip(handle.legs, handle.t_done)],
                                  not handle.failed, handle.t0)
        return settled, handle.failed

    def _await_handles(self, handles, *, failure_seen):
        # SGLang's loop, with state reads that understand routed legs (same settle semantics:
        # unbounded while healthy, bounded once any handle failed).
        from sglang.srt.disaggregation.nixl import conn as nixl_conn
        timeout_s = getattr(nixl_conn, "NIXL_ERR_SETTLE_TIMEOUT_S", 30.0)
        poll_s = getattr(nixl_conn, "NIXL_ERR_SETTLE_POLL_S", 0.01)
        deadline = time.time() + timeout_s if failure_seen else None
        while True:
            all_settled = True
            any_failed = failure_seen
            try:
                for handle in handles:
                    settled, failed = self._ff_state(handle)
                    any_failed = any_failed or failed
                    all_settled = all_settled and settled
            except Exception as e:
                logger.warning("Failed to read NIXL transfer state: %s", e)
                return False, True
            if all_settled:
                return True, any_failed
            if not any_failed:
                time.sleep(0)
                continue
            if deadline is None:
                deadline = time.time() + timeout_s
            elif time.time() >= deadline:
                return False, True
            time.sleep(poll_s)

    def flexflow_pd_stats(self) -> Optional[dict]:
        out = self._ff_stats.metrics() if self._ff_stats is not None else {}
        if self._ff_router is not None:
            out["utilization"] = self._ff_router.utilization()
        return out


def flexflow_nixl_manager_class():
    """SGLang's NixlKVManager with :class:`FlexFlowNixlRails` mixed in. Built lazily: importing
    SGLang's NIXL module pulls in nixl and zmq."""
    cls = _CLASS_CACHE.get("manager")
    if cls is not None:
        return cls
    from sglang.srt.disaggregation.base.conn import KVArgs  # noqa: F401  (import check)
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    cls = type("FlexFlowNixlKVManager", (FlexFlowNixlRails, NixlKVManager), {"__module__": __name__})
    _CLASS_CACHE["manager"] = cls
    return cls
