"""The signing key: read armored and binary keys, fingerprints as gpg computes them, refusals."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpunode.errors import GpunodeError
from gpunode.toolkit import keys

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures/toolkit"
RSA = (FIXTURES / "test-key-rsa.asc").read_bytes()
RSA_FPR = "BEAA704E2C010DC785031E04262B7125F6CCD064"
ED25519 = (FIXTURES / "test-key-ed25519.asc").read_bytes()
ED25519_FPR = "F66B1098FE6D47A93A77FF09BCECAC8362F6FC7F"


def gpg(*args: str, input: bytes | None = None, home: Path) -> bytes:
    """The real gpg (the test bed has it: Debian gnupg); a missing gpg fails under CI, skips elsewhere."""
    if shutil.which("gpg") is None:
        if os.environ.get("CI"):
            pytest.fail("gpg is not installed (Debian package gnupg), and CI must cross-check against it")
        pytest.skip("gpg is not installed (CI fails instead of skipping)")
    env = {**os.environ, "GNUPGHOME": str(home)}
    home.mkdir(mode=0o700, exist_ok=True)
    return subprocess.run(
        ["gpg", "--batch", *args], input=input, capture_output=True, check=True, env=env, timeout=120
    ).stdout


@pytest.mark.parametrize(("armored", "fpr"), [(RSA, RSA_FPR), (ED25519, ED25519_FPR)])
def test_fingerprint_and_dearmor_are_what_gpg_says(armored: bytes, fpr: str, tmp_path: Path) -> None:
    key = keys.parse_key(armored, "fixture")
    assert key.fingerprints == (fpr,)
    listing = gpg("--with-colons", "--show-keys", input=armored, home=tmp_path / "g").decode()
    assert f"fpr:::::::::{fpr}:" in listing.splitlines()[1]
    assert key.packets == gpg("--dearmor", input=armored, home=tmp_path / "g")


def test_binary_keys_and_our_own_armor_round_trip(tmp_path: Path) -> None:
    binary = keys.parse_key(RSA, "a").packets
    key = keys.parse_key(binary, "b")
    assert key.fingerprints == (RSA_FPR,)
    rearmored = key.armored.encode()
    assert keys.parse_key(rearmored, "c").packets == binary
    # gpg checks the CRC-24 line of what rpm and zypper will import
    assert RSA_FPR in gpg("--with-colons", "--show-keys", input=rearmored, home=tmp_path / "g").decode()


def _new_format(packets: bytes) -> bytes:
    """The same packets with new-format headers (RFC 4880 4.2.2), the way other OpenPGP tools write them."""
    out = b""
    for tag, body in keys._packets(packets, "x"):
        n = len(body)
        if n < 192:
            length = bytes([n])
        elif n < 8384:
            n -= 192
            length = bytes([(n >> 8) + 192, n & 0xFF])
        else:
            length = b"\xff" + len(body).to_bytes(4, "big")
        out += bytes([0xC0 | tag]) + length + body
    return out


def test_new_format_packet_headers_give_the_same_fingerprint() -> None:
    packets = keys.parse_key(RSA, "a").packets
    assert keys.parse_key(_new_format(packets), "n").fingerprints == (RSA_FPR,)


def test_headers_in_the_armor_are_skipped() -> None:
    text = RSA.decode().replace(
        "-----BEGIN PGP PUBLIC KEY BLOCK-----\n", "-----BEGIN PGP PUBLIC KEY BLOCK-----\nComment: test\n"
    )
    assert keys.parse_key(text.encode(), "h").fingerprints == (RSA_FPR,)


def test_every_armored_block_is_read() -> None:
    key = keys.parse_key(RSA + ED25519, "both")
    assert key.fingerprints == (RSA_FPR, ED25519_FPR)
    with pytest.raises(GpunodeError, match=r"fingerprint F66B 1098 .* is not the fingerprint you gave"):
        keys.check_trusted(key, (RSA_FPR,), custom=True)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            b"<!DOCTYPE html><html>proxy login</html>",
            "is not an OpenPGP public key \\(it starts with '<!DOCTYPE",
        ),
        (b"", "is not an OpenPGP public key \\(it is empty\\)"),
        (RSA[: len(RSA) // 2] + b"\n-----END PGP PUBLIC KEY BLOCK-----\n", "corrupt"),
        (b"-----BEGIN PGP MESSAGE-----\nxx\n-----END PGP MESSAGE-----\n", "not a PGP PUBLIC KEY BLOCK"),
        (keys.parse_key(RSA, "x").packets[:100], "packets are corrupt"),
    ],
)
def test_what_is_not_a_key_is_refused_clearly(data: bytes, message: str) -> None:
    with pytest.raises(GpunodeError, match=message):
        keys.parse_key(data, "the download")


def test_a_wrong_checksum_is_refused() -> None:
    lines = RSA.decode().splitlines()
    crc = next(i for i, line in enumerate(lines) if line.startswith("=") and len(line) == 5)
    lines[crc] = "=AAAA" if lines[crc] != "=AAAA" else "=BBBB"
    with pytest.raises(GpunodeError, match="checksum mismatch"):
        keys.parse_key("\n".join(lines).encode(), "k")


def test_a_secret_key_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "g"
    gpg(
        "--passphrase",
        "",
        "--quick-gen-key",
        "secret <s@example.invalid>",
        "ed25519",
        "sign",
        "never",
        home=home,
    )
    secret = gpg("--pinentry-mode", "loopback", "--passphrase", "", "--export-secret-keys", home=home)
    with pytest.raises(GpunodeError, match="holds a SECRET key"):
        keys.parse_key(secret, "secret.gpg")


def test_nvidias_fingerprint_is_the_default_and_named_in_the_refusal() -> None:
    key = keys.parse_key(RSA, "https://nvidia.github.io/libnvidia-container/gpgkey")
    with pytest.raises(GpunodeError) as err:
        keys.check_trusted(key, keys.NVIDIA_FINGERPRINTS, custom=False)
    assert "is not NVIDIA's (C95B 321B 61E8 8C18 09C4 F759 DDCA E044 F796 ECB0)" in str(err.value)
    keys.check_trusted(key, (RSA_FPR,), custom=True)  # no error


@pytest.mark.parametrize(
    "text", [RSA_FPR, RSA_FPR.lower(), "BEAA 704E 2C01 0DC7 8503  1E04 262B 7125 F6CC D064", "0x" + RSA_FPR]
)
def test_fingerprints_are_normalised(text: str) -> None:
    assert keys.normalize_fingerprint(text) == RSA_FPR


@pytest.mark.parametrize("text", ["DDCAE044F796ECB0", "xyz", RSA_FPR + "0"])
def test_short_ids_and_garbage_are_not_fingerprints(text: str) -> None:
    with pytest.raises(GpunodeError, match="is not a key fingerprint"):
        keys.normalize_fingerprint(text)


# -- downloading the key from a hostile mirror -------------------------------------------------------------


def test_a_mirror_that_trickles_the_key_is_given_up_at_the_deadline() -> None:
    from tests.kubeapi.apiserver import ApiServer

    with ApiServer() as mirror:  # plain HTTP; its hostile answers do not depend on the path
        mirror.trickle_next(0.25, limit=20.0)  # each byte well within the 2 s read timeout
        with pytest.raises(keys.SigningKeyError) as raised:
            keys.fetch_key(f"{mirror.url}/gpgkey", timeout=(1.0, 2.0), deadline=1.0)
        assert raised.value.message == (
            f"cannot download the signing key from {mirror.url}/gpgkey: no complete answer within 1 s"
        )
        assert mirror.streamed < 200  # given up after about a second of the server's 20


@pytest.mark.parametrize("announce", [2**30, None], ids=["declared", "chunked"])
def test_a_mirror_that_sends_without_end_is_stopped_at_1_mib(announce: int | None) -> None:
    from tests.kubeapi.apiserver import ApiServer

    with ApiServer() as mirror:
        mirror.flood_next(announce=announce)
        with pytest.raises(keys.SigningKeyError, match="sent more than 1 MiB; that is not a signing key"):
            keys.fetch_key(f"{mirror.url}/gpgkey")
        assert mirror.streamed < 64 * 2**20


def test_a_redirect_with_a_body_without_end_is_stopped_at_1_mib_too() -> None:
    # requests itself reads a redirect's whole body before following it: gpunode follows redirects itself.
    from tests.kubeapi.apiserver import ApiServer

    with ApiServer() as mirror:
        mirror.flood_next(announce=None, code=302, headers={"Location": "/elsewhere/gpgkey"})
        with pytest.raises(keys.SigningKeyError, match="sent more than 1 MiB; that is not a signing key"):
            keys.fetch_key(f"{mirror.url}/gpgkey")
        assert mirror.streamed < 64 * 2**20


def test_redirects_are_followed_to_the_key() -> None:
    from tests.kubeapi.apiserver import ApiServer

    with ApiServer() as mirror:
        mirror.raw_next(b"", code=301, headers={"Location": "/moved/gpgkey"})
        mirror.raw_next(b"", code=302, headers={"Location": f"{mirror.url}/again/gpgkey"})
        mirror.raw_next(RSA)
        assert keys.fetch_key(f"{mirror.url}/gpgkey") == RSA
        assert [r.path for r in mirror.requests] == ["/gpgkey", "/moved/gpgkey", "/again/gpgkey"]
        for _ in range(6):
            mirror.raw_next(b"", code=302, headers={"Location": "/loop"})
        with pytest.raises(keys.SigningKeyError, match="more than 5 redirects"):
            keys.fetch_key(f"{mirror.url}/gpgkey")
