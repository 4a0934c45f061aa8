"""Where gpunode finds its Kubernetes API credentials: the places kubectl looks, then the node's own.

The search, first found wins:

1. `--kubeconfig PATH` (must exist);
2. `$KUBECONFIG`, a colon-separated list merged by kubectl's rule: the first file to define a cluster, user
   or context of a given name wins, and so does the first file that sets current-context; files that do
   not exist are skipped;
3. `~/.kube/config`;
4. kubelet's own kubeconfig, `/etc/kubernetes/kubelet.conf` (kubeadm);
5. k3s / RKE2: their admin kubeconfigs on servers, then their kubelets' kubeconfigs on agents;
6. the in-cluster service account (token and CA under /var/run/secrets/kubernetes.io/serviceaccount,
   `KUBERNETES_SERVICE_HOST` / `KUBERNETES_SERVICE_PORT`).

A kubeconfig user with neither a token nor a client certificate may name an exec credential plugin
(gpunode.kube.execplugin): it is checked here and run when the first request needs credentials, as
client-go runs it.

A kubeconfig that exists but defines no context at all (what `kubectl config view` leaves in an empty
~/.kube/config) is passed over, as client-go passes over an empty config; any other problem in a
kubeconfig stops the search with an error naming the file, since that file is the one the user meant.

`server` (--server) replaces the server of whatever is found. A plain http:// server (the `kubectl proxy`
case) gets no credentials at all: a token or client certificate never travels unencrypted.

Every file is read through the Host, so tests resolve credentials under a temp root.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from gpunode.errors import ConfigError, GpunodeError, NotFound, UsageError
from gpunode.host import Host
from gpunode.kube.execplugin import CLUSTER_EXTENSION, ExecConfig, parse_exec

log = logging.getLogger("gpunode.kube")

KUBELET_KUBECONFIG = "/etc/kubernetes/kubelet.conf"
# Admin kubeconfigs on k3s / RKE2 servers, then the kubelet's own on agents (which have no admin one).
RANCHER_KUBECONFIGS = (
    "/etc/rancher/k3s/k3s.yaml",
    "/etc/rancher/rke2/rke2.yaml",
    "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",
    "/var/lib/rancher/rke2/agent/kubelet.kubeconfig",
)
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_TOKEN_BYTES = 64 * 1024  # service account JWTs are 1-2 KiB

FIX = (
    "pass --kubeconfig PATH (a kubeconfig with a token, client certificate or exec plugin), or --server URL "
    "(e.g. http://127.0.0.1:8001 with `kubectl proxy` running)"
)


@dataclass(frozen=True, repr=False)
class Pem:
    """PEM data (a CA, a client certificate or key) from a file or from a kubeconfig's `*-data` field.

    `path` is a local path (already under the Host's root); `data` is the decoded inline PEM. `origin`
    names it for messages. The repr shows only the origin: key material is never printed.
    """

    origin: str
    path: Path | None = None
    data: bytes | None = None

    def __repr__(self) -> str:
        return f"Pem({self.origin})"


@dataclass(frozen=True, repr=False)
class Credentials:
    """How to reach one API server, and who to be there.

    verify: the CA to verify the server with, True for the system's CAs, False only when the kubeconfig
    itself says insecure-skip-tls-verify. cert: the client certificate and key. token: a bearer token
    (never in the repr, logs or messages). exec_plugin: the credential plugin that gives a token or
    certificate when a request needs one. source: where this came from, for messages.
    """

    server: str
    source: str
    verify: Pem | bool = True
    cert: tuple[Pem, Pem] | None = None
    token: str | None = None
    # The host path the token was read from: service account tokens rotate, so a rejected token is read
    # again before the request is given up (`reload_token`).
    token_file: str | None = None
    impersonate_user: str | None = None
    impersonate_groups: tuple[str, ...] = ()
    proxy: str | None = None
    reload_token: Callable[[], str | None] | None = field(default=None, compare=False)
    exec_plugin: ExecConfig | None = None

    def __repr__(self) -> str:
        parts = [f"server={self.server!r}", f"source={self.source!r}", f"verify={self.verify!r}"]
        if self.cert is not None:
            parts.append(f"cert={self.cert!r}")
        if self.token is not None:
            parts.append("token=<hidden>")
        if self.token_file is not None:
            parts.append(f"token_file={self.token_file!r}")
        if self.impersonate_user is not None:
            parts.append(f"impersonate_user={self.impersonate_user!r}")
        if self.proxy is not None:
            parts.append(f"proxy={redact_url(self.proxy)!r}")
        if self.exec_plugin is not None:
            parts.append(f"exec_plugin={self.exec_plugin!r}")
        return f"Credentials({', '.join(parts)})"

    @property
    def plain_http(self) -> bool:
        return self.server.startswith("http://")

    @property
    def auth(self) -> str:
        """The kind of credentials, for messages: "a bearer token", "a client certificate", …"""
        if self.exec_plugin is not None:
            return f"the credentials of the exec plugin `{self.exec_plugin.command}`"
        kinds = [
            k
            for k, present in (("a client certificate", self.cert), ("a bearer token", self.token))
            if present
        ]
        return " and ".join(kinds) or "no credentials"


def redact_url(url: str) -> str:
    """A URL for messages and reprs: its password (a proxy's, say) replaced by ***."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:  # `https://[::1`: not a URL at all; shown without what may be a password
        return "<not a URL>"
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()


def _visible(value: str) -> bool:
    """Printable ASCII without spaces: what a bearer token, an HTTP header value gpunode sends, or a URL
    may hold. A line break there would end the header (or the line of a file) and start another."""
    return all(0x21 <= ord(c) <= 0x7E for c in value)


def check_token(token: str, where: str) -> str:
    """A bearer token as it may be sent: whitespace around it dropped (a token file ends with a newline),
    nothing but visible ASCII inside. The error never shows the token, not even a part of it."""
    value = token.strip()
    if not value:
        raise ConfigError(f"the token from {where} is empty", "give the token the cluster issued")
    if not _visible(value):
        raise ConfigError(
            f"the token from {where} holds a space, line break, control or non-ASCII character, which no "
            "bearer token has (it is not shown here)",
            "check that the file or field holds exactly the token the cluster issued, on one line",
        )
    return value


def resolve_credentials(
    host: Host,
    *,
    kubeconfig: str | None = None,
    context: str | None = None,
    server: str | None = None,
) -> Credentials:
    """Find the credentials (see the module docstring for the order). Raises NotFound when there are none,
    ConfigError for a malformed kubeconfig, UsageError for a --context or --server that cannot be used."""
    override = _normalise_server(server, "--server") if server else None
    if override is not None and override.startswith("http://"):
        if context is not None:
            raise UsageError(
                "--context cannot be used with a plain http:// --server, which takes no credentials"
            )
        return Credentials(server=override, source=f"--server {override} (no credentials)")

    looked: list[str] = []
    found = _find(host, kubeconfig, context, looked)
    if found is None:
        if context is not None:
            raise UsageError(f"--context {context}: no kubeconfig was found ({'; '.join(looked)})", FIX)
        if override is not None:
            return Credentials(server=override, source=f"--server {override} (no credentials)")
        raise NotFound(f"no Kubernetes API credentials were found; looked at: {'; '.join(looked)}", FIX)
    if override is not None:
        found = _replace_server(found, override)
    log.debug("Kubernetes API credentials: %s", found.source)
    return found


def _replace_server(creds: Credentials, server: str) -> Credentials:
    from dataclasses import replace

    plugin = creds.exec_plugin.with_server(server) if creds.exec_plugin is not None else None
    return replace(
        creds,
        server=server,
        source=f"{creds.source}, server replaced by --server {server}",
        exec_plugin=plugin,
    )


def _find(host: Host, kubeconfig: str | None, context: str | None, looked: list[str]) -> Credentials | None:
    if kubeconfig is not None:
        path = _absolute(kubeconfig)
        if not host.is_file(path):
            raise NotFound(f"--kubeconfig {path} does not exist", "pass the path of an existing kubeconfig")
        config = _load(host, [path], "--kubeconfig")
        if not config.contexts:
            raise ConfigError(f"kubeconfig {path} defines no context", "pass a kubeconfig that defines one")
        return _from_kubeconfig(host, config, context)

    env = host.env.get("KUBECONFIG", "")
    if env:
        paths = [_absolute(p) for p in env.split(":") if p]
        existing = [p for p in paths if host.is_file(p)]
        if not existing:
            looked.append(f"$KUBECONFIG={env} (no such file)")
        else:
            config = _load(host, existing, "$KUBECONFIG")
            if config.contexts:
                return _from_kubeconfig(host, config, context)
            looked.append(f"$KUBECONFIG={env} (defines no context)")

    home = host.env.get("HOME") or ("/root" if host.euid == 0 else "")
    candidates = [f"{home.rstrip('/')}/.kube/config"] if home.startswith("/") else []
    for path in (*candidates, KUBELET_KUBECONFIG, *RANCHER_KUBECONFIGS):
        if not host.is_file(path):
            looked.append(f"{path} (does not exist)")
            continue
        config = _load(host, [path], None)
        if config.contexts:
            return _from_kubeconfig(host, config, context)
        looked.append(f"{path} (defines no context)")

    if context is not None:
        return None  # a context names a kubeconfig's context; the service account has none
    return _in_cluster(host, looked)


def _absolute(path: str) -> str:
    # Relative paths on the command line and in $KUBECONFIG are relative to the working directory, as
    # for kubectl.
    return path if path.startswith("/") else str(PurePosixPath(os.getcwd()) / path)


def _normalise_server(url: str, where: str) -> str:
    """An API server URL, checked: http(s)://HOST[:PORT][/PREFIX]. "HOST:PORT" alone means https, as for
    kubectl. The trailing / goes: paths are appended to it."""
    error = UsageError if where.startswith("--") else ConfigError
    candidate = url.strip()
    if not _visible(candidate):
        # urlsplit would silently drop a tab or line break; a URL holding one was not typed on purpose.
        raise error(
            f"{where}: {candidate!r} is not an API server URL (it holds a space or control character)"
        )
    if "://" not in candidate:
        candidate = f"https://{candidate}"
    try:
        parts = urlsplit(candidate)
    except ValueError as exc:  # an unclosed IPv6 bracket (`https://[::1`)
        raise error(
            f"{where}: server {redact_url(url)!r} is not an API server URL ({exc})",
            "give the server as https://HOST:PORT (an IPv6 address in brackets: https://[::1]:6443)",
        ) from exc
    if "@" in parts.netloc:
        # requests would send it as basic authentication, which Kubernetes no longer accepts; and a
        # password has no place in a URL that messages show.
        raise error(
            f"{where}: {redact_url(candidate)!r} is not an API server URL (it carries a user name or "
            "password)",
            "give the server as https://HOST:PORT and the credentials in the kubeconfig's user",
        )
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise error(
            f"{where}: {url!r} is not an API server URL (expected https://HOST:PORT or http://HOST:PORT)"
        )
    if parts.query or parts.fragment:
        raise error(f"{where}: {url!r} is not an API server URL (it has a query or fragment)")
    return candidate.rstrip("/")


# -- kubeconfig files -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Named:
    """A cluster, user or context of a kubeconfig, with the file that defined it."""

    kind: str  # "cluster", "user", "context"
    name: str
    body: Mapping[str, Any]
    file: str

    def where(self) -> str:
        return f'{self.kind} "{self.name}" in {self.file}'


@dataclass
class _Kubeconfig:
    files: list[str]
    how: str | None  # "--kubeconfig", "$KUBECONFIG" or None (found by the search)
    clusters: dict[str, _Named] = field(default_factory=dict)
    users: dict[str, _Named] = field(default_factory=dict)
    contexts: dict[str, _Named] = field(default_factory=dict)
    current_context: str | None = None
    current_context_file: str | None = None

    def describe(self) -> str:
        files = ", ".join(self.files)
        return f"kubeconfig {files}" + (f" (from {self.how})" if self.how == "$KUBECONFIG" else "")


_SECTIONS = (("clusters", "cluster"), ("users", "user"), ("contexts", "context"))


def _load(host: Host, paths: list[str], how: str | None) -> _Kubeconfig:
    """Read and merge kubeconfig files: the first definition of a name wins, as with kubectl."""
    config = _Kubeconfig(files=paths, how=how)
    for path in paths:
        document = _parse_yaml(host, path)
        for section, kind in _SECTIONS:
            table: dict[str, _Named] = getattr(config, section)
            for entry in _entries(document, section, kind, path):
                table.setdefault(entry.name, entry)
        current = document.get("current-context")
        if current is not None and not isinstance(current, str):
            raise ConfigError(f"kubeconfig {path}: current-context is not a string")
        if current and config.current_context is None:
            config.current_context, config.current_context_file = current, path
    return config


def _parse_yaml(host: Host, path: str) -> Mapping[str, Any]:
    from gpunode.safeyaml import load_yaml

    # The safe loader's errors name the problem and its line, never quote the line (it may hold a token).
    # Kubeconfigs embed certificates and may merge many clusters: a larger size is let through than for
    # other YAML; depth and expansion are bounded as for every file.
    document = load_yaml(host.read_text(path), f"kubeconfig {path}", max_bytes=4 * 2**20)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"kubeconfig {path} is not a kubeconfig (a YAML mapping with clusters, users, contexts)"
        )
    return document


def _entries(document: Mapping[str, Any], section: str, kind: str, path: str) -> list[_Named]:
    items = document.get(section)
    if items is None:
        return []
    if not isinstance(items, list):
        raise ConfigError(f"kubeconfig {path}: {section} is not a list")
    entries = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError(f"kubeconfig {path}: {section}[{index}] is not a mapping")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"kubeconfig {path}: {section}[{index}] has no name")
        body = item.get(kind)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(f'kubeconfig {path}: {kind} "{name}" is not a mapping')
        entries.append(_Named(kind, name, body, path))
    return entries


def _names(table: Mapping[str, _Named]) -> str:
    return ", ".join(sorted(table)) or "none"


def _from_kubeconfig(host: Host, config: _Kubeconfig, context: str | None) -> Credentials:
    described = config.describe()
    if context is not None:
        ctx = config.contexts.get(context)
        if ctx is None:
            raise UsageError(
                f'--context {context}: {described} has no context "{context}"; '
                f"contexts there: {_names(config.contexts)}",
                "pass one of those to --context",
            )
    else:
        if config.current_context is None:
            raise ConfigError(
                f"{described} sets no current-context; contexts there: {_names(config.contexts)}",
                "pass --context NAME, or choose one with `kubectl config use-context NAME`",
            )
        ctx = config.contexts.get(config.current_context)
        if ctx is None:
            raise ConfigError(
                f'the current-context "{config.current_context}" of {config.current_context_file} is not '
                f"defined; contexts there: {_names(config.contexts)}",
                "pass --context NAME, or choose one with `kubectl config use-context NAME`",
            )

    cluster_name = _string(ctx, "cluster")
    if not cluster_name:
        raise ConfigError(f"{ctx.where()} names no cluster")
    cluster = config.clusters.get(cluster_name)
    if cluster is None:
        raise ConfigError(
            f'{ctx.where()} names cluster "{cluster_name}", which is not defined; '
            f"clusters there: {_names(config.clusters)}"
        )
    user_name = _string(ctx, "user")
    user: _Named | None = None
    if user_name:
        user = config.users.get(user_name)
        if user is None:
            raise ConfigError(
                f'{ctx.where()} names user "{user_name}", which is not defined; '
                f"users there: {_names(config.users)}"
            )

    source = f"kubeconfig {ctx.file}" + (" (from $KUBECONFIG)" if config.how == "$KUBECONFIG" else "")
    source += f', context "{ctx.name}"'
    server, verify, proxy = _cluster(host, cluster)
    if server.startswith("http://"):
        # Nothing secret is sent in the clear; an http:// server is a proxy doing its own authentication.
        log.debug("%s: plain http server, so no credentials are sent", source)
        return Credentials(server=server, source=source, proxy=proxy)
    if user is None:
        return Credentials(server=server, source=source, verify=verify, proxy=proxy)
    return _user(host, user, cluster, server=server, source=source, verify=verify, proxy=proxy)


def _string(entry: _Named, key: str) -> str | None:
    value = entry.body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{entry.where()}: {key} is not a string")
    return value


def _relative_to(entry: _Named, path: str) -> str:
    # Like kubectl: a relative path in a kubeconfig is relative to the directory of the file that holds it.
    return path if path.startswith("/") else str(PurePosixPath(entry.file).parent / path)


def _cluster(host: Host, cluster: _Named) -> tuple[str, Pem | bool, str | None]:
    raw_server = _string(cluster, "server")
    if not raw_server:
        raise ConfigError(f"{cluster.where()} has no server")
    server = _normalise_server(raw_server, cluster.where())

    insecure = cluster.body.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise ConfigError(f"{cluster.where()}: insecure-skip-tls-verify is not true or false")
    ca = _pem(host, cluster, "certificate-authority")
    if insecure and ca is not None:
        # client-go refuses this combination too: which of the two was meant is not ours to guess.
        raise ConfigError(
            f"{cluster.where()} sets both insecure-skip-tls-verify and a certificate authority",
            "remove one of them",
        )
    if insecure:
        log.warning(
            "%s sets insecure-skip-tls-verify: the API server's certificate is not checked", cluster.where()
        )

    if _string(cluster, "tls-server-name"):
        # The certificate is then checked against the server URL's host name instead, which fails loudly if
        # it differs: never a weaker check.
        log.debug("%s: tls-server-name is not supported and is ignored", cluster.where())

    proxy = _string(cluster, "proxy-url")
    try:
        scheme = urlsplit(proxy).scheme if proxy else None
    except ValueError as exc:  # an unclosed IPv6 bracket (`socks5://[::1`)
        raise ConfigError(
            f"{cluster.where()}: proxy-url is not a URL ({exc})",
            "give proxy-url as http://HOST:PORT or https://HOST:PORT (an IPv6 address in brackets)",
        ) from exc
    if proxy and scheme not in ("http", "https"):
        raise ConfigError(
            f"{cluster.where()}: proxy-url {proxy} is not supported (only http:// and https:// proxies)"
        )
    return server, ca if ca is not None else not insecure, proxy or None


def _user(
    host: Host,
    user: _Named,
    cluster: _Named,
    *,
    server: str,
    source: str,
    verify: Pem | bool,
    proxy: str | None,
) -> Credentials:
    inline = _string(user, "token")
    token = check_token(inline, f"{user.where()} (token)") if inline else None
    token_file: str | None = None
    reload_token: Callable[[], str | None] | None = None
    if token is None:
        path = _string(user, "tokenFile")
        if path:
            token_file = _relative_to(user, path)
            token = _read_token(host, token_file, user.where())
            reload_token = _token_reader(host, token_file, user.where())

    cert = _pem(host, user, "client-certificate")
    key = _pem(host, user, "client-key")
    if (cert is None) != (key is None):
        have, missing = ("certificate", "key") if cert is not None else ("key", "certificate")
        raise ConfigError(f"{user.where()} has a client {have} but no client {missing}")

    exec_plugin: ExecConfig | None = None
    if token is None and cert is None:
        # As in client-go: a token or certificate of the kubeconfig's own wins, and the plugin is not run.
        if user.body.get("exec"):
            if user.body.get("auth-provider"):
                raise ConfigError(f"{user.where()} sets both exec and auth-provider", "keep only exec")
            body = user.body["exec"]
            wants_cluster = isinstance(body, dict) and body.get("provideClusterInfo") is True
            exec_plugin = parse_exec(
                body,
                where=user.where(),
                kubeconfig=user.file,
                cluster=_exec_cluster(host, cluster, server, verify, proxy) if wants_cluster else None,
            )
        else:
            _refuse_unsupported_auth(user)

    impersonate = _string(user, "as") or None
    groups = user.body.get("as-groups") or []
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise ConfigError(f"{user.where()}: as-groups is not a list of names")
    # Sent as header values: a line break would end the header and start another.
    for name in (impersonate or "", *groups):
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
            raise ConfigError(
                f"{user.where()}: an impersonated name (as, as-groups) holds a control character"
            )
    # requests sends a header once, and Kubernetes reads each Impersonate-Group header as one group.
    if len(groups) > 1:
        raise ConfigError(f"{user.where()}: impersonating more than one group (as-groups) is not supported")
    for unsupported in ("as-uid", "as-user-extra"):
        if user.body.get(unsupported):
            raise ConfigError(f"{user.where()}: {unsupported} (impersonation) is not supported")

    return Credentials(
        server=server,
        source=source,
        verify=verify,
        cert=(cert, key) if cert is not None and key is not None else None,
        token=token,
        token_file=token_file,
        impersonate_user=impersonate,
        impersonate_groups=tuple(groups),
        proxy=proxy,
        reload_token=reload_token,
        exec_plugin=exec_plugin,
    )


def _exec_cluster(
    host: Host, cluster: _Named, server: str, verify: Pem | bool, proxy: str | None
) -> dict[str, Any]:
    """KUBERNETES_EXEC_INFO's spec.cluster (client-go's ConfigToExecCluster): the server, the CA's PEM
    (base64, as Go encodes bytes), tls-server-name, insecure-skip-tls-verify, proxy-url, and the cluster's
    client.authentication.k8s.io/exec extension as config. Sent only with provideClusterInfo."""
    info: dict[str, Any] = {"server": server}
    name = _string(cluster, "tls-server-name")
    if name:
        info["tls-server-name"] = name
    if verify is False:
        info["insecure-skip-tls-verify"] = True
    if isinstance(verify, Pem):
        # A file CA's origin is its host path (read and checked a moment ago by _pem).
        data = verify.data if verify.data is not None else host.read_bytes(verify.origin)
        if data:
            info["certificate-authority-data"] = base64.b64encode(data).decode("ascii")
    if proxy:
        info["proxy-url"] = proxy
    if cluster.body.get("disable-compression") is True:
        info["disable-compression"] = True
    extensions = cluster.body.get("extensions")
    for extension in extensions if isinstance(extensions, list) else []:
        if isinstance(extension, dict) and extension.get("name") == CLUSTER_EXTENSION:
            info["config"] = extension.get("extension")
    return info


def _refuse_unsupported_auth(user: _Named) -> None:
    """A user whose only credentials are ones gpunode cannot use: say so, rather than send no credentials
    and get a puzzling 401 or 403."""
    fix = (
        "use a kubeconfig with a token, client certificate or exec plugin (e.g. "
        "/etc/kubernetes/kubelet.conf), or run `kubectl proxy` and pass --server http://127.0.0.1:8001"
    )
    provider = user.body.get("auth-provider")
    if provider:
        name = provider.get("name") if isinstance(provider, dict) else None
        which = f" ({name})" if isinstance(name, str) else ""
        raise ConfigError(
            f"{user.where()} authenticates with an auth-provider{which}, which gpunode does not support", fix
        )
    if user.body.get("username") or user.body.get("password"):
        raise ConfigError(
            f"{user.where()} authenticates with a username and password, which Kubernetes no longer accepts "
            "(basic authentication was removed in 1.19)",
            fix,
        )


def _read_token(host: Host, path: str, where: str) -> str:
    # Read as bytes and decoded here, with no exception chained to the errors: a UnicodeDecodeError carries
    # the file's whole content, the token, and --debug prints the chain.
    data = host.read_bytes(path)
    if data is None:
        raise NotFound(f"the token file {path} named by {where} does not exist")
    if len(data) > MAX_TOKEN_BYTES:
        raise ConfigError(f"the token file {path} named by {where} is larger than 64 KiB; it is not a token")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        text = None
    if text is None:
        raise ConfigError(
            f"the token from the file {path} named by {where} holds a non-ASCII byte, which no bearer token "
            "has (it is not shown here)",
            "check that the file holds exactly the token the cluster issued",
        )
    if not text.strip():
        raise ConfigError(f"the token file {path} named by {where} is empty")
    return check_token(text, f"the file {path} named by {where}")


def _token_reader(host: Host, path: str, where: str) -> Callable[[], str | None]:
    def read() -> str | None:
        try:
            return _read_token(host, path, where)
        except GpunodeError:
            return None

    return read


def _pem(host: Host, entry: _Named, key: str) -> Pem | None:
    """`key` as a file (`key`) or inline base64 (`key`-data; it wins when both are set, as in client-go)."""
    data_key = f"{key}-data"
    inline = _string(entry, data_key)
    if inline:
        try:
            data = base64.b64decode("".join(inline.split()), validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{entry.where()}: {data_key} is not valid base64") from None
        if b"-----BEGIN " not in data:
            raise ConfigError(f"{entry.where()}: {data_key} does not hold PEM data")
        return Pem(origin=f"{data_key} of {entry.where()}", data=data)
    path = _string(entry, key)
    if not path:
        return None
    path = _relative_to(entry, path)
    try:
        text = host.read_text(path)
    except NotFound:
        raise NotFound(f"the {key} file {path} named by {entry.where()} does not exist") from None
    except ConfigError as exc:
        raise ConfigError(f"the {key} file named by {entry.where()}: {exc.message}") from None
    if "-----BEGIN " not in text:
        raise ConfigError(f"the {key} file {path} named by {entry.where()} is not a PEM file")
    return Pem(origin=path, path=host.path(path))


# -- in-cluster ---------------------------------------------------------------------------------------


def _in_cluster(host: Host, looked: list[str]) -> Credentials | None:
    service_host = host.env.get("KUBERNETES_SERVICE_HOST", "")
    service_port = host.env.get("KUBERNETES_SERVICE_PORT", "")
    token_path = f"{SERVICE_ACCOUNT_DIR}/token"
    if not service_host or not service_port:
        looked.append(
            "the in-cluster service account (KUBERNETES_SERVICE_HOST/PORT are not set: not in a pod)"
        )
        return None
    if not host.is_file(token_path):
        looked.append(f"the in-cluster service account ({token_path} does not exist)")
        return None
    where = "the in-cluster service account"
    token = _read_token(host, token_path, where)
    ca_path = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
    # client-go falls back to the system's CAs when the service account has no CA file; so do we.
    verify: Pem | bool = Pem(origin=ca_path, path=host.path(ca_path)) if host.is_file(ca_path) else True
    bracketed = f"[{service_host}]" if ":" in service_host else service_host
    server = _normalise_server(f"https://{bracketed}:{service_port}", "KUBERNETES_SERVICE_HOST/PORT")
    return Credentials(
        server=server,
        source=f"in-cluster service account ({SERVICE_ACCOUNT_DIR})",
        verify=verify,
        token=token,
        token_file=token_path,
        reload_token=_token_reader(host, token_path, where),
    )
