"""pytest for the whole repository (``make test`` runs ``tests`` and ``notebooks`` in one session).

A lesson that a browser test runs top to bottom through JupyterLab's own menus (marked
``@pytest.mark.runs_notebook("NAME.ipynb")`` in ``tests/test_browser.py``, which fails on any error output) is not
run a second time, cell by cell, by nbval in the same session: the browser run checks every cell of it as nbval
would. Where the browser tests do not run (no chromium, ``-m "not browser"``, a ``-k`` that leaves them out),
nbval runs every lesson.
"""

import pytest


@pytest.hookimpl(trylast=True)  # after ``-m`` and ``-k`` have deselected what they leave out
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_in_browser = {mark.args[0] for item in items for mark in item.iter_markers("runs_notebook")}
    twice = [item for item in items if item.nodeid.split("::")[0].rsplit("/", 1)[-1] in run_in_browser]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if item not in twice]
