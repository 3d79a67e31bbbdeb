"""SGLang hook that routes PD KV transfers through FlexFlow (HookRegistry, no SGLang edits).

SGLang's PD transfer backends are not a plugin registry, but every prefill and decode scheduler asks
``sglang.srt.disaggregation.utils.get_kv_class(transfer_backend, class_type)`` for its KV manager
class. An AROUND hook on it hands out :class:`FlexFlowNixlKVManager` for the NIXL backend when
``pd.enabled`` is true in $FLEXFLOW_CONFIG; everything else (sender, receiver, bootstrap server,
other backends) stays SGLang's. HookRegistry also rebinds the ``from ... import get_kv_class``
copies in prefill.py / decode.py, so both sides see the hook.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

GET_KV_CLASS_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"
EARLY_SEND_TARGET = ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
                     "maybe_send_cached_prefix_chunk")
_warned = set()


def route_get_kv_class(original, transfer_backend, class_type, *args, **kwargs):
    cls = original(transfer_backend, class_type, *args, **kwargs)
    from .settings import pd_settings
    settings = pd_settings()  # ConfigError on a bad file: the scheduler fails at start with it
    if not settings.enabled:
        return cls
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    if class_type != KVClassType.MANAGER:
        return cls
    if transfer_backend != TransferBackend.NIXL:
        name = getattr(transfer_backend, "value", transfer_backend)
        if name not in _warned:
            _warned.add(name)
            logger.warning("flexflow PD: pd.enabled but --disaggregation-transfer-backend %s; "
                           "FlexFlow routes only the nixl backend, %s transfers are SGLang's", name, name)
        return cls
    from .nixl_manager import flexflow_nixl_manager_class
    return flexflow_nixl_manager_class()


def hold_early_send(scheduler, req, allow_send=True):
    """BEFORE maybe_send_cached_prefix_chunk: hold the optional early send of the device prefix
    when it cannot be fenced or may read pages still being written; the final send covers them.

    - A CPU server under overlap scheduling: SGLang fences the early send with ``torch.cuda.Event``,
      which does not exist there (the request would crash the scheduler).
    - FlexFlow loads still landing (the radix-contract hazard); today FlexFlowRadixCache finishes
      every load before init_load_back returns, so this arm is a guard, not a path.
    """
    from .settings import pd_settings
    if not pd_settings().enabled or not allow_send:
        return None
    hold = False
    if getattr(scheduler, "enable_overlap", False):
        import torch
        hold = not torch.cuda.is_available()
    tc = getattr(scheduler, "tree_cache", None)
    if getattr(tc, "is_flexflow", False) and getattr(tc, "has_unlanded_loads", lambda: False)():
        hold = True
    if not hold:
        return None
    return (scheduler, req), {"allow_send": False}


def register_pd_hooks(HookRegistry, HookType) -> None:
    HookRegistry.register(GET_KV_CLASS_TARGET, route_get_kv_class, HookType.AROUND)
    HookRegistry.register(EARLY_SEND_TARGET, hold_early_send, HookType.BEFORE)
