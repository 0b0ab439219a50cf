"""The one-line error of every command (runtime/cli.py): under torchrun, an error every rank meets alike is printed
by one rank per node."""

from __future__ import annotations

import pytest

from rl_training.base.errors import UserError
from rl_training.config.schema import ConfigError
from rl_training.runtime.cli import exit_status_of


def fail(e: Exception):
    def run():
        raise e

    return run


@pytest.mark.parametrize("local_rank, printed", [(None, True), ("0", True), ("1", False)])
def test_a_config_error_is_printed_by_the_first_rank_of_a_node(local_rank, printed, monkeypatch, capsys):
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert exit_status_of(fail(ConfigError("task.name='x.py:X': no such file"))) == 2
    assert capsys.readouterr().err == ("error: task.name='x.py:X': no such file\n" if printed else "")


def test_an_error_that_may_be_one_ranks_own_is_printed_by_every_rank(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert exit_status_of(fail(UserError("checkpoint step_000004 is corrupt"))) == 2
    assert capsys.readouterr().err == "error: checkpoint step_000004 is corrupt\n"
