"""E-mail to a batch's owner when it ends: the letter (pure) and the thread that posts it.

The loop composes a letter and hands it over; one worker thread delivers letters one after the
other over SMTP, so a slow or unreachable relay never holds up the loop. The queue is bounded:
when it is full a letter is refused at once (the loop notes it). The worker never touches the
database: it reports each delivery back through a second queue, and the loop records it.
Transient failures (connection refused, timeouts, 4xx replies) are retried a few times with
back-off; permanent ones (5xx: unknown recipient, failed login) are not. Retries and the wait
between them stop at shutdown.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import queue
import smtplib
import ssl
import threading
import time
from dataclasses import dataclass
from email.message import EmailMessage
from email.utils import format_datetime, make_msgid
from pathlib import Path

import tenacity

from daemon.contract.errors import WatchdError
from daemon.core.manifest import STATUS_NAME
from daemon.core.records import Batch
from daemon.core.states import BatchState
from daemon.site.config import MailSection

QUEUE_SIZE = 200
ATTEMPTS = 3


@dataclass(frozen=True)
class Letter:
    batch_id: int
    to: str
    message: EmailMessage


@dataclass(frozen=True)
class Delivery:
    """What became of a letter: ``error`` is None when the relay took it."""

    letter: Letter
    error: str | None = None


def compose(batch: Batch, ended: BatchState, status_text: str, sender: str, now: float) -> Letter:
    """The letter to the batch's owner: which batch, how it ended, and its status file (the
    reason, each problem with a next step, and where the results are)."""
    if batch.contact is None:
        raise ValueError(f"batch {batch.id} has no contact address")
    headline = "done" if ended is BatchState.DONE else f"FAILED: {batch.reason}"
    message = EmailMessage()
    message["Subject"] = _shorten(f"watchd: {batch.folder} {headline}", 150)
    message["From"] = sender
    message["To"] = batch.contact
    message["Date"] = format_datetime(dt.datetime.fromtimestamp(now, dt.UTC))
    message["Message-ID"] = make_msgid(f"watchd.batch{batch.id}", sender.rpartition("@")[2])
    message["Auto-Submitted"] = "auto-generated"  # RFC 3834: no vacation replies to this
    greeting = f"Hello {batch.owner}," if batch.owner else "Hello,"
    body = [
        greeting,
        "",
        f"your batch in {batch.path} has ended: {ended.value.upper()}.",
        f"Its status file ({batch.path / STATUS_NAME}) says:",
        "",
        status_text.rstrip(),
        "",
        "-- ",
        f"watchd (an operator can look at it with: watchctl show {batch.id})",
    ]
    message.set_content("\n".join(body) + "\n")
    return Letter(batch.id, batch.contact, message)


def _shorten(text: str, limit: int) -> str:
    text = " ".join(text.split())  # no line breaks in a header
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_password(path: Path) -> str:
    """The password from its file (without the trailing newline); WatchdError if unreadable."""
    try:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise WatchdError(f"mail.password_file {path}: cannot be read: {exc}") from None


class Mailer:
    """Delivers letters from a worker thread; the loop posts letters and collects deliveries."""

    def __init__(self, section: MailSection, password: str | None = None) -> None:
        self.section = section
        self.password = password
        self._letters: queue.Queue[Letter | None] = queue.Queue(QUEUE_SIZE)
        self._deliveries: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="watchd-mailer", daemon=True)

    @classmethod
    def from_config(cls, section: MailSection) -> Mailer | None:
        """A mailer if mail is enabled (the password file is read now, so that a missing one
        stops the start with a clear error), else None."""
        if not section.enabled:
            return None
        password = read_password(section.password_file) if section.password_file else None
        return cls(section, password)

    def start(self) -> None:
        self._thread.start()

    def post(self, letter: Letter) -> bool:
        """Hand a letter over without waiting; False if too many are waiting already."""
        try:
            self._letters.put_nowait(letter)
        except queue.Full:
            return False
        return True

    def deliveries(self) -> list[Delivery]:
        """What was delivered (or failed) since the last call."""
        done = []
        while not self._deliveries.empty():
            done.append(self._deliveries.get_nowait())
        return done

    def close(self, timeout: float) -> list[Letter]:
        """Let the worker deliver what is queued for up to ``timeout`` seconds, then stop it;
        the letters it did not get to."""
        deadline = time.monotonic() + timeout
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):  # a full queue: the worker stops at closing
                self._letters.put(None, timeout=timeout)
            self._thread.join(max(0.0, deadline - time.monotonic()))
            self._closing.set()  # no further attempt, no more waiting between attempts
            self._thread.join(max(0.0, deadline - time.monotonic()))
        unsent = []
        while not self._letters.empty():
            letter = self._letters.get_nowait()
            if letter is not None:
                unsent.append(letter)
        return unsent

    def _work(self) -> None:
        while not self._closing.is_set():
            letter = self._letters.get()
            if letter is None:
                return
            self._deliveries.put(self._deliver(letter))

    def _deliver(self, letter: Letter) -> Delivery:
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(ATTEMPTS)
            | tenacity.stop_when_event_set(self._closing),
            wait=tenacity.wait_exponential(multiplier=2, max=30),
            retry=tenacity.retry_if_exception(_transient),
            sleep=self._pause,
            reraise=True,
        )
        try:
            retrying(self.send, letter.message)
        except (OSError, smtplib.SMTPException) as exc:
            return Delivery(letter, _describe(exc))
        return Delivery(letter)

    def _pause(self, seconds: float) -> None:
        self._closing.wait(seconds)  # returns at once at shutdown

    def send(self, message: EmailMessage) -> None:
        """One delivery attempt over SMTP (STARTTLS and login if configured)."""
        s = self.section
        with smtplib.SMTP(s.host, s.port, timeout=s.timeout_seconds) as smtp:
            if s.starttls:
                smtp.starttls(context=ssl.create_default_context())
            if s.username:
                smtp.login(s.username, self.password or "")
            smtp.send_message(message)


def _transient(exc: BaseException) -> bool:
    """Whether trying again later may help."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        return all(400 <= code < 500 for code, _ in exc.recipients.values())
    if isinstance(exc, smtplib.SMTPResponseException):
        return 400 <= exc.smtp_code < 500
    if isinstance(exc, smtplib.SMTPServerDisconnected):
        return True
    if isinstance(exc, smtplib.SMTPException):
        return False  # e.g. STARTTLS or login not offered: a configuration problem
    return isinstance(exc, OSError)  # refused, unreachable, timed out


def _describe(exc: BaseException) -> str:
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        return "; ".join(
            f"{to}: {code} {_text(text)}" for to, (code, text) in exc.recipients.items()
        )
    if isinstance(exc, smtplib.SMTPResponseException):
        return f"{exc.smtp_code} {_text(exc.smtp_error)}"
    return str(exc) or type(exc).__name__


def _text(reply: bytes | str) -> str:
    return reply.decode(errors="replace") if isinstance(reply, bytes) else reply
