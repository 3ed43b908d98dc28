"""``python -m course_lib`` (also ``course-lib``): memory, run, demo, schedule, plan, goodput, hardware and calibrate.

Every command takes ``--json FILE`` (``-`` for standard output) to write its result as JSON.

One module per command (:mod:`~course_lib.cli.memory`, :mod:`~course_lib.cli.run`, ...), each with its ``cmd_*`` and
the ``add_parser`` that adds its sub-parser; :mod:`~course_lib.cli.common` holds what they share (sub-parsers with
examples, output, number and size types, output-path checks) and :mod:`~course_lib.cli.training` the tiny GPT's flags
that ``run`` and ``demo`` share. Here: the top-level parser, assembled from each command's ``add_parser``, and
:func:`main`.

Parsing imports no torch (the vocabularies come from torch-free modules; a command imports what it runs with inside
its ``cmd_*``), so ``--help`` and every refusal of an argument answer at once and start nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

from course_lib.cli import calibrate, demo, goodput, hardware, memory, plan, run, schedule
from course_lib.cli.common import FAILED_WRITES, check_outputs, is_lead, program_name

COMMANDS = (memory, run, demo, schedule, hardware, calibrate, plan, goodput)  # in the order --help lists them


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (what is wrong, and where the help is), exit status 2, and
    reads ``-7e9`` as a (negative) number for the number types to refuse, not as an unknown flag."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    prog = program_name()
    parser = _Parser(
        prog=prog,
        usage="%(prog)s COMMAND [options]",
        description="The course's command line: memory, run, demo, schedule, plan, goodput, hardware and calibrate.",
        epilog=f"{prog} COMMAND --help: a command's flags, and examples to start from.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, prog=prog)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # refused by the command's own parser, which names its own help
        args.parser.error(f"unrecognized arguments: {' '.join(extras)}")
    check_outputs(args.parser, args)
    FAILED_WRITES.clear()
    try:
        status = args.func(args)
        return 1 if FAILED_WRITES and status == 0 else status
    except SystemExit as stop:  # a refusal: under torchrun every rank refuses, rank 0 says why
        from course_lib.runtime import forkserver

        forkserver.discard()  # a rank server warmed for the run that was refused
        if isinstance(stop.code, str) and not is_lead():
            return 1
        raise
    except BrokenPipeError:
        # The reader went away (``| head``): say nothing more, and let Python's final flush find nowhere to fail.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a command ended by SIGPIPE
    except KeyboardInterrupt:  # the launcher has stopped every rank on its way out
        print(f"{parser.prog} {args.command}: interrupted (Ctrl-C); no rank is left running", file=sys.stderr)
        return 130  # what a shell reports for a command ended by SIGINT
    except Exception as err:
        launch = sys.modules.get("course_lib.runtime.launch")  # never imported: no rank ran, no RankError
        if launch is None or not isinstance(err, launch.RankError):
            raise
        if is_lead():  # the failing rank's own lines, not the launcher's traceback
            # A numerical diagnosis (fp16 gradients overflowing) says what to change; its traceback adds nothing.
            said = str(err).splitlines()[0] if isinstance(err.__cause__, FloatingPointError) else str(err)
            whole = getattr(args, "traceback", False)
            print(f"{parser.prog} {args.command}: {said if whole else short_failure(said)}", file=sys.stderr)
        return 1


FRAMES_SHOWN = 3  # the failing rank's innermost frames outside the Python and torch libraries
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)\n    (?P<code>.+)$', re.M)


def short_failure(message: str) -> str:
    """A rank's failure as its first line and the innermost frames of its own code (the student's and the
    course's, not the Python and torch libraries'), the whole traceback and the other ranks behind ``--traceback``.
    A message with no traceback (a stall, a timeout, a dead rank) is already short: as it is."""
    first, marker, rest = message.partition("\n\n--- traceback of rank ")
    if not marker:
        return message
    frames = [f for f in _FRAME.finditer(rest) if "site-packages" not in f["file"] and "/lib/python3" not in f["file"]]
    lines = [f"  {f['file']}, line {f['line']}, in {f['function']}: {f['code'].strip()}" for f in frames]
    shown = list(reversed(lines[-FRAMES_SHOWN:]))
    return "\n".join([first, *shown, "  (--traceback: the whole traceback, and what the other ranks were doing)"])
