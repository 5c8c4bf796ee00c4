"""`prfaas bench run`'s live progress is rich's: one bar per running cell on a terminal, removed when the cell
ends, with the per-cell lines printed above it; nothing live when stderr is not a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from prfaas.bench.matrix import load_matrix
from prfaas.bench.run import Run, RunOptions


def _run(terminal: bool) -> tuple[Run, io.StringIO]:
    run = Run(RunOptions(target="http://127.0.0.1:1", matrix=load_matrix(profile="quick")))
    out = io.StringIO()
    run.console = Console(file=out, force_terminal=terminal, width=100)
    return run, out


def test_a_cell_has_a_bar_while_it_runs_on_a_terminal() -> None:
    run, out = _run(terminal=True)
    with run.live():
        assert run.progress is not None
        with run._ticking("in1024-out32-c1-normal") as tick:
            assert tick is not None
            tick(2.0)
            (task,) = run.progress.tasks
            assert (task.description, task.completed, task.total) == ("in1024-out32-c1-normal", 2.0,
                                                                       run.matrix.duration_s)
        assert run.progress.tasks == []
        run._say("in1024-out32-c1-normal: 2/2 ok")
    assert run.progress is None
    assert "in1024-out32-c1-normal: 2/2 ok" in out.getvalue()


def test_no_live_display_off_a_terminal_but_the_lines_still_print() -> None:
    run, out = _run(terminal=False)
    with run.live():
        assert run.progress is None
        with run._ticking("cell") as tick:
            assert tick is None
        run._say("a long line " * 12)
    assert out.getvalue() == "a long line " * 12 + "\n"  # one line, not wrapped at the console's width
