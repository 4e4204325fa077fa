"""The load model of docs/scale.md (``chaos/bench/_scalemodel.py``): its formulas behave as the page says.

``fleetward bench scale`` measures the units; these tests hold the arithmetic to what it claims, on any
workload and any units (hypothesis), so a formula that stops growing with the fleet, or a design that
stops being compared fairly, fails here.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetward.chaos.bench import _scalemodel as model

workloads = st.builds(model.Workload, servers_per_host=st.integers(1, 16), streams_per_server=st.integers(1, 256),
                      tokens_per_s_per_stream=st.floats(1, 200), prompt_tokens=st.integers(1, 32000),
                      output_tokens=st.integers(1, 8000))
units = st.builds(model.Units, router_cpu_s_per_token=st.floats(5e-6, 2e-4),
                  checkpoint_delta_fixed_bytes=st.floats(50, 500), checkpoint_delta_bytes_per_token=st.floats(4, 40),
                  controller_cores_per_worker=st.floats(0, 1e-3), series_per_router=st.floats(10, 1000))


@settings(max_examples=200, deadline=None)
@given(workloads, units, st.sampled_from(model.DESIGNS))
def test_no_load_shrinks_as_the_fleet_grows(w: model.Workload, u: model.Units, design: str) -> None:
    before = model.loads(w, u, 10, design)
    for hosts in model.HOSTS[1:]:
        now = model.loads(w, u, hosts, design)
        for name, load in now.items():
            if name in ("router_cpu_cores", "router_memory_bytes"):
                continue  # per router: routers are added as the fleet grows
            assert load >= before[name] * (1 - 1e-9), (name, hosts)
        before = now


@settings(max_examples=200, deadline=None)
@given(workloads, units)
def test_routers_are_sized_so_none_runs_past_its_core(w: model.Workload, u: model.Units) -> None:
    for hosts in model.HOSTS:
        assert model.loads(w, u, hosts)["router_cpu_cores"] <= max(w.router_cpu_target, 1e-9) * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(workloads, units)
def test_only_the_peer_design_keeps_etcd_writes_flat_as_tokens_per_second_grow(w: model.Workload,
                                                                                 u: model.Units) -> None:
    slow, fast = replace(w, tokens_per_s_per_stream=5.0), replace(w, tokens_per_s_per_stream=50.0)
    peer = [model.loads(x, u, 1000, "peer")["etcd_bytes_per_s"] for x in (slow, fast)]
    today = [model.loads(x, u, 1000, "etcd")["etcd_bytes_per_s"] for x in (slow, fast)]
    assert peer[1] == peer[0]
    assert today[1] > today[0]


def test_sharding_divides_the_checkpoint_load_and_nothing_else() -> None:
    w, u = model.Workload(), model.Units()
    one = model.loads(replace(w, shards=1), u, 1000, "etcd-sharded")
    four = model.loads(replace(w, shards=4), u, 1000, "etcd-sharded")
    assert one == model.loads(w, u, 1000, "etcd")
    assert four["etcd_bytes_per_s"] < one["etcd_bytes_per_s"] / 3
    assert four["controller_cpu_cores"] == one["controller_cpu_cores"]


def test_the_table_has_every_size_and_resource_and_names_the_first_to_cross() -> None:
    tab = model.table(model.Workload(), model.Units(), "etcd")
    assert list(tab) == ["10", "100", "1000", "10000"]
    assert all(set(size) == set(model.LIMITS) for size in tab.values())
    first = model.first_over(tab)
    assert first is not None
    smaller = [h for h in tab if int(h) < first["hosts"]]
    assert all(row["load"] <= row["limit"] for h in smaller for row in tab[h].values())
    worst = first["resources"][0]
    row = tab[str(first["hosts"])][worst["resource"]]
    assert worst["times_limit"] == row["load"] / row["limit"] > 1
    assert model.first_over({"10": {"x": {"load": 1, "limit": 2, "unit": "u"}}}) is None
