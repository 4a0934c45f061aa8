"""A test PKI made with the openssl command line (Debian package openssl): a CA, server and client certs.

The certificates follow what strict verifiers require (Python 3.13 sets VERIFY_X509_STRICT): a critical
basicConstraints on the CA, key identifiers, keyUsage and extendedKeyUsage on the leaves, names only in
subjectAltName. EC P-256 keys, because they are made in milliseconds.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
subjectAltName = {san}
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
"""


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed for the test PKI (Debian package openssl)")
    subprocess.run([openssl, *args], check=True, capture_output=True, timeout=30)


def _subject(cn: str, orgs: Sequence[str]) -> str:
    # openssl's -subj syntax: "/" separates attributes, so a name holding one is escaped.
    def esc(value: str) -> str:
        return value.replace("\\", "\\\\").replace("/", "\\/")

    return "".join(f"/O={esc(o)}" for o in orgs) + f"/CN={esc(cn)}"


@dataclass(frozen=True)
class Pki:
    """A CA in `directory`, and the certificates it issues there."""

    directory: Path
    ca: CertPair

    @classmethod
    def create(cls, directory: Path, name: str = "gpunode-test-ca") -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / name
        config = directory / f"{name}.cnf"
        config.write_text(CONFIG.format(san="DNS:unused"))
        _openssl(
            "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{stem}.key", "-out", f"{stem}.crt", "-days", "2", "-subj", f"/CN={name}",
            "-config", str(config), "-extensions", "ca",
        )  # fmt: skip
        return cls(directory, CertPair(Path(f"{stem}.crt"), Path(f"{stem}.key")))

    def server(
        self, hosts: Sequence[str] = ("127.0.0.1", "localhost", "::1"), name: str = "apiserver"
    ) -> CertPair:
        """A serving certificate for `hosts` (IP addresses and DNS names, in subjectAltName)."""
        san = ",".join(f"IP:{h}" if h[0].isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
        return self._issue(name, "kube-apiserver", (), "server", san)

    def client(self, user: str, groups: Sequence[str] = (), name: str | None = None) -> CertPair:
        """A client certificate as Kubernetes reads them: CN is the user, each O a group."""
        return self._issue(name or f"client-{secrets.token_hex(4)}", user, groups, "client", "DNS:unused")

    def _issue(self, name: str, cn: str, orgs: Sequence[str], kind: str, san: str) -> CertPair:
        stem = self.directory / name
        config = self.directory / f"{name}.cnf"
        config.write_text(CONFIG.format(san=san))
        _openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj", _subject(cn, orgs),
            "-config", str(config),
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{stem}.csr", "-CA", str(self.ca.cert), "-CAkey", str(self.ca.key),
            "-set_serial", str(secrets.randbits(63)), "-days", "2", "-out", f"{stem}.crt",
            "-extfile", str(config), "-extensions", kind,
        )  # fmt: skip
        return CertPair(Path(f"{stem}.crt"), Path(f"{stem}.key"))
