"""A TLS certificate or key ``kvmeta serve`` cannot use stops start-up with one line naming the
flag and the problem (exit 2), before anything is bound."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import child_env, self_signed_cert


def _serve(cert: Path, key: Path) -> subprocess.CompletedProcess[str]:
    args = ["serve", "--in-memory", "--port", "0", "--ssl-certfile", str(cert)]
    return subprocess.run(
        [sys.executable, "-m", "kvmeta", *args, "--ssl-keyfile", str(key)],
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # no terminal to prompt on for a passphrase
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A certificate and its key, another certificate's key, a non-PEM file, an encrypted key."""
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(tmp)
    _, other_key = self_signed_cert(tmp, "other-")
    junk = tmp / "junk.pem"
    junk.write_text("not PEM at all\n")
    encrypted = tmp / "encrypted.pem"
    subprocess.run(
        [
            "openssl",
            "pkey",
            "-in",
            str(key),
            "-aes256",
            "-passout",
            "pass:pw",
            "-out",
            str(encrypted),
        ],
        check=True,
        capture_output=True,
    )
    return {"dir": tmp, "cert": cert, "key": key, "other_key": other_key, "junk": junk,
            "encrypted": encrypted, "missing": tmp / "nope.pem"}  # fmt: skip


@pytest.mark.parametrize(
    ("cert", "key", "flag", "says"),
    [
        ("missing", "key", "--ssl-certfile", "no such file"),
        ("dir", "key", "--ssl-certfile", "directory"),
        ("junk", "key", "--ssl-certfile", "no PEM certificate"),
        ("cert", "missing", "--ssl-keyfile", "no such file"),
        ("cert", "junk", "--ssl-keyfile", "no PEM private key"),
        ("cert", "other_key", "--ssl-keyfile", "does not match"),
        ("cert", "encrypted", "--ssl-keyfile", "encrypted"),
    ],
)
def test_an_unusable_certificate_or_key_is_one_line_and_exit_2(
    files: dict[str, Path], cert: str, key: str, flag: str, says: str
) -> None:
    done = _serve(files[cert], files[key])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr
    assert flag in lines[0] and says in lines[0], lines[0]
