"""geompi's messages as Python logging records, under the ``geompi`` logger.

Every line geompi prints on stderr (the topology table aside, which goes to stdout) is a record
of the ``geompi`` logger or one of its children (``geompi.metrics``, ...). Each record of those
loggers carries the MPI rank of the process that wrote it (``record.rank``, from the launcher's
environment; 0 outside MPI; a log record factory adds it), so a format can show it, e.g.
``"%(asctime)s rank %(rank)s %(levelname)s %(message)s"``.

As a library should, geompi prints through its own handler only where the application
configured none: its default handler writes the bare message (each starts ``geompi: ``, errors
``geompi: error: ``) to stderr and steps aside as soon as a handler is attached to the
``geompi`` logger or to the root logger (``logging.basicConfig``). The level is
``GEOMPI_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``; default ``INFO``), or the
CLI's ``--log-level``; ERROR is the highest, so a user error's one line always shows.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ROOT = "geompi"
_ENV = "GEOMPI_LOG_LEVEL"


def rank_of_process() -> int:
    """This process's rank as the launcher tells it (0 if not launched by one)."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _stamp_rank(previous):
    """A log record factory that adds ``rank`` to the records of ``geompi`` and its children
    (those of every logger whose name starts ``geompi``), chained to the factory before."""

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if f"{record.name}.".startswith(f"{ROOT}."):  # geompi itself or a child logger
            record.rank = rank_of_process()
        return record

    factory.geompi_ranks = True  # type: ignore[attr-defined]
    return factory


def _users_handler(h: logging.Handler) -> bool:
    # pytest's log capture attaches its handlers to the root logger during every test: those
    # are not an application's configuration
    return not isinstance(h, _DefaultHandler) and not type(h).__module__.startswith("_pytest")


class _DefaultHandler(logging.Handler):
    """The bare message on the current ``sys.stderr``, flushed; silent once the application
    has attached a handler of its own to the ``geompi`` logger or to the root logger."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(ROOT)
        if any(_users_handler(h) for h in logger.handlers):
            return
        if logger.propagate and any(_users_handler(h) for h in logging.getLogger().handlers):
            return
        try:
            sys.stderr.write(record.getMessage().rstrip("\n") + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - as logging.Handler.handleError, quietly
            self.handleError(record)


def level_from_env(env=os.environ) -> str:
    """``GEOMPI_LOG_LEVEL`` upper-cased (default INFO); ValueError naming the choices for
    another value."""
    value = env.get(_ENV, "INFO").strip().upper() or "INFO"
    if value not in LEVELS:
        raise ValueError(f"{_ENV}={env.get(_ENV)!r}: choose one of {', '.join(LEVELS)}")
    return value


def set_level(level: str) -> None:
    """Set the ``geompi`` logger's level (one of :data:`LEVELS`, any case)."""
    name = level.strip().upper()
    if name not in LEVELS:
        raise ValueError(f"log level {level!r}: choose one of {', '.join(LEVELS)}")
    logging.getLogger(ROOT).setLevel(name)


def _setup() -> logging.Logger:
    logger = logging.getLogger(ROOT)
    if not getattr(logging.getLogRecordFactory(), "geompi_ranks", False):
        logging.setLogRecordFactory(_stamp_rank(logging.getLogRecordFactory()))
    if not any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        logger.addHandler(_DefaultHandler())
    try:
        logger.setLevel(level_from_env())
    except ValueError:  # reported by runtime.start_job (check_log_level) in one line
        logger.setLevel("INFO")
    return logger


_ROOT_LOGGER = _setup()


def get_logger(name: str = ROOT) -> logging.Logger:
    """The logger ``name``: ``geompi`` or a child of it (``"geompi.metrics"``)."""
    return logging.getLogger(name)


def level_of(msg: str) -> int:
    """The level of one of geompi's lines from its prefix: ``geompi: error:`` is ERROR,
    ``geompi: warning:`` WARNING, anything else INFO."""
    head = msg[:40].lower()
    if "error:" in head and head.startswith("geompi"):
        return logging.ERROR
    if "warning:" in head and head.startswith("geompi"):
        return logging.WARNING
    return logging.INFO


def emit(msg: str, level: int | None = None, logger: str = ROOT) -> None:
    """One line through the ``geompi`` logger, at ``level`` (default: from its prefix)."""
    get_logger(logger).log(level_of(msg) if level is None else level, msg.rstrip("\n"))
