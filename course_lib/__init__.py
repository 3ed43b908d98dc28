"""course_lib: the library behind the runnable course on training across many devices.

Start with :func:`course_lib.runtime.launch.run`, which runs a function on N real torch.distributed ranks; in a
notebook, ``%load_ext course_lib`` gives ranks that stay alive between cells (:mod:`course_lib.runtime.cells`).
The folders are the table of contents (docs/architecture.md): ``ledgers``, ``runtime``, ``model``, ``parallel``,
``cluster``, ``planner``, ``harness`` (run a scheme beside one device), ``practice``, ``ui``, ``cli``.

``from course_lib import launch, comm, trace`` keeps working: those short names are loaded on first use, so that
importing the package (as the rank server and every course kernel do) imports no torch.
"""

from importlib import import_module

__version__ = "0.1.0"

SHORT_NAMES = {
    "launch": "course_lib.runtime.launch",
    "comm": "course_lib.ledgers.comm",
    "trace": "course_lib.ledgers.trace",
}


def __getattr__(name: str):
    if name in SHORT_NAMES:
        return import_module(SHORT_NAMES[name])
    raise AttributeError(f"module 'course_lib' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """``%load_ext course_lib``: the ``%ranks`` magics of :mod:`course_lib.runtime.cells`."""
    from course_lib.runtime import cells

    cells.load(ipython)
