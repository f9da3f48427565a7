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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword
from replay import Replay, Step, copy_slowly

from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch, NewBatch
from daemon.core.states import BatchState
from daemon.loop.service import Service
from daemon.site.config import Config
from daemon.store import Store

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


@dataclass
class Scene:
    """A real SMTP server on 127.0.0.1 and a drop root, with what the tests do with them."""

    inbox: Inbox
    port: int
    config_for: Callable[..., Config]
    staged: Callable[..., Path]
    drop_root: Path

    def config(self, mail: bool = True, **options: object) -> Config:
        if not mail:
            return self.config_for()
        settings = {"enabled": True, "host": "127.0.0.1", "port": self.port, "from": SENDER}
        return self.config_for(mail={**settings, "timeout_seconds": 10, **options})

    def failing(self, name: str, start: float = 0.0, **manifest_options: object) -> list[Step]:
        """Copy in a batch whose first image is larger than its manifest says: it fails at
        once, naming the file, and runs no job."""
        folder = self.staged(name, count=2, **manifest_options)
        with open(folder / "images" / "img_0000.png", "ab") as image:
            image.write(b"trailing bytes")
        return copy_slowly(folder, self.drop_root / name, start, 0.01)

    def run(self, config: Config, steps: list[Step], until: Callable[[Service], bool]) -> None:
        with Replay(config) as replay:
            replay.run(steps, until=until, timeout=180)
        # leaving the daemon let its mailer deliver what was queued

    def restart(self) -> dict[str, Batch]:
        """A fresh daemon on the same database (it must mail nothing again); the batches."""
        with Replay(self.config()) as replay:
            replay.run(quiet_seconds=0.5)
            return {b.folder: b for b in replay.service.store.batches()}

    def notes(self, batch: Batch) -> list[str]:
        store = Store(self.config_for().daemon.database)
        try:
            return [e.reason for e in store.events(batch.id) if e.reason.startswith("e-mail")]
        finally:
            store.close()


@pytest.fixture
def scene(
    request: pytest.FixtureRequest,
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
) -> Iterator[Scene]:
    """Parametrised indirectly with ``True`` for a server that requires STARTTLS and a login."""
    options: dict[str, Any] = {}
    inbox, port = Inbox(), free_port()
    if getattr(request, "param", False):
        tls = request.getfixturevalue("tls_context")
        options.update(tls_context=tls, authenticator=inbox.authenticate, require_starttls=True)
    controller = Controller(inbox, hostname="127.0.0.1", port=port, **options)
    controller.start()
    try:
        yield Scene(inbox, port, config_for, staged, drop_root)
    finally:
        controller.stop()


def ended(done: int = 0, failed: int = 0) -> Callable[[Service], bool]:
    def check(service: Service) -> bool:
        counts = service.store.counts()
        return counts[BatchState.DONE] == done and counts[BatchState.FAILED] == failed

    return check


def test_the_owner_gets_one_letter_when_a_batch_ends_done_or_failed_and_none_without_address(
    scene: Scene,
) -> None:
    steps = [
        *copy_slowly(
            scene.staged("good", owner="Ada Expert"), scene.drop_root / "plate 1 ä", 0.0, 0.01
        ),
        *scene.failing("plate 2", owner="Ada Expert"),
        *scene.failing("plate 3", email=None),
    ]
    scene.run(scene.config(), steps, until=ended(done=1, failed=2))

    found = scene.restart()
    assert sorted(found) == ["plate 1 ä", "plate 2", "plate 3"]
    assert len(scene.inbox.letters) == 2
    by_subject = {str(m["Subject"]): m for m in scene.inbox.letters}
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

    assert scene.notes(good) == ["e-mail to tester@example.org"]
    assert scene.notes(found["plate 2"]) == ["e-mail to tester@example.org"]
    assert scene.notes(found["plate 3"]) == []


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


@pytest.mark.parametrize("scene", [True], indirect=True, ids=["starttls"])
def test_starttls_and_a_login_with_the_password_from_its_file(scene: Scene, tmp_path: Path) -> None:
    secret = tmp_path / "smtp-password"
    secret.write_text("s3cret pass\n")
    config = scene.config(starttls=True, username="watchd", password_file=str(secret))
    scene.run(config, scene.failing("plate"), until=ended(failed=1))
    assert scene.inbox.logins == [("watchd", "s3cret pass")]
    assert [str(m["Subject"]) for m in scene.inbox.letters] == [
        "watchd: plate FAILED: inputs differ from the manifest"
    ]


def test_a_refused_letter_is_recorded_on_the_batch_and_the_daemon_goes_on(scene: Scene) -> None:
    scene.inbox.refuse.add("nobody@example.org")
    steps = [*scene.failing("one", email="nobody@example.org"), *scene.failing("two", 0.5)]
    scene.run(scene.config(), steps, until=ended(failed=2))
    found = scene.restart()
    assert scene.notes(found["one"]) == [
        "e-mail to nobody@example.org",
        "e-mail to nobody@example.org failed: nobody@example.org: 550 5.1.1 no such mailbox here",
    ]
    assert scene.notes(found["two"]) == ["e-mail to tester@example.org"]
    assert [m["To"] for m in scene.inbox.letters] == ["tester@example.org"]


def test_turning_mail_on_later_mails_none_of_the_batches_that_ended_before(scene: Scene) -> None:
    scene.run(scene.config(mail=False), scene.failing("plate"), until=ended(failed=1))
    found = scene.restart()
    assert found["plate"].state is BatchState.FAILED
    assert scene.inbox.letters == []


def test_a_relay_that_says_try_later_gets_the_letter_at_the_next_attempt(scene: Scene) -> None:
    scene.inbox.busy_once.add("tester@example.org")
    scene.run(scene.config(), scene.failing("plate"), until=lambda s: len(scene.inbox.letters) == 1)
    assert scene.notes(scene.restart()["plate"]) == ["e-mail to tester@example.org"]
    assert scene.inbox.busy_once == set()  # it was refused once, then taken


def test_a_contact_of_two_addresses_recorded_by_an_older_watchd_is_not_mailed(
    scene: Scene,
) -> None:
    """A database from before addresses were checked may hold 'a@example.org,root': the
    batch's end is noted on it, and no letter goes to either."""
    mail = {"enabled": True, "host": "127.0.0.1", "port": scene.port, "from": SENDER}
    config = scene.config_for(mail=mail, intake={"timeout_seconds": 1})
    folder = scene.drop_root / "old"
    folder.mkdir()  # its manifest is gone; the batch waits for inputs that never come
    text = (scene.staged("old", count=1) / "manifest.toml").read_text()
    store = Store.open(config.daemon.database)
    try:
        new = NewBatch(
            str(scene.drop_root), "old", "0" * 64, text, "", Kind.INFERENCE, "", "A",
            "tester@example.org,root", str(folder / "results" / "run"),
        )  # fmt: skip
        store.create_batch(new, BatchState.WAITING, "manifest accepted", time.time())
    finally:
        store.close()
    scene.run(config, [], until=ended(failed=1))
    (batch,) = scene.restart().values()
    assert scene.notes(batch) == ["e-mail to 'tester@example.org,root' not sent: not one address"]
    assert scene.inbox.letters == []
