import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
# Child processes (tier servers, SGLang's own NIXL PD agents) inherit this: with libibverbs1
# installed and no RDMA device, NIXL's bundled UCX segfaults at exit (tiers/base.py says why).
from flexflow_sglang.tiers.base import skip_ucx_rdma_modules_without_devices  # noqa: E402

skip_ucx_rdma_modules_without_devices()
