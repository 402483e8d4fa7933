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


@pytest.mark.parametrize(
    ("case", "flag", "says"),
    [
        ("missing cert", "--ssl-certfile", "no such file"),
        ("cert is a directory", "--ssl-certfile", "directory"),
        ("cert is no certificate", "--ssl-certfile", "no PEM certificate"),
        ("missing key", "--ssl-keyfile", "no such file"),
        ("key is no key", "--ssl-keyfile", "no PEM private key"),
        ("key of another certificate", "--ssl-keyfile", "does not match"),
        ("encrypted key", "--ssl-keyfile", "encrypted"),
    ],
)
def test_an_unusable_certificate_or_key_is_one_line_and_exit_2(
    tmp_path: Path, case: str, flag: str, says: str
) -> None:
    cert, key = self_signed_cert(tmp_path)
    other_cert, other_key = self_signed_cert(tmp_path, "other-")
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM at all\n")
    encrypted = tmp_path / "encrypted.pem"
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
    cert_arg, key_arg = {
        "missing cert": (tmp_path / "nope.pem", key),
        "cert is a directory": (tmp_path, key),
        "cert is no certificate": (junk, key),
        "missing key": (cert, tmp_path / "nope.pem"),
        "key is no key": (cert, junk),
        "key of another certificate": (cert, other_key),
        "encrypted key": (cert, encrypted),
    }[case]
    done = _serve(cert_arg, key_arg)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr
    assert flag in lines[0] and says in lines[0], lines[0]
