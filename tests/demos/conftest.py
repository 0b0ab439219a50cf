"""The demos tier's order: the demos marked leaves_a_core first. Their first minutes hold one core only (the search
demo's SFT stages: one rank, one thread, docs/search.md), and `make test-demos` runs the one_core demos on the other
core meanwhile (scripts/run_tests.sh); pytest's own order (by file name) would start with the async demo, whose
server and trainer take both cores."""

from __future__ import annotations


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("leaves_a_core") is None)  # stable: the rest keep their order
