"""What every command shares: its sub-parser (help and examples), its output (the lines it prints, ``--json FILE``,
the figures it saves), the types of its number flags (sizes with suffixes: ``7B``), and the check of an output path
before any work starts. Nothing here imports torch: a command's ``--help`` and its refusals answer without it."""

from __future__ import annotations

import argparse
import decimal
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from course_lib.cluster.topology import MAX_GPUS
from course_lib.model.formulas import MAX_PARAMS

if TYPE_CHECKING:
    from course_lib.harness import SchemeRun


def program_name(argv0: str | None = None) -> str:
    """The command as it was typed (``sys.argv[0]`` by default): ``python -m course_lib`` for the package's
    ``__main__``, else ``course-lib``, the console script (and the name in-process callers such as the tests see)."""
    folder, script = os.path.split(os.path.abspath(sys.argv[0] if argv0 is None else argv0))
    return (
        "python -m course_lib" if (os.path.basename(folder), script) == ("course_lib", "__main__.py") else "course-lib"
    )


def command_parser(
    subparsers: argparse._SubParsersAction,
    name: str,
    summary: str,
    examples: list[tuple[str, str]],
    usage: str = "[options]",
) -> argparse.ArgumentParser:
    """A command's sub-parser: a short usage line (``usage`` after the command), its one-line summary, and its
    examples below the flags, each a comment and the command line (what follows the command's name), as the
    command was typed (``%(prog)s``)."""
    epilog = "examples:" + "".join(f"\n  # {why}\n  %(prog)s {line}".rstrip() for line, why in examples)
    return subparsers.add_parser(
        name,
        help=summary,
        description=summary,
        usage=f"%(prog)s {usage}",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def is_lead() -> bool:
    """Under torchrun every rank runs the command; only rank 0 prints and writes."""
    return os.environ.get("RANK", "0") == "0"


# What could not be written after the work was done (checked before it, it failed anyway: a full disk, a folder
# gone): each said in one line as it happens; the command then exits 1 (``cli.main``), so a script or CI step knows.
FAILED_WRITES: list[str] = []


def write_json(data: dict, target: str | None) -> None:
    """Write the result; if the file cannot be written (a full disk, a folder gone), the result goes to standard
    output instead, with one line on standard error saying why, so a finished run is never lost, and the command
    exits 1 (:data:`FAILED_WRITES`)."""
    if target is None or not is_lead():
        return
    text = json.dumps(data, indent=2)
    if target != "-":
        try:
            with open(target, "w") as f:
                f.write(text + "\n")
            return
        except OSError as err:
            FAILED_WRITES.append(target)
            print(
                f"{program_name()}: could not write {target} ({err.strerror or err}); the JSON follows", file=sys.stderr
            )
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
        FAILED_WRITES.append(str(err.filename or "the figures"))
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


def refusing(kind: Callable[[str], object]) -> Callable[[str], object]:
    """``kind`` as an argparse type whose ValueError message reaches the user (argparse would print its own)."""

    def parse(text: str) -> object:
        try:
            return kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def positive_int(text: str) -> int:
    return _number(text, int, 0, strict=True)


def natural(text: str) -> int:
    return _number(text, int, 0, strict=False)


def positive_float(text: str) -> float:
    return _number(text, float, 0.0, strict=True)


def nonnegative_float(text: str) -> float:
    return _number(text, float, 0.0, strict=False)


SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}  # thousand, million, billion, trillion


def _size(text: str, whole: bool, most: int, beyond: str) -> decimal.Decimal:
    """``text`` as a count: a number, in any notation Python reads (``175e9``), with an optional suffix K, M, B (or
    G) or T, in either case (``7B``, ``1.5T``, ``70M``, ``8k``: decimal, K is 1,000); refused with one line if it
    is not a number, not finite, below 1, not whole where ``whole``, or above ``most`` (``beyond`` says why)."""
    body, scale = text.strip(), 1
    if body[-1:].lower() in SUFFIXES:
        body, scale = body[:-1], SUFFIXES[body[-1].lower()]
    try:
        number = decimal.Decimal(body)  # exact: 1.1K is 1100, not 1100.0000000000002
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number (a count such as 7B, 1.5T, 70M, 8K or 175e9)"
        ) from None
    wanted = "a whole number of at least 1" if whole else "a finite number greater than 0"
    if not number.is_finite() or number <= 0:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    try:
        value = number * scale
    except decimal.Overflow:
        value = decimal.Decimal(most) + 1
    if value > most:
        shown = f"{most:.0e}" if most >= 1e9 else f"{most:,}"
        raise argparse.ArgumentTypeError(f"must be at most {shown} ({beyond}), got {text}")
    if whole and value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def param_count(text: str) -> float:
    """A number of parameters: ``7B``, ``1.5T``, ``70M``, ``175e9``; at most the formulas' bound, 1e15."""
    return float(_size(text, whole=False, most=MAX_PARAMS, beyond="a thousand times the largest model trained"))


def gpu_count(text: str) -> int:
    """A number of GPUs: ``16384``, ``16K``, ``100k``; a whole number, at most the planner's and the topologies'
    bound, 131,072."""
    return int(_size(text, whole=True, most=MAX_GPUS, beyond="eight times the largest published run's 16,384"))


def token_count(text: str) -> int:
    """A number of tokens (a sequence's length, a vocabulary) or of sequences (a batch): ``8K``, ``128k``; a whole
    number, at most 1e9."""
    return int(_size(text, whole=True, most=10**9, beyond="more than any model takes"))


def add_json_flag(p: argparse.ArgumentParser, group: argparse._ArgumentGroup | None = None) -> None:
    """``--json FILE``, the last flag of every command (in ``group`` if given), and the parser a refusal of an output
    path names."""
    (group or p).add_argument("--json", metavar="FILE", help="write the result as JSON (- for standard output)")
    p.set_defaults(parser=p)


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before any work starts, so no result is computed for nothing;
    create the folders a plot goes into."""
    if args.json not in (None, "-"):
        _check_writable(parser, "--json", args.json)
    if getattr(args, "out", None) is not None:
        _check_writable(parser, "--out", args.out)
    if getattr(args, "checkpoint_dir", None) is not None:
        _check_folder(parser, "--checkpoint-dir", args.checkpoint_dir)
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
        _check_folder(parser, "--plot", plot)


def _check_folder(parser: argparse.ArgumentParser, flag: str, folder: str) -> None:
    """A folder the command will write into: created if missing, and a file actually made and removed in it (the
    only test that holds for a read-only mount, ``/proc`` or a full quota); refused in one line otherwise."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        parser.error(f"{flag} {folder}: is a file; give a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".course_lib-probe-"):
            pass
    except OSError as err:
        parser.error(f"{flag} {folder}: cannot write there ({err.strerror or err})")


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
