"""Flow-level topology simulator: does routing KV transfers around congested links pay?

Drives the project's real `Topology`, `PathSelector` and `NodeAgent` over a max-min fair
flow-level network model with background inference traffic. Entry point:
`python -m flexflow_sglang.tools.sim.study --out DIR [--quick]` (also `flexflow bench simulate`).
See docs/simulation.md.
"""

from .engine import BgFlow, BgGroup, Network, Plan, SimParams, Simulator, SubPlan, TransferRecord
from .maxmin import max_min_rates
from .sim_agent import SimMonitor
from .policies import OraclePolicy, SelectorPolicy
from .scenario_runner import DEFAULT_POLICIES, MonitorSettings, run_policy, run_scenario
from .scenarios import LOADS, MACHINES, PAYLOADS_MIB, Scenario

__all__ = ["BgFlow", "BgGroup", "Network", "Plan", "SimParams", "Simulator", "SubPlan", "TransferRecord",
           "max_min_rates", "SimMonitor", "OraclePolicy", "SelectorPolicy", "DEFAULT_POLICIES", "MonitorSettings",
           "run_policy", "run_scenario", "LOADS", "MACHINES", "PAYLOADS_MIB", "Scenario"]
