"""Config files: every bad value is reported with the file, the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetward.fleet.config import FleetConfig, load_fleet_config
from fleetward.fleet.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def test_a_valid_file_sets_fields_and_flags_override_it(tmp_path: Path) -> None:
    path = write(tmp_path, "cluster: prod\nworkers: 5\nsim:\n  decode_step_ms: 30\n")
    config = load_fleet_config(path, {"workers": 2})
    assert config.cluster == "prod"
    assert config.workers == 2
    assert config.sim.decode_step_ms == 30


def test_a_flag_for_one_key_of_a_section_keeps_the_sections_other_keys(tmp_path: Path) -> None:
    """`--router-port` sets routing.port; the file's other routing keys stay."""
    from fleetward.cli.main import _fleet_config, _parser

    path = write(tmp_path, "routing:\n  port: 8100\n  migration_limit: 5\nvllm:\n  dtype: bfloat16\n")
    from_file = _fleet_config(_parser().parse_args(["up", "--config", str(path)]))
    assert (from_file.routing.port, from_file.routing.migration_limit) == (8100, 5)
    flagged = _fleet_config(_parser().parse_args(["up", "--config", str(path), "--router-port", "8200",
                                                  "--model", "/m"]))
    assert (flagged.routing.port, flagged.routing.migration_limit) == (8200, 5)
    assert (flagged.vllm.model, flagged.vllm.dtype) == ("/m", "bfloat16")
    with pytest.raises(ConfigError, match=r"routing\.port"):
        _fleet_config(_parser().parse_args(["up", "--router-port", "70000"]))


def test_an_unknown_key_names_file_line_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "cluster: prod\nsim:\n  decode_step_ms: 30\n  decode_stepp_ms: 31\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    err = info.value
    assert (err.file, err.line, err.field) == (str(path), 4, "sim.decode_stepp_ms")
    assert str(err).startswith(f"{path}:4: sim.decode_stepp_ms: unknown field")


def test_a_bad_value_names_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "cluster: prod\n\nworkers: -3\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    assert info.value.line == 3
    assert info.value.field == "workers"
    assert "greater than or equal to 0" in str(info.value)


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "workers: lots\nbackend: tpu\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    message = str(info.value)
    assert "2 problems" in message
    assert "line 1: workers" in message and "line 2: backend" in message


def test_broken_yaml_is_a_config_error_with_a_line(tmp_path: Path) -> None:
    path = write(tmp_path, "cluster: prod\nsim: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_fleet_config(path)
    assert info.value.file == str(path)
    assert info.value.line is not None
    assert "not valid YAML" in str(info.value)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_fleet_config(tmp_path / "nope.yaml")


def test_a_top_level_list_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_fleet_config(write(tmp_path, "- a\n- b\n"))


def test_endpoints_must_be_host_and_port() -> None:
    with pytest.raises(ConfigError) as info:
        load_fleet_config(None, {"etcd": "localhost"})
    assert info.value.field == "etcd"
    assert "expected host:port" in str(info.value)


def test_every_up_flag_is_a_config_field() -> None:
    from fleetward.cli.main import _UP_FIELDS

    assert set(_UP_FIELDS) <= set(FleetConfig.model_fields)


def test_the_config_is_frozen() -> None:
    config = FleetConfig()
    with pytest.raises(Exception, match="frozen"):
        config.workers = 7  # type: ignore[misc]


def test_the_reference_page_is_what_the_models_say() -> None:
    """docs/config.md is generated from the models: a field added or changed without regenerating it fails."""
    from fleetward.fleet.configref import PAGE, render

    assert PAGE.read_text() == render(), "regenerate it: python -m fleetward.fleet.configref --write"
    assert "| `routing` |" in render() and "| `port` | int | `0` | ≥ 0, ≤ 65535 |" in render()


def test_every_key_says_what_it_means() -> None:
    from pydantic import BaseModel

    from fleetward.fleet import config

    models = [m for m in vars(config).values() if isinstance(m, type) and issubclass(m, config.Frozen)
              and m is not config.Frozen and issubclass(m, BaseModel)]
    undescribed = [f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not f.description]
    assert undescribed == []
