"""The cost report ``./dev test`` prints at the end (tests/costreport.py): per folder, then the slowest tests."""

from __future__ import annotations

from costreport import folder, report_lines


def test_a_test_counts_in_its_folder_and_the_folders_come_most_expensive_first() -> None:
    cost = {"tests/vllm/test_a.py::test_x": 90.0, "tests/vllm/test_b.py::test_y[p]": 30.0,
            "tests/fleet/test_c.py::test_z": 60.0, "tests/fleet/sub/test_d.py::test_w": 20.0}
    lines = report_lines(cost, wall_s=210.0, slowest=2)
    assert lines[0] == "tests: 200 s in 4 test(s), 210 s wall"
    assert lines[1] == "per folder:"
    rows = [line.split() for line in lines[2:5]]
    assert [(r[0], r[1], r[3], r[5]) for r in rows] == [("tests/vllm", "120.0", "60.0", "2"),
                                                        ("tests/fleet", "60.0", "30.0", "1"),
                                                        ("tests/fleet/sub", "20.0", "10.0", "1")]
    assert lines[5] == "the 2 slowest:"
    assert [line.split()[-1] for line in lines[6:]] == ["tests/vllm/test_a.py::test_x", "tests/fleet/test_c.py::test_z"]


def test_nothing_run_reports_nothing_and_a_top_level_module_is_its_own_folder() -> None:
    assert report_lines({}, wall_s=3.0) == []
    assert folder("test_top.py::test_x") == "."
    assert report_lines({"a.py::t": 1.0}, wall_s=1.0)[-2:] == ["the 1 slowest:", "      1.0 s  a.py::t"]
