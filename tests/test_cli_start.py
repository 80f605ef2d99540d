"""The command line starts without torch: its parser, ``--help`` and argument errors import nothing heavy, and the
names they offer are the ones the package acts on."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from fsdp_planner.choices import OPTIMIZER_NAMES, PRECISION_NAMES


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_parser_and_help_do_not_import_torch() -> None:
    proc = _run_python("""
        import sys
        from fsdp_planner.cli import build_parser

        parser = build_parser()
        text = parser.format_help()
        commands = next(a for a in parser._actions if a.dest == "command").choices
        text += "".join(sub.format_help() for sub in commands.values())
        assert "--policy" in text and "bf16-mixed" in text
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "rich", "numpy"))
        assert "torch" not in sys.modules, heavy
        assert not heavy, heavy
    """)
    assert proc.returncode == 0, proc.stderr


def test_help_and_argument_errors_in_main_do_not_import_torch() -> None:
    proc = _run_python("""
        import contextlib, io, sys
        from fsdp_planner.cli import main

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            codes = [main(["--help"]), main(["plan", "--help"]), main(["plan"]),
                     main(["plan", "x", "--batch", "zero"]), main(["bogus"])]
        assert codes == [0, 0, 2, 2, 2], (codes, err.getvalue())
        assert "torch" not in sys.modules
    """)
    assert proc.returncode == 0, proc.stderr


def test_light_names_match_the_simulation_options() -> None:
    from fsdp_planner.sim.options import OPTIMIZERS, PRECISIONS

    assert tuple(PRECISIONS) == PRECISION_NAMES
    assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES


def test_every_command_has_a_run() -> None:
    import importlib

    from fsdp_planner.cli.commands import COMMANDS

    for command in COMMANDS:
        assert callable(importlib.import_module(f"fsdp_planner.cli.{command.__name__}").run), command.__name__


def test_ctrl_c_while_the_command_is_imported_is_one_line(monkeypatch, capsys) -> None:
    import importlib

    from fsdp_planner import cli

    def interrupted(name: str, package: str | None = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)  # Ctrl-C while torch loads
    assert cli.main(["models"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
