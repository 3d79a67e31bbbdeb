"""YAML configuration -> frozen dataclasses, validated once at load.

`configs/default.yaml` is the single source of defaults: load_config() overlays the user's file on
it, and tests check that the dataclass defaults below equal it. Every error names the key path
(e.g. `selector.nvlink_util_threshold`), the offending value and what is allowed.
The SGLang backend reads the file named by the FLEXFLOW_CONFIG environment variable; so does every
`flexflow` command that takes --config, and `flexflow config check [FILE]` validates a file the way
the server will. The reader refuses what YAML would silently accept: duplicate keys or sections,
more than a few aliases (an alias bomb gets one short error), invalid UTF-8, non-finite numbers and
numbers past each key's range; error messages quote at most 80 characters of a value.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple

import yaml

from .errors import ConfigError
from .transfer.trace import DEFAULT_TRACE_MAX_JOBS

ENV_VAR = "FLEXFLOW_CONFIG"
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG_PATH = os.path.join(_PKG_DIR, "configs", "default.yaml")

# value rules (the checker shared with selector/types.py) live in config_rules.py
from .config_rules import (_MAX, _SELECTOR_RULES, MAX_NUMBER, _check, _short,  # noqa: E402,F401
                           validate_selector_values)


# ------------------------------------------------------------------ sections
@dataclass(frozen=True)
class TopologyConfig:
    source: str = "auto"  # auto | discover | mock | file
    mock: str = "single"
    file: Optional[str] = None


@dataclass(frozen=True)
class MonitorConfig:
    sample_interval_ms: float = 100.0
    source: str = "auto"  # auto | mock | nvml | sysfs
    feedback_half_life_ms: float = 500.0
    sysfs_root: str = "/sys"
    #: share of *yielding* foreign load (greedy TCP bulk flows) we may take: 0 = protect all
    #: foreign traffic (default), 0.5 = a TCP-like fair share against one flow (docs/contention.md)
    elastic_share: float = 0.0
    #: first re-probe of a link found not to yield, in seconds (doubles up to 60 s)
    elastic_probe_s: float = 5.0


@dataclass(frozen=True)
class HostTierConfig:
    enabled: bool = True
    capacity_gb: float = 1.0
    capacity_tokens: Optional[int] = None  # overrides capacity_gb when set
    write_policy: str = "write_through"  # write_through | on_evict
    verify_checksums: bool = True
    pin_memory: str = "auto"  # auto | always | never
    # one shared-memory tier per node for every process serving the same model shard (issue 17)
    shared: bool = False
    # a page the host tier holds replaces the request's own recomputation of it when SGLang inserts
    # it into the tree (backend/host_adopt.py): host hits then equal device hits in bf16
    canonical_on_insert: bool = True
    # host hits copied into the device pool layer by layer while the forward runs (backend/layerwise.py):
    # true = where it is implemented (CPU pools with the compiled kernels), false = whole load first
    layerwise_load: bool = False  # opt-in until it measures faster on the target hardware


@dataclass(frozen=True)
class StorageTierConfig:
    enabled: bool = False
    path: str = "/tmp/flexflow-kv"
    capacity_gb: float = 10.0
    backend: str = "auto"  # auto | posix | gds (NIXL) | os (compiled system calls, no NIXL)
    eviction: str = "lru"
    write_through: bool = True  # copy every stored page here too (else only host-tier evictions)
    read_only: bool = False  # serve the pages already there, write nothing (read-only media, shared copies)
    fsync: bool = False  # fsync each page before it counts as stored (survives power loss; slower)
    layout: str = "slabs"  # slabs: page slots in a few preallocated files | files: one file per page


@dataclass(frozen=True)
class RemoteTierConfig:
    enabled: bool = False
    peers: Tuple[str, ...] = ()
    listen: str = "127.0.0.1:0"  # `flexflow tier-server --config` listens here unless --listen says otherwise
    timeout_ms: float = 2000.0
    retry_after_s: float = 10.0
    write_through: bool = True
    secret_file: Optional[str] = None  # shared-secret mode (docs/tiers.md); else $FLEXFLOW_TIER_SECRET[_FILE]
    keyed_page_keys: bool = False  # page keys keyed with the secret: key observers cannot confirm prompts
    local_node: Optional[str] = None  # this server's topology node for routing (null: its host-memory node)
    relay_peers: Tuple[str, ...] = ()  # tier servers used only as relays (CrossNodeRelay), never owners


@dataclass(frozen=True)
class HiCacheStorageTierConfig:
    """SGLang's HiCache storage backends (file, mooncake, nixl, ...) as a deep tier, built by name
    (`hicache_storage`, registered by backend/plugin.py; backend/hicache_tier.py)."""
    enabled: bool = False
    backend: str = "file"  # a name SGLang's StorageBackendFactory knows: file | mooncake | nixl | ...
    extra_config: Dict[str, Any] = field(default_factory=dict, hash=False)  # the backend's own settings
    write_through: bool = True  # copy every stored page here too (else only host-tier evictions, if first)
    node: Optional[str] = None  # topology node of the store (null: nvme0 for local-disk backends, else unrouted)
    timeout_ms: float = 2000.0  # one backend call waits at most this long, then it is a miss
    retry_after_s: float = 5.0  # after a failed or timed-out call, every call is a miss this long
    staging_mb: float = 16.0  # flexflow's staging buffer (registered with the backend where it needs that)
    # objects per backend call at most: Mooncake's TCP transport queues at most 1,024 transfers per
    # peer and fails the rest (QUEUE_FULL); a batch of thousands of page-1 objects overflowed it
    max_batch_objects: int = 512


@dataclass(frozen=True)
class TransferConfig:
    """The transfer engine (flexflow_sglang/transfer/): background deep-tier I/O and prefetch."""
    mode: str = "async"  # async: deep-tier I/O on engine workers | sync: on the scheduler thread (ablation)
    workers: int = 2
    queue_bytes: int = 256 << 20  # bytes queued/running jobs may hold; a full queue drops the copy
    chunk_bytes: int = 4 << 20
    load_timeout_ms: float = 1000.0  # a load-back waits this long on a deep fetch, then it is a miss
    prefetch_policy: str = "timeout"  # off | best_effort | wait_complete | timeout
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_ki_token_s: float = 0.25
    # the server's prefill throughput (tokens/s); > 0: a deep run estimated to arrive slower than its
    # tokens would recompute is left to SGLang's prefill (connector/fetch_cost.py); 0: always fetch
    recompute_tokens_per_s: float = 0.0
    # niceness added to the engine's worker threads: background I/O and checksums yield the CPU to
    # the scheduler thread and the forward's threads when cores are short (0: same priority)
    worker_nice: int = 0
    # opt-in timeline of finished background jobs: <trace_path>.<pid>.jsonl, owner-only, at most
    # trace_max_jobs lines (transfer/trace.py); None: off
    trace_path: Optional[str] = None
    trace_max_jobs: int = DEFAULT_TRACE_MAX_JOBS


@dataclass(frozen=True)
class ExtraTierConfig:
    """One entry of `extra_tiers`: a deep tier built by name (tiers/registry.py) after the storage
    and remote tiers. With `factory` ("module.path:callable", imported at start) the tier is built by
    that callable and `name` is its label; else `name` must be a registered tier."""
    name: str
    factory: Optional[str] = None
    options: Dict[str, Any] = field(default_factory=dict, hash=False)  # handed to the factory as given
    write_through: bool = True  # copy every stored page here too (else only host-tier evictions, if first)


#: the keys of one `extra_tiers` entry (the strict loader rejects others)
EXTRA_TIER_KEYS = ("name", "factory", "options", "write_through")


@dataclass(frozen=True)
class PDConfig:
    enabled: bool = False
    policy: str = "adaptive"  # adaptive | first_rail | primary
    rails: Tuple[str, ...] = ()
    rail_gbps: Optional[float] = None  # None: sysfs speed of the device, else 12.5
    rail_latency_us: float = 20.0


_RULES: Dict[str, Dict[str, tuple]] = {
    "topology": {"source": ("choice", ("auto", "discover", "mock", "file")), "mock": ("str", None),
                 "file": ("opt_str", None)},
    "monitor": {"sample_interval_ms": ("positive", None), "source": ("choice", ("auto", "mock", "nvml", "sysfs")),
                "feedback_half_life_ms": ("positive", None), "sysfs_root": ("str", None),
                "elastic_share": ("unit", None), "elastic_probe_s": ("positive", None)},
    "host_tier": {"enabled": ("bool", None), "capacity_gb": ("nonneg", None), "capacity_tokens": ("opt_int_pos", None),
                  "write_policy": ("choice", ("write_through", "on_evict")), "verify_checksums": ("bool", None),
                  "pin_memory": ("choice", ("auto", "always", "never")),
                  "layerwise_load": ("bool", None), "shared": ("bool", None),
                  "canonical_on_insert": ("bool", None)},
    "storage_tier": {"enabled": ("bool", None), "path": ("str", None), "capacity_gb": ("positive", None),
                     "backend": ("choice", ("auto", "posix", "gds", "os")), "eviction": ("choice", ("lru",)),
                     "write_through": ("bool", None), "read_only": ("bool", None), "fsync": ("bool", None),
                     "layout": ("choice", ("files", "slabs"))},
    "remote_tier": {"enabled": ("bool", None), "peers": ("hostport_list", None), "listen": ("hostport", None),
                    "timeout_ms": ("positive", None), "retry_after_s": ("positive", None),
                    "write_through": ("bool", None), "secret_file": ("opt_str", None),
                    "keyed_page_keys": ("bool", None), "local_node": ("opt_str", None),
                    "relay_peers": ("hostport_list", None)},
    "hicache_storage": {"enabled": ("bool", None), "backend": ("str", None), "extra_config": ("mapping", None),
                        "write_through": ("bool", None), "node": ("opt_str", None),
                        "timeout_ms": ("positive", None), "retry_after_s": ("nonneg", None),
                        "staging_mb": ("positive", None), "max_batch_objects": ("int_range", (1, 1 << 20))},
    "pd": {"enabled": ("bool", None), "policy": ("choice", ("adaptive", "first_rail", "primary")),
           "rails": ("str_list", None), "rail_gbps": ("opt_positive", None), "rail_latency_us": ("nonneg", None)},
    "selector": _SELECTOR_RULES,
    "transfer": {"mode": ("choice", ("async", "sync")), "workers": ("int_range", (1, 16)),
                 "queue_bytes": ("int_range", (1 << 20, 1 << 40)), "chunk_bytes": ("int_range", (4096, 1 << 34)),
                 "load_timeout_ms": ("positive", None),
                 "prefetch_policy": ("choice", ("off", "best_effort", "wait_complete", "timeout")),
                 "prefetch_timeout_base_s": ("nonneg", None), "prefetch_timeout_per_ki_token_s": ("nonneg", None),
                 "recompute_tokens_per_s": ("nonneg", None), "worker_nice": ("int_range", (0, 19)),
                 "trace_path": ("opt_str", None), "trace_max_jobs": ("int_range", (1, 100_000_000))},
}
_TOP_SCALARS = {"selector_impl": ("choice", ("auto", "compiled", "python")), "log_level": ("choice",
                ("DEBUG", "INFO", "WARNING", "ERROR"))}


@dataclass(frozen=True)
class FlexFlowConfig:
    selector: "Any" = None  # SelectorConfig (import cycle: filled in __post_init__)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    host_tier: HostTierConfig = field(default_factory=HostTierConfig)
    storage_tier: StorageTierConfig = field(default_factory=StorageTierConfig)
    remote_tier: RemoteTierConfig = field(default_factory=RemoteTierConfig)
    hicache_storage: HiCacheStorageTierConfig = field(default_factory=HiCacheStorageTierConfig)
    pd: PDConfig = field(default_factory=PDConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    #: deep tiers after storage_tier / remote_tier, in this order (docs/tiers.md, "Adding a tier")
    extra_tiers: Tuple[ExtraTierConfig, ...] = ()
    selector_impl: str = "auto"
    log_level: str = "INFO"
    path: Optional[str] = None  # the file it came from (None = defaults)

    def __post_init__(self):
        if self.selector is None:
            from .selector.types import SelectorConfig
            object.__setattr__(self, "selector", SelectorConfig())

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            if f.name == "path":
                continue
            v = getattr(self, f.name)
            if hasattr(v, "__dataclass_fields__"):
                v = {g.name: (list(getattr(v, g.name)) if isinstance(getattr(v, g.name), tuple)
                              else getattr(v, g.name)) for g in fields(v)}
            elif f.name == "extra_tiers":
                v = [{g.name: copy.deepcopy(getattr(e, g.name)) for g in fields(e)} for e in v]
            out[f.name] = v
        return out


_SECTION_CLASSES = {"topology": TopologyConfig, "monitor": MonitorConfig, "host_tier": HostTierConfig,
                    "storage_tier": StorageTierConfig, "remote_tier": RemoteTierConfig,
                    "hicache_storage": HiCacheStorageTierConfig, "pd": PDConfig, "transfer": TransferConfig}


MAX_ALIASES = 16       # a config needs none; an alias bomb needs many
MAX_CONFIG_BYTES = 1 << 20


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses duplicate keys (the last one would silently win) and alias bombs."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases = getattr(self, "_aliases", 0) + 1
            if self._aliases > MAX_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_ALIASES} YAML aliases (*name); a config needs none")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for knode, _ in node.value:
            k = self.construct_object(knode, deep=True)
            try:
                hash(k)
            except TypeError:
                raise yaml.YAMLError(f"line {knode.start_mark.line + 1}: a mapping key must be a scalar") from None
            if k in seen:
                raise yaml.YAMLError(f"duplicate key {_short(k)} at line {knode.start_mark.line + 1} "
                                     f"(first at line {seen[k]})")
            seen[k] = knode.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _read_yaml(path: str, what: str) -> dict:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{what} {path!r} is larger than {MAX_CONFIG_BYTES} bytes")
        text = raw.decode("utf-8")
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"{what} {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path!r} is a directory, not a YAML file") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path!r} is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    except RecursionError:
        raise ConfigError(f"{what} {path!r}: YAML nested too deeply") from None
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"{what} {path!r} is not valid YAML: {msg[:300]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path!r}: top level must be a mapping, got {type(data).__name__}")
    return data


def default_dict() -> dict:
    return _read_yaml(DEFAULT_CONFIG_PATH, "default config")


def config_from_dict(data: dict, source: str = "<dict>") -> FlexFlowConfig:
    """Overlay `data` on configs/default.yaml, validate everything, build the frozen config."""
    from .selector.types import SelectorConfig
    base = default_dict()
    errs = []
    valid_top = sorted(set(_RULES) | set(_TOP_SCALARS) | {"extra_tiers"})
    for key, val in data.items():
        if key not in _RULES and key not in _TOP_SCALARS and key != "extra_tiers":
            errs.append(f"unknown key {key!r} (valid keys: {valid_top})")
            continue
        if key in _TOP_SCALARS or key == "extra_tiers":
            base[key] = val
            continue
        if val is None:
            continue
        if not isinstance(val, dict):
            errs.append(f"{key} must be a mapping, got {val!r}")
            continue
        for sub, sval in val.items():
            if sub not in _RULES[key]:
                errs.append(f"unknown key '{key}.{sub}' (valid keys in {key}: {sorted(_RULES[key])})")
            else:
                base.setdefault(key, {})[sub] = sval
    for key in _RULES:
        errs += _section_errors(key, base.get(key, {}), f"missing from {DEFAULT_CONFIG_PATH}")
    extra, extra_errs = _extra_tiers(base.get("extra_tiers", []))
    errs += extra_errs
    for key, rule in _TOP_SCALARS.items():
        e = _check(*rule, base.get(key), key)
        if e:
            errs.append(e)
    ts = base.get("topology", {})
    if ts.get("source") == "file" and not ts.get("file"):
        errs.append("topology.file must name a YAML topology when topology.source is 'file'")
    errs += _check_secret(base.get("remote_tier", {}), errs)
    if errs:
        raise ConfigError(f"invalid flexflow config {source}: " + "; ".join(errs))
    sections = {name: cls(**{k: (tuple(v) if isinstance(v, list) else copy.deepcopy(v) if isinstance(v, dict) else v)
                             for k, v in base[name].items()})
                for name, cls in _SECTION_CLASSES.items()}
    return FlexFlowConfig(selector=SelectorConfig(**base["selector"]), selector_impl=base["selector_impl"],
                          log_level=base["log_level"], extra_tiers=extra,
                          path=None if source == "<defaults>" else source, **sections)


def _section_errors(key: str, values: Mapping[str, Any], missing: str) -> List[str]:
    """The value rules of section `key` over `values` (every key of the section must be there)."""
    errs = []
    for sub, rule in _RULES[key].items():
        if sub not in values:
            errs.append(f"{key}.{sub} {missing}")
            continue
        e = _mapping_error(values[sub], f"{key}.{sub}") if rule[0] == "mapping" else \
            _check(*rule, values[sub], f"{key}.{sub}")
        if e:
            errs.append(e)
    return errs


def _mapping_error(value, key: str) -> Optional[str]:
    """A free-form mapping handed on as given (hicache_storage.extra_config): string keys, and
    bounded, since it is copied into every tier's options."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        return f"{key} = {_short(value)}: must be a mapping with non-empty string keys"
    if len(value) > 256:
        return f"{key}: {len(value)} entries; at most 256"
    return None


def _extra_tiers(value) -> Tuple[Tuple[ExtraTierConfig, ...], List[str]]:
    """`extra_tiers`: a list of {name, factory, options, write_through} mappings (form only: whether a
    name is registered and a factory imports is checked when the connector builds the tier)."""
    from .tiers.registry import is_factory_spec
    if value is None:
        return (), []
    if not isinstance(value, list):
        return (), [f"extra_tiers = {_short(value)}: must be a list of mappings "
                    f"(keys {list(EXTRA_TIER_KEYS)})"]
    out, errs, seen = [], [], {}
    for i, entry in enumerate(value):
        where = f"extra_tiers[{i}]"
        if not isinstance(entry, dict):
            errs.append(f"{where} = {_short(entry)}: must be a mapping with keys {list(EXTRA_TIER_KEYS)}")
            continue
        bad = [k for k in entry if k not in EXTRA_TIER_KEYS]
        for k in bad:
            errs.append(f"unknown key '{where}.{str(k)[:80]}' "
                        f"(valid keys in an extra_tiers entry: {sorted(EXTRA_TIER_KEYS)})")
        name, factory = entry.get("name"), entry.get("factory")
        options = entry.get("options") or {}
        wt = entry.get("write_through", True)
        n0 = len(errs)
        if not isinstance(name, str) or not name:
            errs.append(f"{where}.name = {_short(name)}: must be a non-empty string (a registered tier, "
                        "or the label of a tier built by `factory`)")
        elif name in seen:
            errs.append(f"{where}.name = {name!r}: repeats extra_tiers[{seen[name]}].name")
        else:
            seen[name] = i
        if factory is not None and not is_factory_spec(factory):
            errs.append(f"{where}.factory = {_short(factory)}: must be 'module.path:callable', "
                        "e.g. my_pkg.tiers:make_tier")
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            errs.append(f"{where}.options = {_short(options)}: must be a mapping with string keys")
        e = _check("bool", None, wt, f"{where}.write_through")
        if e:
            errs.append(e)
        if not bad and len(errs) == n0:
            out.append(ExtraTierConfig(name=name, factory=factory, options=copy.deepcopy(options),
                                       write_through=wt))
    return tuple(out), errs


def section_from_options(key: str, options: Mapping[str, Any], where: str):
    """The dataclass of section `key` (e.g. "storage_tier") from `options` over the section's
    defaults, validated by the same rules as the file; ConfigError naming `where` otherwise. For
    tiers built from a mapping (tiers/registry.py factories)."""
    cls = _SECTION_CLASSES[key]
    defaults = {f.name: getattr(cls(), f.name) for f in fields(cls)}
    unknown = sorted(k for k in options if k not in defaults)
    errs = [f"unknown option {k!r} (valid options: {sorted(defaults)})" for k in unknown]
    values = {**defaults, **{k: v for k, v in options.items() if k in defaults}}
    errs += _section_errors(key, values, "missing")
    if errs:
        raise ConfigError(f"{where}: " + "; ".join(errs))
    return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()})


def _check_secret(rt: dict, errs: list) -> list:
    """The secret is read the way the tiers will read it, so `config check` catches a bad file."""
    if errs or not (rt.get("secret_file") or rt.get("keyed_page_keys")):
        return []
    from .tiers.trust import load_secret
    try:
        secret = load_secret(rt.get("secret_file"))
    except ConfigError as e:
        return [f"remote_tier.secret_file: {e}"]
    if secret is None and rt.get("keyed_page_keys"):
        return ["remote_tier.keyed_page_keys = true needs a secret: set remote_tier.secret_file or "
                "$FLEXFLOW_TIER_SECRET / $FLEXFLOW_TIER_SECRET_FILE"]
    return []


def tier_secret(cfg: "FlexFlowConfig") -> Optional[bytes]:
    """The remote tier's shared secret (None: no shared-secret mode)."""
    from .tiers.trust import load_secret
    return load_secret(cfg.remote_tier.secret_file)


def load_config(path: Optional[str] = None) -> FlexFlowConfig:
    """Load and validate a YAML config. `path=None` reads $FLEXFLOW_CONFIG, else the defaults."""
    if path is None:
        path = os.environ.get(ENV_VAR) or None
    if path is None:
        return config_from_dict({}, "<defaults>")
    data = _read_yaml(os.fspath(path), "flexflow config")
    return config_from_dict(data, os.fspath(path))


def build_topology(cfg: FlexFlowConfig):
    """Topology named by the config: discover (NVML + sysfs), a mock, or a YAML file.
    'auto' discovers when a GPU is visible to NVML, otherwise uses the configured mock."""
    from .topology import Topology, discover
    from .topology.mock import make_mock
    tc = cfg.topology
    if tc.source == "file":
        path = tc.file
        if cfg.path and not os.path.isabs(path):
            path = os.path.join(os.path.dirname(cfg.path), path)
        return Topology.from_yaml(path)
    if tc.source == "mock":
        try:
            return make_mock(tc.mock)
        except ValueError as e:
            raise ConfigError(f"topology.mock: {e}") from None
    topo = discover(sysfs_root=cfg.monitor.sysfs_root)
    if tc.source == "discover" or topo.nodes_of_kind("gpu"):
        return topo
    return make_mock(tc.mock)
