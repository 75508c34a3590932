"""What the stack's services logged about one job: printed, or put in an assertion's message,
when an end-to-end comparison fails, so that a failure on a CI machine can be read from the
CI's output alone."""

from __future__ import annotations

from pathlib import Path


def job_story(data_dir: Path | str, job: str, *, last: int | None = None) -> str:
    """Every service log line naming ``job`` (DEBUG left out), prefixed with the log's name,
    service by service; with ``last``, only that many lines of each log."""
    out: list[str] = []
    for path in sorted(Path(data_dir, "logs").glob("*.log")):
        lines = [f"{path.stem}: {line[:240]}"
                 for line in path.read_text(errors="replace").splitlines()
                 if job in line and " DEBUG " not in line]
        out.extend(lines[-last:] if last else lines)
    return "\n".join(out)
