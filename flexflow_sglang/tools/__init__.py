"""Tools on top of the serving library: the `flexflow` CLI, benchmarks, the simulator and the
contention/PD labs, verify_outputs, the quickstart, server helpers, CPU stand-ins and prompt data.
The library (everything else under flexflow_sglang) never imports this package
(tests/packaging/test_import_graph.py checks it)."""
