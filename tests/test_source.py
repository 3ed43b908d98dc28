"""show_code: a lesson shows the library's code as it is when the cell runs, with its file and lines."""

import functools
import inspect

import pytest

from course_lib.parallel import data, tensor, tensor_layers
from course_lib.ui.source import Code, show_code


def test_shows_the_current_source_under_its_file_and_lines():
    code = show_code(data.DataParallel._end_backward)
    lines, first = inspect.getsourcelines(data.DataParallel._end_backward)
    last = first + len(lines) - 1
    header = f"# course_lib/parallel/data.py, lines {first}-{last}: DataParallel._end_backward"
    assert code.where == (header,)
    assert code.text.splitlines()[0] == header
    # dedented out of its class
    assert code.text.splitlines()[1] == "def _end_backward(self) -> None:"
    assert "handle.wait()" in code.text


def test_several_objects_and_a_partial_show_each_in_order():
    column_forward = tensor_layers.ColumnParallelLinear.forward
    code = show_code(column_forward, functools.partial(tensor.train_tensor_parallel, sp=True))
    assert [w.rsplit(": ", 1)[1] for w in code.where] == ["ColumnParallelLinear.forward", "train_tensor_parallel"]
    assert code.text.index("def forward") < code.text.index("def train_tensor_parallel")


def test_jupyter_draws_it_as_python():
    code = show_code(data.split_like)
    assert isinstance(code, Code) and code._repr_markdown_().startswith("```python\n# course_lib/parallel/data.py")
    assert str(code) == code.text


def test_nothing_to_show_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        show_code()
