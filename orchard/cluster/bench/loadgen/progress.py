"""A rich progress bar fed one finished request at a time, or nothing when disabled."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchard.cluster.bench.loadgen.client import RequestRecord


class RequestProgress:
    """Counts finished and failed requests; `total` None shows an open-ended bar (duration runs)."""

    def __init__(self, total: int | None, label: str, enabled: bool = True, console: Console | None = None) -> None:
        self.failed = 0
        self._bar = None
        if enabled:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed {task.fields[failed]}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task(label, total=total, failed=0)

    def __enter__(self) -> RequestProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def done(self, rec: RequestRecord) -> None:
        self.failed += not rec.success
        if self._bar is not None:
            self._bar.update(self._task, advance=1, failed=self.failed)
