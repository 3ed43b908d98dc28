"""course_lib: the library behind the runnable course on training across many devices.

Start with :func:`course_lib.launch.run`, which runs a function on N real torch.distributed ranks.
"""

__version__ = "0.1.0"
