"""Max-min fair allocation on hand-computable cases."""

import math

import numpy as np
import pytest

from flexflow_sglang.tools.sim.maxmin import max_min_rates

INF = math.inf


def test_two_flows_one_link_share_equally():
    r = max_min_rates([[0], [0]], [INF, INF], [10.0])
    assert r == pytest.approx([5.0, 5.0])


def test_single_flow_gets_the_bottleneck_of_its_path():
    r = max_min_rates([[0, 1, 2]], [INF], [10.0, 4.0, 7.0])
    assert r == pytest.approx([4.0])


def test_bottleneck_chain():
    # resources A=0 (cap 10), B=1 (cap 4); f0 crosses A and B, f1 only A, f2 only B.
    # B is the bottleneck of f0 and f2 (2 each); f1 takes what A has left: 10 - 2 = 8.
    r = max_min_rates([[0, 1], [0], [1]], [INF, INF, INF], [10.0, 4.0])
    assert r == pytest.approx([2.0, 8.0, 2.0])


def test_parking_lot():
    # three links of cap 1 in a row; one long flow over all three, one short flow per link:
    # every link is shared by two flows -> 0.5 each
    r = max_min_rates([[0, 1, 2], [0], [1], [2]], [INF] * 4, [1.0, 1.0, 1.0])
    assert r == pytest.approx([0.5] * 4)


def test_demand_cap_below_fair_share_is_respected_and_leftover_reused():
    r = max_min_rates([[0], [0]], [3.0, INF], [10.0])
    assert r == pytest.approx([3.0, 7.0])


def test_demand_above_fair_share_is_cut_to_the_fair_share():
    # an inference flow wanting 85 of 100 next to an elastic KV flow: both get 50
    r = max_min_rates([[0], [0]], [85.0, INF], [100.0])
    assert r == pytest.approx([50.0, 50.0])


def test_all_demand_capped_leaves_capacity_unused():
    r = max_min_rates([[0], [0]], [1.0, 2.0], [10.0])
    assert r == pytest.approx([1.0, 2.0])


def test_allocation_is_feasible_and_max_min_on_random_cases():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n_res, n = 6, 8
        cap = rng.uniform(1, 10, n_res)
        flows = [sorted(rng.choice(n_res, size=rng.integers(1, 4), replace=False).tolist()) for _ in range(n)]
        demand = np.where(rng.random(n) < 0.5, rng.uniform(0.1, 5, n), INF)
        r = max_min_rates(flows, demand, cap)
        load = np.zeros(n_res)
        for f, x in zip(flows, r):
            load[f] += x
        assert (load <= cap * (1 + 1e-9)).all()
        assert (r <= demand * (1 + 1e-9)).all()
        # every flow is either at its demand or crosses a saturated link where it has the largest rate
        for i, f in enumerate(flows):
            if r[i] >= demand[i] * (1 - 1e-9):
                continue
            sat = [l for l in f if load[l] >= cap[l] * (1 - 1e-9)]
            assert sat, f"flow {i} is neither demand-capped nor bottlenecked"
            assert any(all(r[i] >= r[j] * (1 - 1e-9) for j, g in enumerate(flows) if l in g) for l in sat)


def test_rejects_a_flow_without_resources():
    with pytest.raises(ValueError):
        max_min_rates([[]], [INF], [1.0])
