"""Target selectors resolve to ids inside the fleet, never outside it (one resolver for every caller)."""

from __future__ import annotations

import random

import pytest

from fleetward.chaos.fault import Target
from fleetward.chaos.targets import TargetError, resolve

WORKERS = ["node-w0", "node-w1", "node-w2"]


def rng() -> random.Random:
    return random.Random(3)


def test_ids_and_globs_name_members_and_anything_else_is_refused() -> None:
    assert resolve(Target(kind="worker", ids=("node-w1",)), WORKERS, rng=rng()) == ["node-w1"]
    assert resolve(Target(kind="link", ids=("*->etcd",)), ["a->etcd", "b->etcd", "a->broker"],
                   rng=rng()) == ["a->etcd", "b->etcd"]
    with pytest.raises(TargetError, match="node-w9 not in the fleet"):
        resolve(Target(kind="worker", ids=("node-w9",)), WORKERS, rng=rng())


def test_picks_take_all_the_first_the_busiest_or_a_seeded_sample() -> None:
    assert resolve(Target(kind="worker", pick="all"), WORKERS, rng=rng()) == WORKERS
    assert resolve(Target(kind="worker", pick="first", count=2), WORKERS, rng=rng()) == ["node-w0", "node-w1"]
    load = {"node-w2": 5, "node-w0": 1}
    assert resolve(Target(kind="worker", pick="serving"), WORKERS, rng=rng(), load=load) == ["node-w2"]
    assert resolve(Target(kind="worker", pick="serving"), WORKERS, rng=rng()) == ["node-w0"]
    once = resolve(Target(kind="worker", pick="random", count=2), WORKERS, rng=rng())
    assert once == resolve(Target(kind="worker", pick="random", count=2), WORKERS, rng=rng())


def test_busy_ids_are_passed_over_while_others_remain() -> None:
    first = Target(kind="worker", pick="first")
    assert resolve(first, WORKERS, rng=rng(), busy={"node-w0"}) == ["node-w1"]
    assert resolve(first, WORKERS, rng=rng(), busy=set(WORKERS)) == ["node-w0"]


def test_asking_for_more_than_the_fleet_has_is_refused() -> None:
    with pytest.raises(TargetError, match="has 3 worker"):
        resolve(Target(kind="worker", pick="random", count=4), WORKERS, rng=rng())
    with pytest.raises(TargetError, match="no router"):
        resolve(Target(kind="router"), [], rng=rng())
    assert resolve(Target(kind="kv", ids=("kv",)), None, rng=rng()) == ["kv"]
    with pytest.raises(TargetError, match="name them"):
        resolve(Target(kind="kv"), None, rng=rng())
