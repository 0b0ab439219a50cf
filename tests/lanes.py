"""Two pytest runs sharing one tier, a module at a time (scripts/run_tests.sh, `-p tests.lanes`).

With RL_TEST_CLAIMS set to a directory both runs can see, a run takes a module by creating a file named after it
there (O_EXCL: one of the two wins) before the module's first test, and leaves a module the other run has taken.
The main lane walks the modules in order; the side lane (RL_TEST_LANE=side), done with its own tiers, walks them
from the end, so the two meet somewhere in the middle and neither core idles while the other lane has work left.
The side lane takes a module marked `side_lane_first` (a long one near the end) before the others: the modules
the lanes end on are then short ones, and the lanes end together.
A module that needs the session's vLLM server (the `server` fixture) stays in the main lane: one server per suite.
Without RL_TEST_CLAIMS the plugin does nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MAIN_ONLY_FIXTURES = {"server"}  # a session fixture that would start a second vLLM server in the other lane
FIRST = "side_lane_first"


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


class Lanes:
    def __init__(self, claims: Path, side: bool):
        self.claims, self.side = claims, side
        self.decided: dict[str, bool] = {}  # module -> this run took it
        self.main_only: set[str] = set()

    def mine(self, item: pytest.Item) -> bool:
        module = module_of(item)
        if module not in self.decided:
            if self.side and module in self.main_only:
                self.decided[module] = False
            else:
                name = module.replace("/", "__")
                try:
                    os.close(os.open(self.claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    self.decided[module] = True
                except FileExistsError:
                    self.decided[module] = False
        return self.decided[module]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for i in items:
            if MAIN_ONLY_FIXTURES & set(getattr(i, "fixturenames", ())):
                self.main_only.add(module_of(i))
        if self.side:  # the modules marked side_lane_first, then the rest from the last; tests in their own order
            first = {module_of(i) for i in items if i.get_closest_marker(FIRST)}
            modules = list(dict.fromkeys(map(module_of, items)))
            order = [m for m in modules if m in first] + [m for m in modules[::-1] if m not in first]
            rank = {m: k for k, m in enumerate(order)}
            items.sort(key=lambda i: rank[module_of(i)])  # stable: a module's order is kept

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        return None if self.mine(item) else True  # True: handled, nothing run or reported here

    def pytest_terminal_summary(self, terminalreporter):
        took = sorted(m for m, t in self.decided.items() if t)
        left = len(self.decided) - len(took)
        lane = "side" if self.side else "main"
        terminalreporter.write_line(f"lanes: the {lane} lane ran {len(took)} modules, left {left} to the other lane")
        if self.side:
            for m in took:
                terminalreporter.write_line(f"  {m}")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{FIRST}: the side lane of make test takes this module first (tests/lanes.py)")
    claims = os.environ.get("RL_TEST_CLAIMS")
    if claims:
        config.pluginmanager.register(Lanes(Path(claims), os.environ.get("RL_TEST_LANE") == "side"), "lanes")
