"""``python -m course_lib``: see :mod:`course_lib.cli`."""

import sys

from course_lib.cli import main

if __name__ == "__main__":
    sys.exit(main())
