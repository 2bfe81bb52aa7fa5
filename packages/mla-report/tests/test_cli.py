"""``mla-report``'s command line: help, version, and ``--out`` checked before any work."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

import mla_report
from mla_report import main
from mla_report import report as report_module


def _no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("a kernel ran: the bad option was not caught first")


def test_help_is_plain_text_with_every_option_and_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: mla-report")
    # no reST markup: ``literal``, :role:`x`, `x`_ links, .. directives
    assert not re.search(r"``|:\w+:`|`_|^\.\. ", text, re.MULTILINE), text
    parser = report_module.build_parser()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        assert action.help, f"{action.option_strings} has no help"
    flat = " ".join(text.split())
    for shown in ("(default: 0)", "(default: report)", "(default: cuda if present, else cpu)"):
        assert shown in flat
    assert "--seed SEED seed of the random inputs" in flat
    assert "--no-progress no progress bar" in flat


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mla-report {mla_report.__version__}"


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("a-file", "--out: '{out}' is a file; expected a folder"),
        ("a-file/report", "--out: cannot make '{out}': '{tmp}/a-file' is a file"),
    ],
)
def test_out_naming_a_file_fails_before_any_kernel(
    out: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "a-file").write_text("not a folder\n")
    monkeypatch.setattr(report_module, "run_report", _no_work)
    monkeypatch.setattr(report_module, "check_recipe", _no_work)
    path = tmp_path / out
    with pytest.raises(SystemExit) as info:
        main(["--device", "cpu", "--recipe", "x=k:fp8", "--out", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "mla-report: error: " + message.format(out=path, tmp=tmp_path)
    assert (tmp_path / "a-file").read_text() == "not a folder\n"


def test_out_in_a_read_only_folder_fails_before_any_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(report_module, "run_report", _no_work)
    with pytest.raises(SystemExit) as info:
        main(["--device", "cpu", "--out", str(tmp_path / "new")])
    assert info.value.code == 2
    assert f"--out: cannot write into '{tmp_path}' (permission denied)" in capsys.readouterr().err
