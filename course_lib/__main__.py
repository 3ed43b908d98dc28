"""``python -m course_lib`` (and the ``course-lib`` command): see :mod:`course_lib.cli`.

A command that launches ranks starts the rank server first (:func:`course_lib.runtime.forkserver.warm`), so that its
torch imports run beside this process's own instead of after them.
"""

import sys


def main() -> int:
    from course_lib.runtime.forkserver import warm_for

    warm_for(sys.argv[1:])
    from course_lib.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
