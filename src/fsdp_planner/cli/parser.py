"""The command line's parser: a bad argument is one line, not a usage block, and the parser is built without
importing torch, so ``--help`` and an argument error answer at once."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from fsdp_planner.cli.commands import COMMANDS
from fsdp_planner.errors import one_line
from fsdp_planner.fmt import printable


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line, not a usage block (subparsers are made of this class too)."""

    given: tuple[str, ...] = ()  # the command line being parsed (set by the top-level parse_args, read by error)

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):  # argparse takes a value starting with '-' for an option
            message += " (a value that starts with '-' is given as --option=VALUE)"
        negative = next((a for a in ArgumentParser.given if re.fullmatch(r"-[0-9.].*", a)), None)
        if negative and message.startswith("the following arguments are required"):
            message += f" ('{negative}' reads as an option: a size or count cannot be negative)"
        self.exit(2, printable(f"error: {one_line(message)} (see {self.prog} --help)") + "\n")  # quotes the input

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                   ) -> argparse.Namespace:  # type: ignore[override]
        """Unknown options are reported by the top-level parser: name the command's help, and the option meant."""
        ArgumentParser.given = tuple(sys.argv[1:] if args is None else args)
        given, flags = _torchtitan_flags(list(ArgumentParser.given))
        ns, extras = self.parse_known_args(given, namespace)
        if flags is not None and not getattr(ns, "from_torchtitan", None):  # argparse's own "--": positionals follow
            ns, extras = self.parse_known_args(ArgumentParser.given, namespace)
            if extras and any(f.startswith("--") and "." in f for f in flags):
                self._commands().get(getattr(ns, "command", None) or "", self).error(
                    "the flags after -- are torchtitan's (--section.key VALUE): give --from-torchtitan too")
            flags = None
        if extras:
            sub = self._commands().get(getattr(ns, "command", None) or "", self)
            option = extras[0].partition("=")[0]
            known = [o for a in sub._actions for o in a.option_strings if o not in ("-h", "--help")]
            close = difflib.get_close_matches(option, known, n=1) if option[:1] == "-" else []
            # (--help was offered for any short option: "--tp ... did you mean --help?")
            others = [name for name, p in self._commands().items() if p is not sub
                      and any(option in a.option_strings for a in p._actions)]
            hint = f"; did you mean {close[0]}?" if close else \
                f"; {option} is an option of {', '.join(others)}, not of {sub.prog}" if others else ""
            sub.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        sub = self._commands().get(getattr(ns, "command", None) or "", self)
        ns.torchtitan_flags = tuple(flags or ())
        _refuse_empty(sub, ns)
        _require(sub, ns)
        return ns

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                return dict(a.choices)
        return {}


def _torchtitan_flags(given: list[str]) -> tuple[list[str], list[str] | None]:
    """The command line before ``--``, and after it torchtitan's own overrides of a ``--from-torchtitan`` job
    (``-- --parallelism.tensor_parallel_degree 8``) as torchtitan spells them (None: no ``--``; without
    ``--from-torchtitan`` the ``--`` is argparse's)."""
    if "--" not in given:
        return given, None
    i = given.index("--")
    return given[:i], given[i + 1:]


def _refuse_empty(sub: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """A string option given as empty or blank is an error, not ignored: ``check m --plan ""`` once checked
    the module policy instead of the plan, ``plan --cluster ""`` planned for the default cluster."""
    for action in sub._actions:
        value = getattr(ns, action.dest, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            name = action.option_strings[-1] if action.option_strings else action.metavar or action.dest
            sub.error(f"{name} is empty: give a value")


def _require(sub: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """What argparse would require but a job config can give: MODEL (``--from-torchtitan`` names it) and simulate's
    and fit's ``--cluster`` (either config gives the GPU count)."""
    titan, accelerate = getattr(ns, "from_torchtitan", None), getattr(ns, "from_accelerate", None)
    missing = []
    if "model" in ns and ns.model is None and not titan:
        missing.append("model")
    if getattr(ns, "command", None) in ("simulate", "fit") and ns.cluster is None and not (titan or accelerate):
        missing.append("--cluster")
    if missing:
        sub.error(f"the following arguments are required: {', '.join(missing)}")


class _VersionAction(argparse.Action):
    """``--version``: the installed package's version and the torch it runs with (what a bug report needs), read
    only when asked, so building the parser does not import torch."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show program's version number and exit", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        parser._print_message(f"fsdp-planner {_version()}\n", sys.stdout)  # on stdout, as argparse's own
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    commands = " | ".join(command.__name__ for command in COMMANDS)
    p = ArgumentParser(prog="fsdp-planner", description=f"Command line: ``fsdp-planner {commands}``.")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser)
    for command in COMMANDS:
        command(sub)
    for sp in sub.choices.values():  # every command: --quiet (one place, so no command can miss it)
        sp.add_argument("--quiet", "-q", action="store_true",
                        help="print no notes, no progress and no library warnings on stderr (errors still are)")
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        mine = version("fsdp-planner")
    except PackageNotFoundError:  # run from a source tree without installing
        mine = "(not installed)"
    return f"{mine} (torch {torch.__version__})"
