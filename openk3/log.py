"""openk3's one reporting channel: `logging`, one line per message, tagged with the part that speaks.

    say = reporter("train")          # the logger "openk3.report.train"
    say.info("step 10/200 ...")      # -> "[train] step 10/200 ..." on stdout
    say.warning("skipping ...")      # -> "[train] warning: skipping ..." on stderr

Reporters (`reporter(tag)`, the loggers under "openk3.report") speak for long jobs — training, SFT, RL,
MOPD, the post-training pipeline, evaluation — whether a command or a Python caller started them, so they
carry their own handler, at INFO. Progress bars (tqdm, on stderr) stay as they are: a line is written
through `tqdm.write` when tqdm is loaded, so it never tears a bar. The library's other loggers (module
`__name__` loggers under "openk3") are notes: a command shows them as `[openk3] ...` on stderr
(`notes_to_stderr`, used by `openk3/__main__.py`), a Python caller configures logging as it likes.
A caller who wants the reporters elsewhere replaces or removes their handler on `logging.getLogger(REPORT)`
(and keeps them on when configuring logging: `dictConfig(..., disable_existing_loggers=False)`).
"""

from __future__ import annotations

import logging
import sys

REPORT = "openk3.report"


def _write(line: str, stream) -> None:
    tqdm = sys.modules.get("tqdm")  # loaded only by jobs that draw a bar: commands that do not stay light
    if tqdm is not None:
        tqdm.tqdm.write(line, file=stream)
        stream.flush()
    else:
        print(line, file=stream, flush=True)


class TaggedLines(logging.Handler):
    """`[tag] message` on stdout (INFO and below) or `[tag] warning: message` on stderr (WARNING and up). The
    tag is the reporter's (the logger name after "openk3.report."), else `default_tag`. sys.stdout and
    sys.stderr are looked up at each line, not kept, so a replaced stream (a test's capture, a caller's
    redirection) receives them."""

    def __init__(self, default_tag: str = "openk3", *, notes_to_stderr: bool = False) -> None:
        super().__init__()
        self.default_tag, self.notes_to_stderr = default_tag, notes_to_stderr

    def emit(self, record: logging.LogRecord) -> None:
        try:
            name = record.name
            tag = name[len(REPORT) + 1:] if name.startswith(REPORT + ".") else self.default_tag
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                _write(f"[{tag}] warning: {text}", sys.stderr)
            else:
                _write(f"[{tag}] {text}", sys.stderr if self.notes_to_stderr else sys.stdout)
        except Exception:  # logging's contract: a failing handler reports, never raises into the caller
            self.handleError(record)


def _report_root() -> logging.Logger:
    root = logging.getLogger(REPORT)
    if not getattr(root, "_openk3_configured", False):
        root.addHandler(TaggedLines())
        root.setLevel(logging.INFO)
        root.propagate = False  # a caller's root handler would print every line twice
        root._openk3_configured = True
    return root


def reporter(tag: str) -> logging.Logger:
    """The logger a long job reports through: "[tag] ..." lines (module docstring)."""
    _report_root()
    return logging.getLogger(f"{REPORT}.{tag}")


def quiet_reporter(tag: str) -> logging.Logger:
    """A reporter that says nothing: what the ranks other than 0 of a distributed run use (rank 0 speaks for
    the run)."""
    log = logging.getLogger(f"{REPORT}.quiet.{tag}")
    log.setLevel(logging.CRITICAL + 1)  # (a level, not `disabled`: logging.config re-enables disabled loggers)
    return log
