"""Progress bars for long-running commands (rich, on stderr): one interface, and a silent variant."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """Yield `advance(label)`: one step done, `label` names what comes next or was just done."""
    if not enabled:
        yield lambda label="": None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("[dim]{task.fields[label]}"),
    )
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task(description, total=total, label="")
        yield lambda label="": progress.update(task, advance=1, label=label)
