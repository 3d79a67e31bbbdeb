"""Prefill/decode disaggregation: SGLang's NIXL PD KV transfers routed over rails by the selector.

- ``hooks``: the HookRegistry AROUND hook on ``get_kv_class`` (installed by the plugin).
- ``nixl_manager``: FlexFlowNixlKVManager (host-memory KV pools, rail agents, routed chunks).
- ``rails``: rail topology, RailRouter (PathSelector + NodeAgent on the rails' counters).
- ``router``: a minimal PD request router (prefill + decode, bootstrap rooms) for tests and benches.
"""
