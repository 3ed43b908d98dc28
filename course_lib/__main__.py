"""``python -m course_lib`` (and the ``course-lib`` command): see :mod:`course_lib.cli`.

The command line parses without torch; a command that launches ranks starts the rank server
(:func:`course_lib.runtime.forkserver.warm`) once its arguments are accepted, before its own imports of torch, so that
the two run side by side and a refused command starts nothing.
"""

import sys


def main() -> int:
    from course_lib.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
