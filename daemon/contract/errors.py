"""The deliberate errors of watchd: one root, a subclass per kind. Anything else is a bug."""

from __future__ import annotations

from collections.abc import Sequence

from daemon.contract.jobspec import Problem, summarised


class WatchdError(Exception):
    """Root of every error watchd raises on purpose; the CLI prints it as one ``Error:`` line
    and exits with ``exit_code``."""

    exit_code = 1


class ConfigError(WatchdError):
    """The configuration file is invalid; carries every problem found, with its location."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        listed = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n{listed}")


class AccessDenied(WatchdError):
    """This user may not read a file watchd needs (the configuration, the database); the message
    names the file and the group to join."""


class ManifestError(WatchdError):
    """A manifest is invalid; carries the problems found, each with its location and a hint
    (the first few, then how many more: a manifest of 400 000 wrong entries must not make a
    status file, a log line and a database row of tens of megabytes)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = summarised(problems)
        super().__init__("; ".join(p.render() for p in self.problems))


class IllegalTransition(WatchdError):
    """A state change that the transition table does not allow."""


class SubmissionError(WatchdError):
    """An executor refused or failed to take a job."""


class ExecutorUnavailable(WatchdError):
    """The executor cannot be reached or used at all (for now)."""


class CommandFailed(WatchdError):
    """A subprocess ended badly; carries what an operator needs to see why."""

    def __init__(self, command: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.command = tuple(command)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        tail = (stderr or stdout).strip().splitlines()[-3:]
        super().__init__(
            f"{' '.join(self.command)} exited with {returncode}: {' | '.join(tail) or 'no output'}"
        )


class ChecksFailed(WatchdError):
    """``watchctl doctor`` ran and found a problem (its own exit status, 3)."""

    exit_code = 3


class NotFound(WatchdError):
    """A batch, job or other record asked for by an operator does not exist."""
