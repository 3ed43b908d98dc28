"""course_lib: the library behind the runnable course on training across many devices.

Start with :func:`course_lib.launch.run`, which runs a function on N real torch.distributed ranks; in a notebook,
``%load_ext course_lib`` gives ranks that stay alive between cells (:mod:`course_lib.cells`).
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """``%load_ext course_lib``: the ``%ranks`` magics of :mod:`course_lib.cells`."""
    from course_lib import cells

    cells.load(ipython)
