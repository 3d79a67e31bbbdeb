"""Deep-tier registry: tier name -> factory, the way SGLang registers its HiCache storage backends
(sglang/srt/mem_cache/storage/backend_factory.py): built-in tiers are registered lazily by
"module:callable" and imported on first use, and a tier named in the config with its own
`factory: "module:callable"` is loaded and built without being registered (SGLang's "dynamic").

A factory is called as `factory(ctx, options)` and returns a KVTier: `ctx` (TierContext) says what
the connector knows (fingerprint, page size, rank directory, routing objects), `options` is the
tier's mapping from the config. Built-ins: `storage` (options: the `storage_tier` section),
`remote` (the `remote_tier` section), `memory` (InMemoryTier; `capacity_pages`, `node`).
Every failure to build a tier is a ConfigError naming the tier and the problem; the connector logs
it and serves without that tier (connector.build_deeper_tiers).
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from ..errors import ConfigError
from .base import KVTier

log = logging.getLogger("flexflow_sglang.tiers")


@dataclass(frozen=True)
class TierContext:
    """What a tier factory may use besides its options."""
    fingerprint: dict          # the connector's model/layout/shard fingerprint (keys: model, dtype, layers, ...)
    fingerprint_text: str      # its canonical text form (what the storage tier stamps on its pages)
    page_nbytes: int           # bytes of one page row (all layers, K and V, of page_size tokens)
    rank_dir: str              # per-rank subdirectory name, e.g. "rank0" (one writer per directory)
    #: topology node the tier's bytes live on, when the config names none (None: the factory's default)
    node: Optional[str] = None
    #: routing of a tier's own I/O (RemoteTier): the connector's PathSelector, this process's topology
    #: node and its TransferEngine. None while the tiers are built before the connector (from_sglang);
    #: the connector then routes tiers that `can_route` itself.
    selector: Any = None
    local_node: Optional[str] = None
    engine: Any = None

    @staticmethod
    def fingerprint_text_of(fingerprint: Mapping[str, Any]) -> str:
        """The canonical text form of a fingerprint: its items sorted, repr'd."""
        return repr(sorted((k, v) for k, v in fingerprint.items()))


TierFactory = Callable[[TierContext, Mapping[str, Any]], KVTier]

#: "package.module:callable" (the callable may be a dotted attribute path, e.g. Class.from_options)
_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_NAME = re.compile(r"^[A-Za-z0-9_][\w.-]*$")

_lock = threading.Lock()
_registry: Dict[str, Union[TierFactory, str]] = {}


def is_factory_spec(spec: Any) -> bool:
    """True for a well-formed "module.path:callable" string."""
    return isinstance(spec, str) and bool(_SPEC.match(spec))


def register_tier(name: str, factory: "TierFactory | str", *, replace: bool = False) -> None:
    """Make `name` buildable by `create_tier`. `factory`: a callable `(ctx, options) -> KVTier`, or
    "module.path:callable", imported on the first `create_tier(name, ...)`. Registering the same
    factory again is a no-op; another factory under a taken name is refused (ConfigError) unless
    `replace`."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"tier name {name!r}: must be a non-empty name of letters, digits, '_', '-', '.'")
    if isinstance(factory, str):
        if not is_factory_spec(factory):
            raise ConfigError(f"tier {name!r}: factory {factory!r} is not 'module.path:callable'")
    elif not callable(factory):
        raise ConfigError(f"tier {name!r}: factory must be a callable or 'module.path:callable', "
                          f"got {type(factory).__name__}")
    with _lock:
        old = _registry.get(name)
        if old is not None and old is not factory and old != factory and not replace:
            raise ConfigError(f"tier {name!r} is already registered (factory {_describe(old)}); "
                              "pass replace=True to replace it")
        _registry[name] = factory


def registered_tiers() -> List[str]:
    """Names `create_tier` accepts, sorted."""
    with _lock:
        return sorted(_registry)


def load_factory(spec: str, what: str = "factory") -> TierFactory:
    """Import "module.path:callable" and return the callable (ConfigError naming `what` otherwise)."""
    if not is_factory_spec(spec):
        raise ConfigError(f"{what} {spec!r} is not 'module.path:callable'")
    mod_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or anything the module raises at import
        raise ConfigError(f"{what} {spec!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{what} {spec!r}: {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def create_tier(name: str, ctx: TierContext, options: Mapping[str, Any], *,
                factory: "TierFactory | str | None" = None) -> KVTier:
    """Build tier `name` with `ctx` and `options`: the registered factory, or `factory` when given
    (a tier declared with its own factory in the config; `name` is then only its label). Raises
    ConfigError naming the tier and the problem: unknown name (the registered ones are listed), a
    factory that cannot be imported, raises, or returns something that is not a KVTier."""
    if factory is None:
        with _lock:
            factory = _registry.get(name)
        if factory is None:
            raise ConfigError(f"unknown tier {name!r} (registered tiers: {registered_tiers()}; or give the "
                              "entry a factory: 'module.path:callable')")
    what = f"tier {name!r}: factory"
    fn = load_factory(factory, what) if isinstance(factory, str) else factory
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"tier {name!r}: options must be a mapping, got {type(options).__name__}")
    try:
        tier = fn(ctx, options)
    except ConfigError as e:
        raise ConfigError(f"tier {name!r}: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever a tier raises at start: one message
        raise ConfigError(f"tier {name!r} could not start: {type(e).__name__}: {e}") from e
    if not isinstance(tier, KVTier):
        _close_quietly(tier)
        raise ConfigError(f"tier {name!r}: factory {_describe(factory)} returned a {type(tier).__name__}, "
                          "not a KVTier (subclass flexflow_sglang.tiers.KVTier)")
    if not tier.name:
        tier.name = name
    return tier


def _describe(factory: Any) -> str:
    if isinstance(factory, str):
        return factory
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"


def _close_quietly(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001
            log.debug("closing a refused tier object failed", exc_info=True)


# built-ins, imported on first use
register_tier("storage", "flexflow_sglang.tiers:storage_factory")
register_tier("remote", "flexflow_sglang.tiers:remote_factory")
register_tier("memory", "flexflow_sglang.tiers.memory:memory_factory")
