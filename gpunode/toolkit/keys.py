"""The repository signing key: fetch it, read it (ASCII-armored or binary OpenPGP), check its fingerprint.

Pure Python on purpose: a minimal node has `gpgv` (apt needs it) but often not `gpg`, and all a keyring
file for apt's `signed-by=` needs is the key's binary packets, i.e. what `gpg --dearmor` writes. The
fingerprint is computed from the primary key packets as RFC 4880 (v4) and RFC 9580 (v6) define it, so the
key is trusted only when every primary key in it is one gpunode expects.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass

from gpunode.errors import GpunodeError, NotFound

# NVIDIA CORPORATION (Open Source Projects) <cudatools@nvidia.com>: the key that signs
# https://nvidia.github.io/libnvidia-container (apt, rpm and zypper repositories alike).
NVIDIA_FINGERPRINTS: tuple[str, ...] = ("C95B321B61E88C1809C4F759DDCAE044F796ECB0",)
KEY_DOWNLOAD_LIMIT = 1 * 2**20  # NVIDIA's key is ~4 KiB; anything this large is not a key
FETCH_TIMEOUT = (10.0, 30.0)  # (connect, read) seconds
# The whole download: a mirror that trickles its answer (each read in time) must not hold the install.
FETCH_DEADLINE = 60.0

_ARMOR_BEGIN = "-----BEGIN PGP PUBLIC KEY BLOCK-----"
_ARMOR_END = "-----END PGP PUBLIC KEY BLOCK-----"
_TAG_SECRET_KEY = 5
_TAG_PUBLIC_KEY = 6
_TAG_SECRET_SUBKEY = 7


class SigningKeyError(GpunodeError):
    """The key cannot be read or is not the one expected (exit 3: nothing was written)."""


@dataclass(frozen=True)
class PublicKey:
    packets: bytes  # the binary OpenPGP packets: an apt keyring (`gpg --dearmor` output)
    fingerprints: tuple[str, ...]  # one per primary key, upper-case hex
    source: str  # where it came from, for messages

    @property
    def armored(self) -> str:
        """The key as an ASCII-armored block (what rpm and zypper import)."""
        body = base64.b64encode(self.packets).decode("ascii")
        lines = [body[i : i + 64] for i in range(0, len(body), 64)]
        crc = base64.b64encode(_crc24(self.packets).to_bytes(3, "big")).decode("ascii")
        return "\n".join([_ARMOR_BEGIN, "", *lines, f"={crc}", _ARMOR_END, ""])


def normalize_fingerprint(text: str) -> str:
    """'c95b 321b ...' → 'C95B321B...'; anything but 40 (v4) or 64 (v6) hex digits is a usage error."""
    value = re.sub(r"[\s:]", "", text).upper().removeprefix("0X")
    if not re.fullmatch(r"[0-9A-F]{40}|[0-9A-F]{64}", value):
        raise GpunodeError(
            f"{text!r} is not a key fingerprint (40 or 64 hexadecimal digits)",
            "copy it from `gpg --show-keys --with-fingerprint KEYFILE`",
        )
    return value


def parse_key(data: bytes, source: str) -> PublicKey:
    """Read an armored or binary public key. Anything else — HTML from a proxy, a secret key, garbage —
    is refused with a message that says what it was."""
    stripped = data.lstrip()
    if stripped.startswith(b"-----BEGIN"):
        # Every block, not just the first: a second key appended to a trusted one must be seen (and refused).
        text = stripped.decode("ascii", "replace")
        blocks = text.split(_ARMOR_BEGIN)[1:] or [text]
        packets = b"".join(_dearmor(_ARMOR_BEGIN + block, source) for block in blocks)
    elif data and data[0] & 0x80:
        packets = data
    else:
        preview = data[:40].decode("utf-8", "replace").strip().splitlines()
        raise SigningKeyError(
            f"{source} is not an OpenPGP public key"
            + (f" (it starts with {preview[0]!r})" if preview and preview[0] else " (it is empty)"),
            "check the URL or file: it should hold NVIDIA's ASCII-armored key (…/libnvidia-container/gpgkey)",
        )
    fingerprints = _primary_fingerprints(packets, source)
    if not fingerprints:
        raise SigningKeyError(f"{source} holds no public key", "check the URL or file it came from")
    return PublicKey(packets=packets, fingerprints=tuple(fingerprints), source=source)


def check_trusted(key: PublicKey, expected: tuple[str, ...], *, custom: bool) -> None:
    """Every primary key must be an expected one: a key file with an extra key appended is refused too."""
    unexpected = [fpr for fpr in key.fingerprints if fpr not in expected]
    if not unexpected:
        return
    whose = "the fingerprint you gave" if custom else "NVIDIA's"
    raise SigningKeyError(
        f"refusing the signing key from {key.source}: its fingerprint {_spaced(unexpected[0])} is not "
        f"{whose} ({', '.join(_spaced(e) for e in expected)})",
        "check where the key came from; for a mirror signed with your own key pass "
        "--key-fingerprint with that key's fingerprint",
    )


def read_key_file(path: str) -> bytes:
    """The operator's own key file (a path on this machine, also under --root: it is input, not host
    configuration). Read with the Host's guards: a FIFO or a device (/dev/zero) is refused, never waited
    on or read without end."""
    from gpunode.host import Host

    try:
        data = Host().read_bytes(os.path.abspath(path))
    except NotFound:
        data = None
    except GpunodeError as exc:  # a FIFO, a device, a directory, a file over the Host's read limit
        raise SigningKeyError(
            f"cannot read key file {path}: {exc.message}", "give the path of the key file"
        ) from exc
    if data is None:
        raise NotFound(f"key file {path} does not exist", "give the path of the repository's key")
    if len(data) > KEY_DOWNLOAD_LIMIT:
        raise SigningKeyError(f"key file {path} is larger than 1 MiB; that is not a key")
    return data


def fetch_key(
    url: str, timeout: tuple[float, float] = FETCH_TIMEOUT, deadline: float = FETCH_DEADLINE
) -> bytes:
    """Download the key over HTTP(S); TLS is always verified. The whole download has a deadline and a
    size limit (gpunode.kube.transport). Each failure is one sentence with a fix."""
    import requests

    from gpunode.kube import transport

    fix = "check the node's network or proxy, point --repo-url at a reachable mirror, or pass --key-file"
    try:
        with transport.session() as http:
            # The environment's proxies and CAs apply (trust_env), as for the package manager itself.
            answer = transport.request(
                http,
                "GET",
                url,
                connect=timeout[0],
                read=timeout[1],
                deadline=deadline,
                max_bytes=KEY_DOWNLOAD_LIMIT,
                max_redirects=5,  # a mirror may redirect (http to https, another host): the key is checked
            )
        if answer.status_code != 200:
            raise SigningKeyError(
                f"cannot download the signing key: {url} answered HTTP {answer.status_code}", fix
            )
        return answer.body
    except transport.TooLarge as exc:
        raise SigningKeyError(f"{url} sent more than 1 MiB; that is not a signing key", fix) from exc
    except transport.DeadlineExceeded as exc:
        raise SigningKeyError(
            f"cannot download the signing key from {url}: no complete answer within {deadline:g} s", fix
        ) from exc
    except requests.exceptions.SSLError as exc:
        raise SigningKeyError(
            f"cannot download the signing key from {url}: TLS certificate verification failed ({exc})",
            "install the CA that signs the mirror's certificate into the system trust store, or pass "
            "--key-file",
        ) from exc
    except requests.exceptions.Timeout as exc:
        raise SigningKeyError(
            f"cannot download the signing key from {url}: no answer within {timeout[1]:g} s", fix
        ) from exc
    except requests.exceptions.RequestException as exc:
        reason = _short_reason(exc)
        raise SigningKeyError(f"cannot download the signing key from {url}: {reason}", fix) from exc


def _short_reason(exc: Exception) -> str:
    text = str(exc)
    for marker in (
        "Connection refused",
        "Name or service not known",
        "Temporary failure in name resolution",
        "No route to host",
        "Network is unreachable",
    ):
        if marker in text:
            return marker.lower()
    return text.split(": ", 1)[-1][:200]


def _dearmor(text: str, source: str) -> bytes:
    # Text, not bytes: the armor was decoded with U+FFFD for every non-ASCII byte, which bytes could not
    # hold again (encoding it back raised UnicodeEncodeError: exit 70 for a key with one stray byte).
    begin = text.find(_ARMOR_BEGIN)
    end = text.find(_ARMOR_END)
    if begin < 0 or end < begin:
        raise SigningKeyError(f"{source} is ASCII armor, but not a PGP PUBLIC KEY BLOCK")
    lines = text[begin + len(_ARMOR_BEGIN) : end].strip("\r\n").splitlines()
    # Armor headers ("Version: ...", "Comment: ...") end at the first empty line, when there are any.
    if any(":" in line for line in lines[:1]):
        blank = next((i for i, line in enumerate(lines) if not line.strip()), None)
        lines = lines[blank + 1 :] if blank is not None else lines
    body = [line.strip() for line in lines if line.strip()]
    checksum = None
    if body and body[-1].startswith("=") and len(body[-1]) == 5:
        checksum = body.pop()
    try:
        packets = base64.b64decode("".join(body), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SigningKeyError(f"{source}: the armored key is corrupt ({exc})") from exc
    if checksum is not None:
        try:
            want = int.from_bytes(base64.b64decode(checksum[1:]), "big")
        except (binascii.Error, ValueError) as exc:
            raise SigningKeyError(f"{source}: the armored key's checksum line is corrupt") from exc
        if _crc24(packets) != want:
            raise SigningKeyError(f"{source}: the armored key is corrupt (checksum mismatch)")
    return packets


def _primary_fingerprints(packets: bytes, source: str) -> list[str]:
    found: list[str] = []
    for tag, body in _packets(packets, source):
        if tag in (_TAG_SECRET_KEY, _TAG_SECRET_SUBKEY):
            raise SigningKeyError(f"{source} holds a SECRET key; give the public key only")
        if tag == _TAG_PUBLIC_KEY:
            found.append(_fingerprint(body, source))
    return found


def _packets(data: bytes, source: str) -> list[tuple[int, bytes]]:
    """(tag, body) of each packet, both header formats (RFC 4880 §4.2)."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    corrupt = SigningKeyError(f"{source}: the key's OpenPGP packets are corrupt")
    while pos < len(data):
        first = data[pos]
        if not first & 0x80:
            raise corrupt
        if first & 0x40:  # new format
            tag = first & 0x3F
            if pos + 1 >= len(data):
                raise corrupt
            o1 = data[pos + 1]
            if o1 < 192:
                length, pos = o1, pos + 2
            elif o1 < 224:
                if pos + 2 >= len(data):
                    raise corrupt
                length, pos = ((o1 - 192) << 8) + data[pos + 2] + 192, pos + 3
            elif o1 == 255:
                length, pos = int.from_bytes(data[pos + 2 : pos + 6], "big"), pos + 6
            else:  # partial body lengths: never used for key material
                raise corrupt
        else:  # old format
            tag = (first >> 2) & 0x0F
            size = {0: 1, 1: 2, 2: 4}.get(first & 0x03)
            if size is None:
                raise corrupt
            length, pos = int.from_bytes(data[pos + 1 : pos + 1 + size], "big"), pos + 1 + size
        if pos + length > len(data):
            raise corrupt
        out.append((tag, data[pos : pos + length]))
        pos += length
    return out


def _fingerprint(body: bytes, source: str) -> str:
    version = body[0] if body else 0
    if version == 4:
        if len(body) > 0xFFFF:  # the v4 fingerprint hashes a 2-byte length: no v4 key is larger
            raise SigningKeyError(f"{source}: the key's OpenPGP packets are corrupt (a v4 key over 64 KiB)")
        return hashlib.sha1(b"\x99" + len(body).to_bytes(2, "big") + body).hexdigest().upper()  # noqa: S324 (the v4 fingerprint is SHA-1 by definition)
    if version == 6:
        return hashlib.sha256(b"\x9b" + len(body).to_bytes(4, "big") + body).hexdigest().upper()
    raise SigningKeyError(f"{source}: OpenPGP key version {version} is not supported (v4 and v6 are)")


def _crc24(data: bytes) -> int:
    crc = 0xB704CE
    for byte in data:
        crc ^= byte << 16
        for _ in range(8):
            crc <<= 1
            if crc & 0x1000000:
                crc ^= 0x1864CFB
    return crc & 0xFFFFFF


def _spaced(fingerprint: str) -> str:
    return " ".join(fingerprint[i : i + 4] for i in range(0, len(fingerprint), 4))
