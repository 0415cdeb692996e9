"""`advise` as the operator reads it, from a real two-pool console's control API on 127.0.0.1: its first line names the
pool the advisor advises on (`[advisor] pool`), then that pool's window and the candidates; `--json` carries the pool
too."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from console.cli import _register_commands, app
from tests.console.advisor.fakes import advise_once, served, two_pool_controller

_register_commands()
runner = CliRunner()


def test_advise_names_the_pool_it_advises_on(tmp_path: Path) -> None:
    c = two_pool_controller(tmp_path, advisor=True, advisor_pool="b")
    with served(c) as url:
        cli = ["--url", url, "--token", c.token]
        waiting = runner.invoke(app, ["advise", *cli], env={"COLUMNS": "160"})
        assert waiting.exit_code == 0, waiting.output
        assert waiting.stdout.splitlines()[0].startswith("advisor on pool b: every 1 s over the last 5 s")
        assert waiting.stdout.splitlines()[1] == "no advice yet"
        advise_once(c)
        shown = runner.invoke(app, ["advise", *cli], env={"COLUMNS": "160"})
        assert shown.exit_code == 0, shown.output
        lines = shown.stdout.splitlines()
        assert lines[0].startswith("advisor on pool b: every 1 s over the last 5 s, apply = suggest; worker pid")
        assert " 20 requests on 1P1D, profile " in lines[1]  # b's requests only, on b's shape
        assert "│ active " in shown.stdout and "│ routing:least_load " in shown.stdout  # the ranking as before
        as_json = runner.invoke(app, ["advise", "--json", *cli])
        assert as_json.exit_code == 0, as_json.output
        answer = json.loads(as_json.stdout)
        assert answer["pool"] == "b" and answer["advice"]["shape"] == "1P1D"
    c.recorder.close()
