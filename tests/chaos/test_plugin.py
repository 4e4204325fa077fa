"""The pytest plugin: opt-in, experiment files collected as tests, the root marker, and the fixtures.

Inner runs opt in as a user does: ``-p fleetward.chaos.plugin`` on the command line, or
``pytest_plugins = ["fleetward.chaos.plugin"]`` in a conftest.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import matplotlib.pyplot
import pytest

# In-process inner runs restore sys.modules afterwards: what the inner experiments import for their reports
# must be loaded out here first, or it is imported again later (numpy warns when it is).
assert matplotlib.pyplot

pytest_plugins = ["pytester"]


PLUGIN = ("-p", "fleetward.chaos.plugin")


@pytest.fixture
def px(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester whose inner runs are configured like ours (pytest-asyncio's loop scope set)."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    return pytester


def test_the_plugin_is_loaded_only_when_asked_for(px: pytest.Pytester) -> None:
    px.makefile(".yaml", chaos_smoke="title: never collected without the plugin\n")
    px.makepyfile("def test_uses_a_fixture(fleetward_gpu):\n    pass\n")
    result = px.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'fleetward_gpu' not found*"])
    px.makeconftest('pytest_plugins = ["fleetward.chaos.plugin"]\n')
    result = px.runpytest_inprocess("-p", "no:cacheprovider", "--co", "-q")
    result.stdout.fnmatch_lines(["*chaos_smoke.yaml::chaos_smoke*"])

SMOKE = """\
title: smoke
seed: 2
fleet:
  workers: 2
  sim: {decode_step_ms: 3, decode_ms_per_seq: 0.05, prefill_ms_per_token: 0.01, seed: 2}
workload:
  duration_s: 2
  arrival: {kind: poisson, rate: 8}
  isl: 8
  osl: 12
method:
  - {fault: load.burst, at: 0.5, params: {count: 5}}
checkers: [stream_exactness, availability, fault_verification]
"""


def test_a_yaml_experiment_is_collected_and_passes_as_a_test(px: pytest.Pytester, etcd_endpoint: str,
                                                             broker_endpoint: str) -> None:
    px.makefile(".yaml", chaos_smoke=SMOKE, not_an_experiment="title: ignored\n")
    out = px.path / "runs"
    result = px.runpytest_inprocess(*PLUGIN, "--fleetward-etcd", etcd_endpoint, "--fleetward-mqtt", broker_endpoint,
                                    "--fleetward-chaos-out", str(out), "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*chaos_smoke.yaml::chaos_smoke PASSED*"])
    (run,) = out.iterdir()
    assert (run / "journal.json").exists() and (run / "report.html").exists()


def test_a_failing_yaml_experiment_fails_naming_its_verdicts_and_run_folder(px: pytest.Pytester,
                                                                             etcd_endpoint: str,
                                                                             broker_endpoint: str) -> None:
    # A TTFT limit no fleet meets: the availability checker fails, so the test does.
    px.makefile(".yaml", chaos_strict=SMOKE.replace(
        "checkers: [stream_exactness, availability, fault_verification]",
        "checkers: [{name: availability, params: {max_ttft_p99_s: 0.000001}}]"))
    result = px.runpytest_inprocess(*PLUGIN, "--fleetward-etcd", etcd_endpoint, "--fleetward-mqtt", broker_endpoint,
                                    "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*experiment 'smoke' did not pass:*", "*availability: fail: *ttft_p99_s*",
                                 "*run folder: *report.html*"])


def test_a_bad_yaml_experiment_is_a_collection_error_naming_file_line_and_field(px: pytest.Pytester) -> None:
    px.makefile(".yaml", chaos_bad="title: bad\nfleet:\n  workerz: 2\n")
    result = px.runpytest_inprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*chaos_bad.yaml:3: fleet.workerz: unknown field*"])


def test_a_test_needing_root_skips_with_a_reason_when_not_root(px: pytest.Pytester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    px.makepyfile("""
        import pytest

        @pytest.mark.root
        def test_needs_root():
            raise AssertionError("ran without root")

        @pytest.mark.fleetward_chaos
        def test_a_scenario():
            pass
    """)
    result = px.runpytest_inprocess(*PLUGIN, "-rs", "--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*needs root (this test run is not root)*"])


def test_the_plugins_own_etcd_and_broker_fixtures_serve_a_session(px: pytest.Pytester) -> None:
    px.makepyfile("""
        import asyncio

        from fleetward.fleet.bus import MqttBus
        from fleetward.fleet.etcd import EtcdStore


        def test_they_answer(fleetward_etcd, fleetward_mqtt):
            async def use():
                async with EtcdStore(fleetward_etcd) as store:
                    await store.put("/probe", b"1")
                    assert (await store.get("/probe")).value == b"1"
                bus = await MqttBus(fleetward_mqtt, "probe").start()
                await bus.aclose()

            asyncio.run(use())
    """)
    px.makeconftest('pytest_plugins = ["fleetward.chaos.plugin"]\n')
    result = px.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


async def test_the_fleet_and_proxy_fixtures_give_working_parts(fleetward_fleet: Any, fleetward_proxy: Any) -> None:
    import httpx

    from fleetward.fleet.backends import SimBackend
    from fleetward.fleet.config import SimConfig

    async with fleetward_fleet(workers=1, backend=SimBackend(SimConfig(decode_step_ms=2))) as fleet:
        (worker,) = fleet.worker_ids
        host, _, port = fleet.bind_url(worker).removeprefix("http://").rpartition(":")
        async with fleetward_proxy("client->worker", (host, int(port)), http=True) as proxy, \
                httpx.AsyncClient(trust_env=False) as client:
            r = await client.post(f"{proxy.url}/v1/completions",
                                  json={"model": "sim-tiny", "prompt": [40, 41], "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_the_gpu_fixture_gives_a_fake_source(fleetward_gpu: Any) -> None:
    source = fleetward_gpu(2)
    assert source is not None


def test_an_async_test_using_the_fixtures_that_nothing_runs_fails_saying_what_to_add(px: pytest.Pytester) -> None:
    px.makepyfile("""
        import pytest


        async def test_unmarked(fleetward_fleet):
            raise AssertionError("never runs")


        @pytest.mark.asyncio
        async def test_marked(fleetward_gpu):
            assert fleetward_gpu(1) is not None
    """)
    result = px.runpytest_inprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)  # before its fixtures start: no etcd for nothing
    result.stdout.fnmatch_lines(['*test_unmarked is an async def test (it uses fleetward_fleet) and nothing runs it: '
                                 'mark it @pytest.mark.asyncio, or set asyncio_mode = "auto"*'])


DOCS = Path(__file__).resolve().parents[2] / "docs" / "chaos.md"


def doc_example() -> dict[str, str]:
    """The files of docs/chaos.md's "A complete example": each fenced block there, named by its title."""
    section = DOCS.read_text(encoding="utf-8").split("\n### A complete example\n", 1)[1]
    section = re.split(r"^##+ ", section, maxsplit=1, flags=re.M)[0]
    return {m["name"]: m["body"] for m in re.finditer(r'^```\w+ title="(?P<name>[^"]+)"\n(?P<body>.*?)^```$',
                                                      section, flags=re.M | re.S)}


def test_the_complete_example_in_the_docs_runs_as_written(pytester: pytest.Pytester) -> None:
    files = doc_example()
    assert {"pyproject.toml", "conftest.py"} <= set(files) and len(files) >= 4, sorted(files)
    for name, body in files.items():
        (pytester.path / name).write_text(body, encoding="utf-8")
    result = pytester.runpytest_inprocess("-v")
    outcomes = result.parseoutcomes()
    assert result.ret == 0 and outcomes.get("passed", 0) >= 3 and set(outcomes) <= {"passed"}, result.stdout.str()
    result.stdout.fnmatch_lines(["*asyncio: mode=*STRICT*asyncio_default_fixture_loop_scope=function*",
                                 "*chaos_*.yaml::* PASSED*", "*test_*.py::test_* PASSED*"])
