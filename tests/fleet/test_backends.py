"""Backends answer what their workers can do; routing policies are chosen by name in the config."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from fleetward.fleet.backends import BACKENDS, SimBackend, VllmBackend, backend_capabilities, make_backend
from fleetward.fleet.config import RouterConfig, SimConfig, VllmConfig
from fleetward.fleet.errors import ConfigError
from fleetward.fleet.procs import spread_cores
from fleetward.fleet.worker import WorkerSpec
from fleetward.migration.policy import POLICIES, LeastLoaded, LeastLoadedAffinity, make_policy, prefix_key, rendezvous


def test_the_simulated_worker_has_fault_switches_and_a_known_model() -> None:
    sim = SimBackend(SimConfig(seed=7, eos_probability=0.1, model_name="m"))
    assert sim.fault_switches and "model_reference" in sim.capabilities
    assert sim.reference() == {"kind": "model", "seed": 7, "eos_probability": 0.1}
    assert (sim.model_name, sim.max_model_len) == ("m", SimConfig().max_model_len)
    assert SimBackend(SimConfig(tokenizer="bpe")).reference()["vocab_size"] == 4096  # type: ignore[index]


def test_a_simulated_workers_tokenizer_path_is_resolved_before_it_runs_in_its_log_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    sim = SimBackend(SimConfig(tokenizer="models/tok/tokenizer.json"))
    argv = sim.argv(WorkerSpec(id="w0", host="127.0.0.1", port=1, model="m"))
    sent = SimConfig.model_validate_json(argv[argv.index("--config-json") + 1])
    assert sent.tokenizer == sim.tokenizer == str(tmp_path.resolve() / "models" / "tok" / "tokenizer.json")


def test_vllm_has_neither_and_serves_the_tiny_model_by_default(tmp_path: Path) -> None:
    vllm = VllmBackend(VllmConfig(max_model_len=1024), run_dir=tmp_path)
    assert not vllm.fault_switches and vllm.reference() is None
    assert vllm.model_path == (tmp_path / "models" / "tiny-bpe-seed0").resolve()
    byte = VllmBackend(VllmConfig(tokenizer="byte"), run_dir=tmp_path)
    assert byte.model_path == (tmp_path / "models" / "tiny-seed0").resolve()
    assert VllmBackend(VllmConfig(), run_dir=tmp_path).tokenizer == str(vllm.model_path)
    assert (vllm.model_name, vllm.max_model_len) == ("tiny", 1024)
    named = VllmBackend(VllmConfig(model=str(tmp_path / "my-model")))
    assert named.model_name == "my-model" and named.model_path.is_absolute()


def test_a_vllm_backend_without_a_model_folder_says_how_to_make_one(tmp_path: Path) -> None:
    vllm = VllmBackend(VllmConfig(), tmp_path / "nothing-here")
    with pytest.raises(ConfigError, match="fleetward model tiny") as info:
        vllm.launch(WorkerSpec(id="w0", host="127.0.0.1", port=1, model="tiny"), tmp_path)
    assert info.value.field == "vllm.model"


def test_backends_are_made_by_name_and_an_unknown_one_is_named() -> None:
    assert isinstance(make_backend("sim"), SimBackend)
    assert isinstance(make_backend("vllm"), VllmBackend)
    assert {k: backend_capabilities(k) for k in BACKENDS} == {k: cls.capabilities for k, cls in BACKENDS.items()}
    with pytest.raises(ConfigError, match="sim or vllm") as info:
        make_backend("trtllm")
    assert info.value.field == "backend"


def test_the_config_offers_exactly_the_registered_routing_policies() -> None:
    offered = typing.get_args(RouterConfig.model_fields["policy"].annotation)
    assert set(offered) == set(POLICIES)
    assert isinstance(make_policy(RouterConfig().policy, slack=4), LeastLoadedAffinity)


def test_least_loaded_ignores_the_prompt_and_affinity_follows_it_until_the_slack_runs_out() -> None:
    workers = ["w0", "w1", "w2"]
    key = prefix_key([40, 41, 42])
    preferred = rendezvous(workers, key)
    assert rendezvous(list(reversed(workers)), key) == preferred, "the order of the candidates does not matter"
    idle = dict.fromkeys(workers, 0)
    assert LeastLoaded().choose(workers, idle, key) == "w0"
    assert LeastLoadedAffinity(slack=2).choose(workers, idle, key) == preferred
    busy = {**idle, preferred: 3}
    assert LeastLoadedAffinity(slack=2).choose(workers, busy, key) != preferred


def test_each_vllm_cpu_worker_binds_its_own_cores_unless_the_config_says_otherwise(tmp_path: Path) -> None:
    # vLLM's default binds every CPU server on a host to the same cores; one starting beside a busy one then
    # got almost no CPU on this 2-core machine (still loading after 600 s). Each gets its own by default.
    cores = spread_cores(2, [0, 1])
    specs = [WorkerSpec(id=f"w{i}", host="127.0.0.1", port=1, model="tiny", cpus=c) for i, c in enumerate(cores)]
    spread = VllmBackend(VllmConfig(), run_dir=tmp_path)
    assert [spread.env(s)["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == ["0", "1"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in spread.env(WorkerSpec(id="x", host="127.0.0.1", port=1, model="m"))
    for given in ("auto", "nobind", "0-3|4-7"):
        assert VllmBackend(VllmConfig(cpu_binding=given), run_dir=tmp_path).env(specs[1])[
            "VLLM_CPU_OMP_THREADS_BIND"] == given
    with pytest.raises(ValueError, match="cpu_binding"):
        VllmConfig(cpu_binding="core zero")


def test_cores_are_spread_so_no_two_workers_share_one_while_there_are_enough() -> None:
    assert spread_cores(1, [0, 1]) == [(0,)]  # as vLLM's auto: one core left to the rest
    assert spread_cores(2, [0, 1]) == [(0,), (1,)]
    assert spread_cores(3, [0, 1]) == [(0,), (1,), (0,)]  # more workers than cores: in turn
    assert spread_cores(2, [4, 5, 6, 7, 8]) == [(4, 5), (6, 7)]  # 8 is left to the rest
    wide = spread_cores(3, range(64))
    assert sorted(c for w in wide for c in w) == list(range(63)) and {len(w) for w in wide} == {21}
    assert spread_cores(0) == [] and len(spread_cores(2)) == 2  # this host's own cores
