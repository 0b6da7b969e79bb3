"""Unknown names get the closest known ones (application/close_names.py)."""

from __future__ import annotations

from application.close_names import MAX_SUGGESTIONS, closest_names, suggestion

NODES = ["gpu-box-1", "gpu-box-2", "cpu-box", "laptop", "GPU-Box-10", "nas", "printer"]


def test_the_closest_names_come_first_case_aside() -> None:
    assert closest_names("gpu-box1", NODES)[0] == "gpu-box-1"
    assert closest_names("LAPTOP", NODES) == ["laptop"]
    assert len(closest_names("gpu-box", NODES)) == MAX_SUGGESTIONS


def test_a_refusal_lists_the_closest_in_one_line() -> None:
    assert suggestion("node", "laptp", NODES) == "; closest known: laptop"
    assert "\n" not in suggestion("node", "gpu", NODES)


def test_with_nothing_close_few_names_are_all_listed_and_many_are_not() -> None:
    assert suggestion("model", "zzz", ["tiny", "qwen"]) == "; known: qwen, tiny"
    assert suggestion("node", "zzzzzz", NODES) == ""


def test_none_known_says_so() -> None:
    assert suggestion("node", "gpu-1", []) == "; no node is known yet"
