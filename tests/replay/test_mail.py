"""E-mail to a batch's owner when it ends, delivered to a real SMTP server (aiosmtpd) on
127.0.0.1: one letter per end, done or failed, saying why and where the results are; none
without an address; none again after a restart; STARTTLS and login with a password file; a
refused letter is recorded and the daemon goes on."""

from __future__ import annotations

import email
import email.policy
import socket
import ssl
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword
from replay import Replay, copy_slowly

from daemon.config import Config
from daemon.records import Batch
from daemon.service import Service
from daemon.states import BatchState

SENDER = "watchd@example.org"


@dataclass
class Inbox:
    """An aiosmtpd handler keeping what it receives; it refuses recipients in ``refuse`` for
    good and those in ``busy_once`` once, for now."""

    letters: list[EmailMessage] = field(default_factory=list)
    logins: list[tuple[str, str]] = field(default_factory=list)
    refuse: set[str] = field(default_factory=set)
    busy_once: set[str] = field(default_factory=set)  # 451 (try again later) the first time

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, options: list[str]
    ) -> str:
        if address in self.refuse:
            return "550 5.1.1 no such mailbox here"
        if address in self.busy_once:
            self.busy_once.discard(address)
            return "451 4.3.0 busy, try again later"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        parsed = email.message_from_bytes(envelope.original_content, policy=email.policy.default)
        assert isinstance(parsed, EmailMessage)
        self.letters.append(parsed)
        return "250 Message accepted for delivery"

    def authenticate(
        self, server: Any, session: Any, envelope: Any, mechanism: str, data: Any
    ) -> AuthResult:
        assert isinstance(data, LoginPassword)
        self.logins.append((data.login.decode(), data.password.decode()))
        return AuthResult(success=data.password == b"s3cret pass")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def smtp_server() -> Iterator[Callable[..., tuple[Inbox, int]]]:
    started: list[Controller] = []

    def start(**options: Any) -> tuple[Inbox, int]:
        inbox, port = Inbox(), free_port()
        if "tls_context" in options:
            options.update(authenticator=inbox.authenticate, require_starttls=True)
        controller = Controller(inbox, hostname="127.0.0.1", port=port, **options)
        controller.start()
        started.append(controller)
        return inbox, port

    yield start
    for controller in started:
        controller.stop()


def mail_config(config_for: Callable[..., Config], port: int, **mail: object) -> Config:
    return config_for(
        mail={
            "enabled": True,
            "host": "127.0.0.1",
            "port": port,
            "from": SENDER,
            "timeout_seconds": 10,
            **mail,
        }
    )


@pytest.fixture
def too_big(staged: Callable[..., Path]) -> Callable[..., Path]:
    """A batch whose first image is larger than its manifest says: it fails at once, with the
    file named, and runs no job."""

    def make(name: str, **manifest_options: object) -> Path:
        folder = staged(name, count=2, **manifest_options)
        with open(folder / "images" / "img_0000.png", "ab") as image:
            image.write(b"trailing bytes")
        return folder

    return make


def ended(done: int = 0, failed: int = 0) -> Callable[[Service], bool]:
    def check(service: Service) -> bool:
        counts = service.store.counts()
        return counts[BatchState.DONE] == done and counts[BatchState.FAILED] == failed

    return check


def batches(config: Config) -> dict[str, Batch]:
    with Replay(config) as replay:  # a fresh daemon on the same database: it mails nothing new
        replay.run(quiet_seconds=0.5)
        return {b.folder: b for b in replay.service.store.batches()}


def mail_notes(config: Config, batch: Batch) -> list[str]:
    from daemon.store import Store

    store = Store(config.daemon.database)
    try:
        return [e.reason for e in store.events(batch.id) if e.reason.startswith("e-mail")]
    finally:
        store.close()


def test_the_owner_gets_one_letter_when_a_batch_ends_done_or_failed_and_none_without_address(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    too_big: Callable[..., Path],
    drop_root: Path,
    smtp_server: Callable[..., tuple[Inbox, int]],
) -> None:
    inbox, port = smtp_server()
    config = mail_config(config_for, port)
    steps = [
        *copy_slowly(staged("good", owner="Ada Expert"), drop_root / "plate 1 ä", 0.0, 0.01),
        *copy_slowly(too_big("big", owner="Ada Expert"), drop_root / "plate 2", 0.0, 0.01),
        *copy_slowly(too_big("anon", email=None), drop_root / "plate 3", 0.0, 0.01),
    ]
    with Replay(config) as replay:
        replay.run(steps, until=ended(done=1, failed=2), timeout=180)
    # leaving the daemon let its mailer deliver what was queued

    found = batches(config)  # and a restart sends nothing again
    assert sorted(found) == ["plate 1 ä", "plate 2", "plate 3"]
    assert len(inbox.letters) == 2
    by_subject = {str(m["Subject"]): m for m in inbox.letters}

    done = by_subject["watchd: plate 1 ä done"]
    assert done["To"] == "tester@example.org" and done["From"] == SENDER
    assert done["Auto-Submitted"] == "auto-generated"
    text = done.get_content().replace("\r\n", "\n")  # SMTP sends lines with CRLF
    good = found["plate 1 ä"]
    assert text.startswith("Hello Ada Expert,\n\nyour batch in ")
    assert f"{good.path} has ended: DONE." in text
    assert "State:     DONE" in text
    run = Path(good.run_dir).relative_to(good.path).as_posix()
    assert f"report:   {run}/report.html" in text and f"masks:    {run}/masks/" in text
    assert f"watchctl show {good.id}" in text

    failed = by_subject["watchd: plate 2 FAILED: inputs differ from the manifest"]
    text = failed.get_content().replace("\r\n", "\n")
    assert "State:     FAILED" in text and "Why: inputs differ from the manifest" in text
    assert "manifest.toml, files[0]: 'images/img_0000.png' is" in text  # the problem, located
    assert "Next step:" in text

    assert mail_notes(config, good) == ["e-mail to tester@example.org"]
    assert mail_notes(config, found["plate 2"]) == ["e-mail to tester@example.org"]
    assert mail_notes(config, found["plate 3"]) == []


@pytest.fixture
def tls_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """A self-signed certificate for 127.0.0.1, trusted by the daemon's default context."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # what a site's own CA bundle would do
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def test_starttls_and_a_login_with_the_password_from_its_file(
    config_for: Callable[..., Config],
    too_big: Callable[..., Path],
    drop_root: Path,
    tmp_path: Path,
    tls_context: ssl.SSLContext,
    smtp_server: Callable[..., tuple[Inbox, int]],
) -> None:
    inbox, port = smtp_server(tls_context=tls_context)
    secret = tmp_path / "smtp-password"
    secret.write_text("s3cret pass\n")
    config = mail_config(
        config_for, port, starttls=True, username="watchd", password_file=str(secret)
    )
    with Replay(config) as replay:
        replay.run(
            copy_slowly(too_big("big"), drop_root / "plate", 0.0, 0.01), until=ended(failed=1)
        )
    assert inbox.logins == [("watchd", "s3cret pass")]
    assert [str(m["Subject"]) for m in inbox.letters] == [
        "watchd: plate FAILED: inputs differ from the manifest"
    ]


def test_a_refused_letter_is_recorded_on_the_batch_and_the_daemon_goes_on(
    config_for: Callable[..., Config],
    too_big: Callable[..., Path],
    drop_root: Path,
    smtp_server: Callable[..., tuple[Inbox, int]],
) -> None:
    inbox, port = smtp_server()
    inbox.refuse.add("nobody@example.org")
    config = mail_config(config_for, port)
    steps = [
        *copy_slowly(too_big("refused", email="nobody@example.org"), drop_root / "one", 0.0, 0.01),
        *copy_slowly(too_big("taken"), drop_root / "two", 0.5, 0.01),
    ]
    with Replay(config) as replay:
        replay.run(steps, until=ended(failed=2))
    found = batches(config)
    assert mail_notes(config, found["one"]) == [
        "e-mail to nobody@example.org",
        "e-mail to nobody@example.org failed: nobody@example.org: 550 5.1.1 no such mailbox here",
    ]
    assert mail_notes(config, found["two"]) == ["e-mail to tester@example.org"]
    assert [m["To"] for m in inbox.letters] == ["tester@example.org"]


def test_turning_mail_on_later_mails_none_of_the_batches_that_ended_before(
    config_for: Callable[..., Config],
    too_big: Callable[..., Path],
    drop_root: Path,
    smtp_server: Callable[..., tuple[Inbox, int]],
) -> None:
    inbox, port = smtp_server()
    with Replay(config_for()) as replay:
        replay.run(
            copy_slowly(too_big("big"), drop_root / "plate", 0.0, 0.01), until=ended(failed=1)
        )
    found = batches(mail_config(config_for, port))
    assert found["plate"].state is BatchState.FAILED
    assert inbox.letters == []


def test_a_relay_that_says_try_later_gets_the_letter_at_the_next_attempt(
    config_for: Callable[..., Config],
    too_big: Callable[..., Path],
    drop_root: Path,
    smtp_server: Callable[..., tuple[Inbox, int]],
) -> None:
    inbox, port = smtp_server()
    inbox.busy_once.add("tester@example.org")
    with Replay(mail_config(config_for, port)) as replay:
        steps = copy_slowly(too_big("big"), drop_root / "plate", 0.0, 0.01)
        replay.run(steps, until=lambda s: len(inbox.letters) == 1, timeout=60)
    found = batches(mail_config(config_for, port))
    assert mail_notes(config_for(), found["plate"]) == ["e-mail to tester@example.org"]
    assert inbox.busy_once == set()  # it was refused once, then taken
