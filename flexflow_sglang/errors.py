"""Exception types. Messages name the offending key, value, path, rank or peer."""


class FlexFlowError(Exception):
    """Base class for all flexflow_sglang errors."""


class ConfigError(FlexFlowError, ValueError):
    """A configuration file or value is invalid (raised once, at load time)."""


class TopologyError(FlexFlowError, ValueError):
    """A topology description is inconsistent (unknown node, duplicate link, ...)."""


class SelectorError(FlexFlowError):
    """The path selector cannot serve a request (unknown endpoints, no path)."""


class TransferError(FlexFlowError):
    """A KV transfer failed or its data did not verify. The cache treats it as a miss."""


class CompiledCoreMissing(FlexFlowError, ImportError):
    """FLEXFLOW_REQUIRE_COMPILED=1 but the Cython selector core is not importable."""
