"""``python -m dgr parity|models ...`` hands every argument, options included, to the tool's
own parser (argparse.REMAINDER would drop a leading --option)."""

from __future__ import annotations

import pytest

from dgr.cli import commands


def test_tool_options_reach_the_tools_parser(capsys):
    with pytest.raises(SystemExit) as e:
        commands.main(["parity", "--splits", "10,20", "--help"])
    assert e.value.code == 0
    assert "python -m dgr parity" in capsys.readouterr().out


def test_models_list_runs_through_python_m_dgr(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DGR_STORE", str(tmp_path))
    assert commands.main(["models", "list"]) == 0
    assert "smollm2-135m-instruct-q4_1" in capsys.readouterr().out


def test_the_tools_are_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        commands.main(["--help"])
    out = capsys.readouterr().out
    assert "parity" in out and "models" in out
