"""A Mooncake Store master on loopback for tests (`flexflow_sglang.tools.mooncake_master`).

`need_mooncake()` skips with the reason when the package, its binary or libibverbs is missing.
`MooncakeMaster(tmp_path)` picks free loopback ports; `start()`, `kill()` (SIGKILL: what a crashed
master looks like) and `start()` again on the same ports (a restarted master: empty metadata)."""

from __future__ import annotations

import pytest

from flexflow_sglang.tools.mooncake_master import MooncakeMaster, master_binary, mooncake_missing

__all__ = ["MooncakeMaster", "master_binary", "need_mooncake"]


def need_mooncake() -> None:
    """Skip (with the reason) unless the Mooncake store can be imported and its master started."""
    why = mooncake_missing()
    if why:
        pytest.skip(f"{why}; install it with apt-get install libibverbs1 && pip install -c "
                    ".ci/constraints-cpu.txt mooncake-transfer-engine-non-cuda (or .ci/setup-cpu.sh)")
