"""The library's own code, shown in a lesson beside the run that exercises it.

:func:`show_code` reads the source of functions, methods and classes at the moment the cell runs, so a lesson shows
exactly the code its ranks execute and can never show a stale copy.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]  # the repository (or site-packages) that holds course_lib/


@dataclass(frozen=True)
class Code:
    """Source text with where it lives; Jupyter draws it as a highlighted block, ``print`` as plain text."""

    text: str
    where: tuple[str, ...]

    def _repr_markdown_(self) -> str:
        return f"```python\n{self.text}\n```"

    def __str__(self) -> str:
        return self.text


def _locate(obj) -> tuple[str, str]:
    """(the object's source, a header naming its file, lines and qualified name)."""
    target = inspect.unwrap(getattr(obj, "func", obj))  # a functools.partial shows the function it binds
    lines, first = inspect.getsourcelines(target)
    path = Path(inspect.getsourcefile(target)).resolve()
    shown = path.relative_to(_ROOT) if path.is_relative_to(_ROOT) else path
    header = f"# {shown.as_posix()}, lines {first}-{first + len(lines) - 1}: {target.__qualname__}"
    return textwrap.dedent("".join(lines)).rstrip(), header


def show_code(*objects) -> Code:
    """The source of each of ``objects`` (functions, methods, classes of the library), each under a comment line
    naming its file and lines; the last expression of a cell, it is displayed as highlighted code."""
    if not objects:
        raise ValueError("show_code needs at least one function, method or class")
    parts = [_locate(obj) for obj in objects]
    return Code("\n\n".join(f"{header}\n{source}" for source, header in parts), tuple(h for _, h in parts))
