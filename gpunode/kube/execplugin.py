"""Exec credential plugins (a kubeconfig user's `exec`: `aws eks get-token`, `gke-gcloud-auth-plugin`,
`kubelogin`), run the way client-go runs them (k8s.io/client-go/plugin/pkg/client/auth/exec/exec.go, and
tools/clientcmd for the kubeconfig side):

- `apiVersion` client.authentication.k8s.io/v1 or v1beta1 (v1alpha1 is gone since Kubernetes 1.24). The
  program's standard output must be an ExecCredential of that same apiVersion, whose status holds a
  bearer `token`, or a `clientCertificateData` and `clientKeyData` (PEM, both or neither), and may hold an
  `expirationTimestamp` (RFC 3339).
- The program gets KUBERNETES_EXEC_INFO, `{"kind":"ExecCredential","apiVersion":…,"spec":{"interactive":
  …}}`, with `spec.cluster` (server, CA data, tls-server-name, proxy-url, the cluster's
  `client.authentication.k8s.io/exec` extension as `config`) when `provideClusterInfo` is set. Its
  environment is gpunode's with the kubeconfig's `env` entries over it, KUBERNETES_EXEC_INFO last.
- `interactiveMode`: Never (the program gets no standard input), IfAvailable (it gets gpunode's when that
  is a terminal), Always (standard input must be a terminal, else an error before the program runs).
  Unset means IfAvailable for v1beta1 and is an error for v1, as in the kubeconfig's validation.
- A command with a `/` is relative to the kubeconfig's directory; a bare name is looked up on PATH.
- The credentials are kept for the process until `expirationTimestamp` (for the whole run without one),
  shared by every client with the same configuration (`up` makes several). After a 401 the program runs
  again, unless another request already replaced the credentials that were rejected.
- A program that is not installed: the `installHint`, as kubectl shows it.

What gpunode adds: a timeout (kubectl has none, and a plugin that hangs would hang gpunode with it), its
output bounded, and its standard error shown once it has exited (bounded, with the token it printed
hidden) unless it runs interactively: then its standard input and error are the terminal, as with
kubectl. Messages name the program, never its arguments or environment, which may hold secrets (some
plugins take a key as an argument).

Nothing is cached on disk: gpunode runs as root, and a token file it left behind would be a cluster
credential outliving the run in a place nobody looks after; the plugins keep their own caches (aws,
gcloud and kubelogin do), kubectl keeps none either, and one run of gpunode makes only a handful of
requests.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import PurePosixPath
from typing import Any

from gpunode.errors import CommandFailed, ConfigError, GpunodeError, NotFound, UsageError
from gpunode.host import CommandResult, Host, SubprocessRunner
from gpunode.kube.redact import scrub

log = logging.getLogger("gpunode.kube")

V1 = "client.authentication.k8s.io/v1"
V1BETA1 = "client.authentication.k8s.io/v1beta1"
V1ALPHA1 = "client.authentication.k8s.io/v1alpha1"
API_VERSIONS = (V1, V1BETA1)
INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")
EXEC_INFO = "KUBERNETES_EXEC_INFO"
CLUSTER_EXTENSION = "client.authentication.k8s.io/exec"
# `aws eks get-token` and `gke-gcloud-auth-plugin` answer in a second or two, more when they refresh a
# login over the network. A person signing in (a browser, a device code) needs minutes.
TIMEOUT = 60.0
INTERACTIVE_TIMEOUT = 300.0
MAX_OUTPUT = 2**20  # an ExecCredential is a few KiB, a certificate chain included
MAX_STDERR_SHOWN = 16 * 1024
PLUGINS_DOC = (
    "https://kubernetes.io/docs/reference/access-authn-authz/authentication/#client-go-credential-plugins"
)


@dataclass(frozen=True, repr=False)
class ExecConfig:
    """A kubeconfig user's `exec`, checked. `path` is the host path of the program when the command names
    a file (absolute, or relative to the kubeconfig), None for a name to look up on PATH. `cluster` is the
    JSON of KUBERNETES_EXEC_INFO's spec.cluster (provideClusterInfo), None without it. The repr names only
    the command: arguments and environment may hold secrets."""

    command: str
    path: str | None
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    api_version: str
    interactive_mode: str
    install_hint: str | None
    where: str  # 'user "u" in FILE', for messages
    cluster: str | None = None

    def __repr__(self) -> str:
        return f"ExecConfig({self.command!r}, {self.where})"

    @property
    def named(self) -> str:
        """The program for messages: `aws`, named by user "u" in FILE."""
        return f"the exec plugin `{self.command}` of {self.where}"

    def with_server(self, server: str) -> ExecConfig:
        """The same plugin for another server (--server): its cluster info names the server used."""
        if self.cluster is None:
            return self
        cluster = json.loads(self.cluster)
        cluster["server"] = server
        return replace(self, cluster=json.dumps(cluster, separators=(",", ":")))


def parse_exec(body: Any, *, where: str, kubeconfig: str, cluster: Mapping[str, Any] | None) -> ExecConfig:
    """A kubeconfig user's `exec` mapping, checked as kubectl's kubeconfig validation checks it.
    `cluster`: what spec.cluster would hold, passed on only with provideClusterInfo."""
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: exec is not a mapping")
    command = body.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ConfigError(f"{where}: exec has no command", "name the credential plugin in exec.command")
    api_version = body.get("apiVersion")
    if not isinstance(api_version, str) or not api_version:
        raise ConfigError(
            f"{where}: exec has no apiVersion", f"set exec.apiVersion: {V1} (or the one the plugin documents)"
        )
    if api_version not in API_VERSIONS:
        retired = " (removed in Kubernetes 1.24)" if api_version == V1ALPHA1 else ""
        raise ConfigError(
            f"{where}: exec apiVersion {api_version!r} is not supported{retired}",
            f"use {V1} or {V1BETA1}, whichever the plugin prints",
        )
    args = body.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) and "\0" not in a for a in args):
        raise ConfigError(f"{where}: exec args is not a list of strings (without NUL characters)")
    env: list[tuple[str, str]] = []
    for index, entry in enumerate(body.get("env") or []):
        name = entry.get("name") if isinstance(entry, dict) else None
        value = entry.get("value") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ConfigError(f"{where}: exec env[{index}] has no valid name")
        if value is None:
            value = ""
        if not isinstance(value, str) or "\0" in value:
            raise ConfigError(f"{where}: exec env[{index}] ({name}) has a value that is not a string")
        env.append((name, value))
    mode = body.get("interactiveMode") or None
    if mode is None:
        if api_version == V1:
            # kubectl refuses the kubeconfig too: v1 wants the choice made, v1beta1 defaults it.
            raise ConfigError(
                f"{where}: exec interactiveMode must be set for apiVersion {V1}",
                "set exec.interactiveMode: Never (or IfAvailable if the plugin may ask for a login)",
            )
        mode = "IfAvailable"
    if mode not in INTERACTIVE_MODES:
        raise ConfigError(
            f"{where}: exec interactiveMode {mode!r} is not one of {', '.join(INTERACTIVE_MODES)}"
        )
    hint = body.get("installHint")
    provide = body.get("provideClusterInfo", False)
    if not isinstance(provide, bool):
        raise ConfigError(f"{where}: exec provideClusterInfo is not true or false")
    path: str | None = None
    if "/" in command:
        # client-go resolves a command holding a path separator against the kubeconfig's directory; a bare
        # name stays a PATH lookup.
        path = command if command.startswith("/") else str(PurePosixPath(kubeconfig).parent / command)
    return ExecConfig(
        command=command,
        path=path,
        args=tuple(args),
        env=tuple(env),
        api_version=api_version,
        interactive_mode=mode,
        install_hint=hint if isinstance(hint, str) and hint.strip() else None,
        where=where,
        cluster=json.dumps(dict(cluster), separators=(",", ":")) if provide and cluster is not None else None,
    )


@dataclass(frozen=True, repr=False, eq=False)
class PluginCredential:
    """What a plugin gave: a bearer token, or a client certificate and key (PEM), or both; when they
    expire (None: not said). The repr shows none of it. Compared by identity: "is this still the
    credential that was rejected" is the question asked."""

    origin: str
    token: str | None
    cert_pem: bytes | None
    key_pem: bytes | None
    expires: datetime | None

    def __repr__(self) -> str:
        return f"PluginCredential({self.origin})"

    def expired(self, now: datetime) -> bool:
        # client-go's test: strictly after the expiry; no expiry means valid for the whole run.
        return self.expires is not None and now > self.expires

    def secrets(self) -> list[str]:
        found = [self.token or ""]
        if self.key_pem is not None:
            found.append(self.key_pem.decode("ascii", "replace"))
        return [s for s in found if s]

    @property
    def kinds(self) -> str:
        """What it holds, for messages: "a bearer token", "a client certificate", or both."""
        held = (
            ("a client certificate", self.cert_pem is not None),
            ("a bearer token", self.token is not None),
        )
        return " and ".join(kind for kind, present in held if present)


def stdin_is_terminal() -> bool:
    """Whether gpunode's standard input is a terminal: client-go asks the same of its os.Stdin."""
    try:
        return os.isatty(0)
    except OSError:
        return False


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Authenticator:
    """One plugin configuration's credentials for this process: run once, kept until they expire or are
    rejected. The lock also makes sure an interactive plugin asks once, not once per thread."""

    def __init__(self, host: Host, config: ExecConfig, now: Callable[[], datetime] = _utcnow) -> None:
        self.host = host
        self.config = config
        self._now = now
        self._lock = threading.Lock()
        self._cached: PluginCredential | None = None

    def __repr__(self) -> str:
        return f"Authenticator({self.config!r})"

    def credential(self) -> PluginCredential:
        """The cached credentials while they have not expired; else the program's fresh ones."""
        with self._lock:
            if self._cached is not None and not self._cached.expired(self._now()):
                return self._cached
            self._cached = None
            self._cached = self._run()
            return self._cached

    def refresh(self, rejected: PluginCredential) -> PluginCredential:
        """After a 401 with `rejected`: the program's fresh credentials, or the ones another request
        already fetched in the meantime (client-go's maybeRefreshCreds)."""
        with self._lock:
            if self._cached is not None and self._cached is not rejected:
                return self._cached
            self._cached = None
            self._cached = self._run()
            return self._cached

    # -- running the program ------------------------------------------------------------------------

    def _run(self) -> PluginCredential:
        config = self.config
        interactive = self._interactive()
        spec: dict[str, Any] = {"interactive": interactive}
        if config.cluster is not None:
            spec["cluster"] = json.loads(config.cluster)
        info = {"kind": "ExecCredential", "apiVersion": config.api_version, "spec": spec}
        # The host's environment (os.environ in production), the kubeconfig's entries over it, the
        # exec info last: the order client-go appends them in, where the last of a name wins.
        env = {**self.host.env, **dict(config.env), EXEC_INFO: json.dumps(info, separators=(",", ":"))}
        argv = [self._program(), *config.args]
        timeout = INTERACTIVE_TIMEOUT if interactive else TIMEOUT
        log.debug(
            "running %s (%d argument(s), %s)",
            config.named,
            len(config.args),
            "interactive" if interactive else "not interactive",
        )
        started = time.monotonic()
        result, failure = self._execute(argv, env, timeout, interactive)
        if failure is not None:
            raise failure  # out here: the runner's exception (the whole command line) stays unchained
        assert result is not None  # noqa: S101 (one or the other)
        if result.returncode != 0:
            self._show_stderr(result.stderr, [])
            told = " (its messages are above)" if result.stderr.strip() else ""
            raise CommandFailed(
                f"{config.named} failed with exit status {result.returncode}{told}",
                "run the plugin by hand to see why (often an expired login: sign in again with the "
                "provider's CLI), then run gpunode again",
            )
        credential = self._parse(result.stdout)
        self._show_stderr(result.stderr, credential.secrets())
        log.debug(
            "%s gave %s%s (%.2f s)",
            config.named,
            credential.kinds,
            f", valid until {credential.expires.isoformat()}" if credential.expires else "",
            time.monotonic() - started,
        )
        return credential

    def _interactive(self) -> bool:
        mode = self.config.interactive_mode
        if mode == "Never":
            return False
        terminal = stdin_is_terminal()
        if mode == "IfAvailable" or terminal:
            return terminal
        raise UsageError(
            f"{self.config.named} must run interactively (interactiveMode Always), but standard input is not "
            "a terminal",
            "run gpunode from a terminal, or set exec.interactiveMode: IfAvailable if the plugin can do "
            "without one",
        )

    def _program(self) -> str:
        """The local path of the program to run: the command's file, else the command found on PATH under
        the host's root (the standard directories too, as for every program gpunode runs)."""
        config = self.config
        found = config.path if config.path is not None else self.host.which(config.command)
        if found is None or not self.host.is_file(found):
            raise self._not_installed(found)
        return str(self.host.path(found))

    def _not_installed(self, path: str | None) -> NotFound:
        config = self.config
        where = f"no such file {path}" if path is not None else "not found on PATH"
        hint = config.install_hint or f"install it, or fix exec.command in the kubeconfig (see {PLUGINS_DOC})"
        return NotFound(f"{config.named} is not installed ({where})", hint)

    def _execute(
        self, argv: Sequence[str], env: Mapping[str, str], timeout: float, interactive: bool
    ) -> tuple[CommandResult | None, GpunodeError | None]:
        config = self.config
        try:
            if interactive and isinstance(self.host.runner, SubprocessRunner):
                # The Runner seam has no way to hand the program the terminal; the real runner's job is
                # done here with stdin and stderr inherited. Scripted runners run it as any command.
                return _run_on_terminal(argv, env, timeout), None
            return self.host.run(argv, timeout=timeout, env=env), None
        except CommandFailed as exc:
            said = exc.message
        except UnicodeDecodeError:  # the real runner decodes the output; a token is no reason to show it
            said = "undecodable"
        # The runner's message quotes the whole command line, and an argument may be a secret: reworded.
        if "did not finish within" in said:
            return None, CommandFailed(
                f"{config.named} did not finish within {timeout:g} s and was stopped",
                "run the plugin by hand to see where it waits; one that waits for a login needs "
                "exec.interactiveMode IfAvailable and gpunode run from a terminal",
            )
        if "not installed" in said:
            return None, self._not_installed(config.path)
        if "permission denied" in said:
            return None, CommandFailed(
                f"{config.named} cannot be executed (permission denied)", "make the program executable"
            )
        if said == "undecodable":
            return None, CommandFailed(f"{config.named} printed output that is not text")
        return None, CommandFailed(f"{config.named} could not be run")

    def _parse(self, stdout: str) -> PluginCredential:
        config = self.config

        def bad(what: str) -> CommandFailed:
            # Never quotes the output: it is a credential, or was meant to be one.
            return CommandFailed(
                f"{config.named} {what}",
                f"check that the plugin prints only an ExecCredential of apiVersion {config.api_version} "
                "on its standard output (run it by hand: the output is a secret, keep it to yourself)",
            )

        if len(stdout) > MAX_OUTPUT:
            raise bad(f"printed more than {MAX_OUTPUT // 2**20} MiB, which is no ExecCredential")
        document: Any
        try:
            document = json.loads(stdout)
        except (ValueError, RecursionError):
            document = None
        if not isinstance(document, dict):
            raise bad("printed something other than an ExecCredential (not a JSON object)")
        if document.get("kind") != "ExecCredential":
            raise bad("printed JSON that is not an ExecCredential (its kind is not ExecCredential)")
        version = document.get("apiVersion")
        if version != config.api_version:
            # Shown only when it is a known version: whatever else is there is not repeated.
            said = f"apiVersion {version}" if version in (V1, V1BETA1, V1ALPHA1) else "another apiVersion"
            raise bad(f"printed an ExecCredential of {said}, but the kubeconfig says {config.api_version}")
        status = document.get("status")
        if not isinstance(status, dict):
            raise bad("printed an ExecCredential without a status")
        fields: dict[str, str] = {}
        for key in ("token", "clientCertificateData", "clientKeyData", "expirationTimestamp"):
            value = status.get(key)
            if value is not None and not isinstance(value, str):
                raise bad(f"printed an ExecCredential whose status.{key} is not a string")
            fields[key] = value or ""
        token, cert, key = fields["token"], fields["clientCertificateData"], fields["clientKeyData"]
        if not token and not cert and not key:
            raise bad("printed an ExecCredential with neither a token nor a client certificate and key")
        if bool(cert) != bool(key):
            have, missing = ("certificate", "key") if cert else ("key", "certificate")
            raise bad(f"printed a client {have} without its {missing}")
        if cert and ("-----BEGIN " not in cert or "-----BEGIN " not in key):
            raise bad("printed a client certificate or key that is not PEM")
        token = token.strip()
        if token and not all(0x21 <= ord(c) <= 0x7E for c in token):
            # It would end the Authorization header and start another.
            raise bad(
                "printed a token holding a space, line break, control or non-ASCII character, which no "
                "bearer token has (it is not shown here)"
            )
        expires: datetime | None = None
        if fields["expirationTimestamp"]:
            expires = _rfc3339(fields["expirationTimestamp"])
            if expires is None:
                raise bad("printed an expirationTimestamp that is not an RFC 3339 time")
        return PluginCredential(
            origin=config.named,
            token=token or None,
            cert_pem=cert.encode() if cert else None,
            key_pem=key.encode() if key else None,
            expires=expires,
        )

    def _show_stderr(self, text: str, secrets: list[str]) -> None:
        """The program's messages, as kubectl passes them on, bounded, any secret it printed hidden."""
        shown = scrub(text, secrets)
        if not shown.strip():
            return
        if len(shown) > MAX_STDERR_SHOWN:
            left = len(shown) - MAX_STDERR_SHOWN
            shown = (
                f"{shown[:MAX_STDERR_SHOWN]}\n[{left} more characters from `{self.config.command}` not shown]"
            )
        sys.stderr.write(shown if shown.endswith("\n") else shown + "\n")
        sys.stderr.flush()


_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(?:(Z)|([+-])(\d{2}):(\d{2}))$"
)


def _rfc3339(text: str) -> datetime | None:
    """An RFC 3339 time as metav1.Time reads it (Go's time.RFC3339: a zone is required, fractions of any
    length). Parsed by hand: Python 3.10's fromisoformat takes neither "Z" nor nanoseconds."""
    found = _RFC3339.match(text.strip())
    if found is None:
        return None
    year, month, day, hour, minute, second, fraction, utc, sign, zone_h, zone_m = found.groups()
    micro = int((fraction or "0")[:6].ljust(6, "0"))
    offset = timedelta(0)
    if utc is None:
        offset = timedelta(hours=int(zone_h), minutes=int(zone_m)) * (-1 if sign == "-" else 1)
    try:
        return datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            int(second),
            micro,
            tzinfo=timezone(offset),
        )
    except ValueError:  # 2024-02-30, 25:00, an offset of a day or more
        return None


def _run_on_terminal(argv: Sequence[str], env: Mapping[str, str], timeout: float) -> CommandResult:
    """SubprocessRunner.run with the terminal handed over: stdin and stderr inherited (a prompt must reach
    the person at once), stdout (the credential) captured."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, env={**os.environ, **env})
    except FileNotFoundError:
        raise CommandFailed(f"`{argv[0]}` is not installed (not found on PATH)") from None
    except PermissionError:
        raise CommandFailed(f"`{argv[0]}` cannot be executed: permission denied") from None
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise CommandFailed(f"`{argv[0]}` did not finish within {timeout:g} s and was stopped") from None
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): not left running unseen
            proc.kill()
            proc.wait()
    stdout = out.decode("utf-8", "replace")
    return CommandResult(tuple(argv), proc.returncode, stdout, "", time.monotonic() - started)


# -- the process-wide cache -------------------------------------------------------------------------------

_authenticators: dict[tuple[str, ExecConfig], Authenticator] = {}
_authenticators_lock = threading.Lock()


def authenticator(host: Host, config: ExecConfig) -> Authenticator:
    """The Authenticator for this configuration, shared across clients (client-go's global cache, keyed
    by the configuration, so that a client made again does not run the program again)."""
    key = (str(host.root), config)
    with _authenticators_lock:
        found = _authenticators.get(key)
        if found is None:
            found = _authenticators[key] = Authenticator(host, config)
        return found


def forget_all() -> None:
    """Drop every cached credential (tests; a long-running caller that wants fresh ones)."""
    with _authenticators_lock:
        _authenticators.clear()
