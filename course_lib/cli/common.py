"""What every command shares: its output (the lines it prints, ``--json FILE``, the figures it saves), the types of
its number flags, and the check of an output path before any work starts."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from course_lib.harness import SchemeRun


def is_lead() -> bool:
    """Under torchrun every rank runs the command; only rank 0 prints and writes."""
    return os.environ.get("RANK", "0") == "0"


def write_json(data: dict, target: str | None) -> None:
    """Write the result; if the file cannot be written (a full disk, a folder gone), the result goes to standard
    output instead, with one line on standard error saying why, so a finished run is never lost."""
    if target is None or not is_lead():
        return
    text = json.dumps(data, indent=2)
    if target != "-":
        try:
            with open(target, "w") as f:
                f.write(text + "\n")
            return
        except OSError as err:
            print(f"course-lib: could not write {target} ({err.strerror or err}); the JSON follows", file=sys.stderr)
    print(text)


def say(args: argparse.Namespace, text: str = "") -> None:
    """Human output; silent when the JSON goes to standard output, and on ranks other than 0 under torchrun."""
    if args.json != "-" and is_lead():
        print(text)


def save_plots(run: SchemeRun, folder: str) -> str:
    """Write a run's figures and Chrome trace into ``folder`` (:func:`course_lib.ui.run_figures.save_run_figures`); what
    :func:`saved` says."""
    from course_lib.ui.run_figures import save_run_figures

    return saved(lambda: save_run_figures(run, folder))


def saved(write: Callable[[], list[str]]) -> str:
    """Run ``write`` (which returns the files it wrote) and say what it wrote, or in one line why it could not."""
    try:
        return "wrote " + ", ".join(write())
    except OSError as err:
        return f"could not write the figures ({err.strerror or err}: {err.filename or ''}); the results above stand"


def _number(text: str, kind: type, least: float, strict: bool) -> float:
    """Parse ``text`` as ``kind``; refuse NaN, infinity and values below ``least`` (or equal to it if ``strict``)."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
    if not math.isfinite(value) or value < least or (strict and value == least):
        if kind is int:
            wanted = f"a whole number of at least {least + 1 if strict else least}"
        else:
            wanted = f"a finite number {'greater than' if strict else 'of at least'} {least:g}"
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 0, strict=True)


def natural(text: str) -> int:
    return _number(text, int, 0, strict=False)


def positive_float(text: str) -> float:
    return _number(text, float, 0.0, strict=True)


def nonnegative_float(text: str) -> float:
    return _number(text, float, 0.0, strict=False)


def add_json_flag(p: argparse.ArgumentParser) -> None:
    """``--json FILE``, the last flag of every command, and the parser a refusal of an output path names."""
    p.add_argument("--json", metavar="FILE", help="write the result as JSON (- for standard output)")
    p.set_defaults(parser=p)


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before any work starts, so no result is computed for nothing;
    create the folders a plot goes into."""
    if args.json not in (None, "-"):
        _check_writable(parser, "--json", args.json)
    if getattr(args, "out", None) is not None:
        _check_writable(parser, "--out", args.out)
    plot = getattr(args, "plot", None)
    if plot:
        import matplotlib

        matplotlib.use("Agg")  # files only, whatever display the terminal has
    if plot and args.command == "schedule":
        from matplotlib.figure import Figure

        extension = os.path.splitext(plot)[1].lstrip(".").lower()
        formats = Figure().canvas.get_supported_filetypes()
        if os.path.isdir(plot):
            parser.error(f"--plot {plot}: is a folder; give a file name such as {os.path.join(plot, 'schedule.png')}")
        if extension not in formats:
            parser.error(f"--plot {plot}: give a file name ending in one of .{', .'.join(sorted(formats))}")
        _check_writable(parser, "--plot", plot, create=True)
    elif plot:
        if os.path.exists(plot) and not os.path.isdir(plot):
            parser.error(f"--plot {plot}: is a file; --plot takes a folder for the figures")
        _check_writable(parser, "--plot", os.path.join(plot, "figure.png"), create=True)


def _check_writable(parser: argparse.ArgumentParser, flag: str, path: str, create: bool = False) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: is a folder; give a file name")
    if create:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            parser.error(f"{flag} {path}: cannot create the folder {folder} ({err.strerror})")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{flag} {path}: the folder {folder} is not writable")
