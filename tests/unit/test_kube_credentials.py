"""Finding Kubernetes API credentials the way kubectl does: kubeconfig variants, the search order, the
in-cluster service account, --server, and the errors for what cannot be used."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.errors import ConfigError, NotFound, UsageError
from gpunode.host import Host
from gpunode.kube import Credentials, Pem, escape_json_pointer, json_pointer, resolve_credentials

TOKEN = "tok-3f9a1c7e-never-shown"  # noqa: S105 (a test token)
CA = "-----BEGIN CERTIFICATE-----\nMIIBca\n-----END CERTIFICATE-----\n"
CERT = "-----BEGIN CERTIFICATE-----\nMIIBcert\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIGHkey\n-----END PRIVATE KEY-----\n"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kubeconfig(
    clusters: Mapping[str, Mapping[str, Any]],
    users: Mapping[str, Mapping[str, Any]],
    contexts: Mapping[str, tuple[str, str | None]],
    current: str | None = None,
) -> str:
    document: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": n, "cluster": dict(c)} for n, c in clusters.items()],
        "users": [{"name": n, "user": dict(u)} for n, u in users.items()],
        "contexts": [
            {"name": n, "context": {"cluster": c, **({"user": u} if u else {})}}
            for n, (c, u) in contexts.items()
        ],
    }
    if current is not None:
        document["current-context"] = current
    return yaml.safe_dump(document)


def simple(server: str = "https://10.0.0.1:6443", user: Mapping[str, Any] | None = None) -> str:
    return kubeconfig(
        {"prod": {"server": server, "certificate-authority-data": b64(CA)}},
        {"admin": user if user is not None else {"token": TOKEN}},
        {"prod": ("prod", "admin")},
        "prod",
    )


class Root:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.env: dict[str, str] = {"HOME": "/root"}

    def file(self, host_path: str, text: str) -> str:
        local = self.path / host_path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text)
        return host_path

    def host(self) -> Host:
        return Host(root=self.path, env=self.env, euid=0)

    def resolve(self, **kwargs: Any) -> Credentials:
        return resolve_credentials(self.host(), **kwargs)


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return Root(tmp_path)


# -- kubeconfig variants --------------------------------------------------------------------------------


def test_token_and_inline_ca(root: Root) -> None:
    root.file("/root/.kube/config", simple())
    creds = root.resolve()
    assert creds.server == "https://10.0.0.1:6443"
    assert creds.token == TOKEN
    assert isinstance(creds.verify, Pem)
    assert creds.verify.data == CA.encode()
    assert creds.cert is None
    assert creds.source == 'kubeconfig /root/.kube/config, context "prod"'
    assert creds.auth == "a bearer token"


def test_the_repr_hides_the_token_and_key_material(root: Root) -> None:
    root.file(
        "/root/.kube/config", simple(user={"client-certificate-data": b64(CERT), "client-key-data": b64(KEY)})
    )
    creds = root.resolve()
    assert creds.cert is not None
    shown = repr(creds) + str(creds)
    assert "MIGHkey" not in shown and b64(KEY) not in shown
    assert "client-key-data" in shown  # where the key came from is fine to show

    root.file("/root/.kube/config", simple())
    creds = root.resolve()
    assert TOKEN not in repr(creds) and TOKEN not in str(creds)
    assert "token=<hidden>" in repr(creds)


def test_token_file_relative_to_the_kubeconfig(root: Root) -> None:
    root.file("/etc/gpunode/kube/config", simple(user={"tokenFile": "secrets/token"}))
    root.file("/etc/gpunode/kube/secrets/token", f"{TOKEN}\n")
    creds = root.resolve(kubeconfig="/etc/gpunode/kube/config")
    assert creds.token == TOKEN
    assert creds.token_file == "/etc/gpunode/kube/secrets/token"  # noqa: S105
    # A rotated token is read again.
    root.file("/etc/gpunode/kube/secrets/token", "rotated")
    assert creds.reload_token is not None
    assert creds.reload_token() == "rotated"


def test_token_wins_over_token_file(root: Root) -> None:
    root.file("/root/.kube/config", simple(user={"token": TOKEN, "tokenFile": "/nonexistent"}))
    assert root.resolve().token == TOKEN


def test_missing_token_file_is_named(root: Root) -> None:
    root.file("/root/.kube/config", simple(user={"tokenFile": "/var/run/token"}))
    with pytest.raises(
        NotFound, match=r'token file /var/run/token named by user "admin" in /root/.kube/config'
    ):
        root.resolve()


def test_client_certificate_inline(root: Root) -> None:
    root.file(
        "/root/.kube/config", simple(user={"client-certificate-data": b64(CERT), "client-key-data": b64(KEY)})
    )
    creds = root.resolve()
    assert creds.cert is not None
    cert, key = creds.cert
    assert (cert.data, key.data) == (CERT.encode(), KEY.encode())
    assert cert.path is None and key.path is None
    assert creds.token is None
    assert creds.auth == "a client certificate"


def test_client_certificate_files_absolute_and_relative(root: Root) -> None:
    # kubelet.conf's layout: absolute paths to the rotated client certificate.
    root.file("/var/lib/kubelet/pki/kubelet-client-current.pem", CERT + KEY)
    root.file("/etc/kubernetes/pki/ca.crt", CA)
    root.file(
        "/etc/kubernetes/kubelet.conf",
        kubeconfig(
            {"default-cluster": {"server": "https://cp:6443", "certificate-authority": "pki/ca.crt"}},
            {
                "default-auth": {
                    "client-certificate": "/var/lib/kubelet/pki/kubelet-client-current.pem",
                    "client-key": "/var/lib/kubelet/pki/kubelet-client-current.pem",
                }
            },
            {"default-context": ("default-cluster", "default-auth")},
            "default-context",
        ),
    )
    creds = root.resolve()
    assert creds.source == 'kubeconfig /etc/kubernetes/kubelet.conf, context "default-context"'
    assert isinstance(creds.verify, Pem)
    assert creds.verify.path == root.path / "etc/kubernetes/pki/ca.crt"  # relative to the kubeconfig's dir
    assert creds.verify.origin == "/etc/kubernetes/pki/ca.crt"
    assert creds.cert is not None
    assert creds.cert[0].path == root.path / "var/lib/kubelet/pki/kubelet-client-current.pem"
    assert creds.cert[1].path == root.path / "var/lib/kubelet/pki/kubelet-client-current.pem"


def test_ca_file_that_is_missing_or_not_pem(root: Root) -> None:
    config = kubeconfig(
        {"c": {"server": "https://cp:6443", "certificate-authority": "ca.crt"}}, {}, {"x": ("c", None)}, "x"
    )
    root.file("/root/.kube/config", config)
    with pytest.raises(NotFound, match=r'certificate-authority file /root/.kube/ca.crt named by cluster "c"'):
        root.resolve()
    root.file("/root/.kube/ca.crt", "not a certificate")
    with pytest.raises(ConfigError, match=r"/root/.kube/ca.crt .* is not a PEM file"):
        root.resolve()


def test_inline_data_that_is_not_base64_or_not_pem(root: Root) -> None:
    root.file(
        "/root/.kube/config", simple(user={"client-certificate-data": "%%%", "client-key-data": b64(KEY)})
    )
    with pytest.raises(
        ConfigError, match=r'user "admin" in /root/.kube/config: client-certificate-data is not'
    ):
        root.resolve()
    root.file(
        "/root/.kube/config",
        simple(user={"client-certificate-data": b64("hello"), "client-key-data": b64(KEY)}),
    )
    with pytest.raises(ConfigError, match="does not hold PEM data"):
        root.resolve()


def test_certificate_without_key(root: Root) -> None:
    root.file("/root/.kube/config", simple(user={"client-certificate-data": b64(CERT)}))
    with pytest.raises(ConfigError, match="has a client certificate but no client key"):
        root.resolve()


def test_several_contexts_current_and_chosen(root: Root) -> None:
    root.file(
        "/root/.kube/config",
        kubeconfig(
            {"a": {"server": "https://a:6443"}, "b": {"server": "https://b:6443/prefix/"}},
            {"ua": {"token": "token-a"}, "ub": {"token": "token-b"}},
            {"ctx-a": ("a", "ua"), "ctx-b": ("b", "ub")},
            "ctx-a",
        ),
    )
    assert root.resolve().server == "https://a:6443"
    chosen = root.resolve(context="ctx-b")
    assert (chosen.server, chosen.token) == ("https://b:6443/prefix", "token-b")
    assert chosen.source.endswith('context "ctx-b"')
    with pytest.raises(UsageError, match=r'no context "ctx-c"; contexts there: ctx-a, ctx-b'):
        root.resolve(context="ctx-c")


def test_current_context_missing_or_unset(root: Root) -> None:
    clusters = {"a": {"server": "https://a:6443"}}
    root.file("/root/.kube/config", kubeconfig(clusters, {}, {"ctx-a": ("a", None)}, "gone"))
    with pytest.raises(ConfigError, match=r'current-context "gone" .* not defined; contexts there: ctx-a'):
        root.resolve()
    root.file("/root/.kube/config", kubeconfig(clusters, {}, {"ctx-a": ("a", None)}))
    with pytest.raises(ConfigError, match="sets no current-context; contexts there: ctx-a") as raised:
        root.resolve()
    assert raised.value.fix is not None and "--context" in raised.value.fix


def test_context_naming_a_missing_cluster_or_user(root: Root) -> None:
    root.file("/root/.kube/config", kubeconfig({"a": {"server": "https://a"}}, {}, {"x": ("b", None)}, "x"))
    with pytest.raises(
        ConfigError, match=r'context "x" in /root/.kube/config names cluster "b", .* clusters there: a'
    ):
        root.resolve()
    root.file(
        "/root/.kube/config",
        kubeconfig({"a": {"server": "https://a"}}, {"u1": {"token": "t"}}, {"x": ("a", "u2")}, "x"),
    )
    with pytest.raises(ConfigError, match=r'names user "u2", which is not defined; users there: u1'):
        root.resolve()


def test_no_user_means_no_credentials(root: Root) -> None:
    root.file("/root/.kube/config", kubeconfig({"a": {"server": "https://a"}}, {}, {"x": ("a", None)}, "x"))
    creds = root.resolve()
    assert (creds.token, creds.cert, creds.verify) == (None, None, True)


def test_insecure_skip_tls_verify_only_when_the_kubeconfig_says_so(root: Root) -> None:
    insecure = {"server": "https://a:6443", "insecure-skip-tls-verify": True}
    root.file("/root/.kube/config", kubeconfig({"a": insecure}, {}, {"x": ("a", None)}, "x"))
    assert root.resolve().verify is False
    root.file(
        "/root/.kube/config", kubeconfig({"a": {"server": "https://a:6443"}}, {}, {"x": ("a", None)}, "x")
    )
    assert root.resolve().verify is True  # no CA: the system's CAs, still verified
    both = {**insecure, "certificate-authority-data": b64(CA)}
    root.file("/root/.kube/config", kubeconfig({"a": both}, {}, {"x": ("a", None)}, "x"))
    with pytest.raises(ConfigError, match="sets both insecure-skip-tls-verify and a certificate authority"):
        root.resolve()


def test_server_urls(root: Root) -> None:
    root.file("/root/.kube/config", simple(server="cp.example:6443"))
    assert root.resolve().server == "https://cp.example:6443"  # no scheme means https, as for kubectl
    root.file("/root/.kube/config", simple(server="ftp://cp:6443"))
    with pytest.raises(
        ConfigError, match=r'cluster "prod" in /root/.kube/config: .* is not an API server URL'
    ):
        root.resolve()
    root.file("/root/.kube/config", kubeconfig({"a": {}}, {}, {"x": ("a", None)}, "x"))
    with pytest.raises(ConfigError, match=r'cluster "a" in /root/\.kube/config has no server'):
        root.resolve()


@pytest.mark.parametrize("url", ["https://[::1", "https://[::1:6443/", "[::1"])
def test_a_server_url_python_cannot_split_is_a_config_error(root: Root, url: str) -> None:
    # urlsplit raises ValueError on an unclosed IPv6 bracket: that was exit 70.
    root.file("/root/.kube/config", simple(server=url))
    with pytest.raises(
        ConfigError, match=r'cluster "prod" in /root/\.kube/config: server .* is not an API server'
    ):
        root.resolve()
    with pytest.raises(UsageError, match=r"--server: server .* is not an API server URL"):
        root.resolve(server=url)


@pytest.mark.parametrize("proxy", ["https://[::1", "socks5://[::1"])
def test_a_proxy_url_python_cannot_split_is_a_config_error(root: Root, proxy: str) -> None:
    text = kubeconfig(
        {
            "prod": {
                "server": "https://10.0.0.1:6443",
                "proxy-url": proxy,
                "certificate-authority-data": b64(CA),
            }
        },
        {"admin": {"token": TOKEN}},
        {"prod": ("prod", "admin")},
        "prod",
    )
    root.file("/root/.kube/config", text)
    with pytest.raises(ConfigError, match=r'cluster "prod" in /root/\.kube/config: proxy-url is not a URL'):
        root.resolve()


def test_plain_http_server_in_a_kubeconfig_gets_no_credentials(root: Root) -> None:
    root.file("/root/.kube/config", simple(server="http://127.0.0.1:8080"))
    creds = root.resolve()
    assert creds.plain_http
    assert creds.token is None


@pytest.mark.parametrize(
    ("user", "message"),
    [
        ({"auth-provider": {"name": "oidc"}}, r"auth-provider \(oidc\)"),
        ({"username": "admin", "password": "hunter2"}, "username and password"),
    ],
)
def test_credentials_gpunode_cannot_use(root: Root, user: dict[str, Any], message: str) -> None:
    root.file("/root/.kube/config", simple(user=user))
    with pytest.raises(ConfigError, match=message) as raised:
        root.resolve()
    assert raised.value.fix is not None and "kubectl proxy" in raised.value.fix
    assert "hunter2" not in str(raised.value)


def test_impersonation(root: Root) -> None:
    root.file("/root/.kube/config", simple(user={"token": TOKEN, "as": "jane", "as-groups": ["ops"]}))
    creds = root.resolve()
    assert (creds.impersonate_user, creds.impersonate_groups) == ("jane", ("ops",))


# -- malformed kubeconfigs ----------------------------------------------------------------------------------


def test_invalid_yaml_names_file_and_line_but_never_the_token(root: Root) -> None:
    root.file("/root/.kube/config", f"users:\n- name: a\n  user:\n    token: {TOKEN}\n      bad: [\n")
    with pytest.raises(
        ConfigError, match=r"kubeconfig /root/.kube/config is not valid YAML: .*\(line \d+"
    ) as raised:
        root.resolve()
    assert TOKEN not in str(raised.value)
    # Not even in the exception it was made from: nothing is chained to it.
    assert raised.value.__cause__ is None and raised.value.__context__ is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- just\n- a list\n", "is not a kubeconfig"),
        ("clusters: {a: 1}\n", "clusters is not a list"),
        ("clusters:\n- cluster: {server: x}\n", r"clusters\[0\] has no name"),
        ("contexts:\n- name: x\n  context: [1]\n", 'context "x" is not a mapping'),
        (
            "current-context: [x]\ncontexts:\n- name: x\n  context: {cluster: a}\n",
            "current-context is not a string",
        ),
        (
            "clusters:\n- name: a\n  cluster: {server: 'https://a', insecure-skip-tls-verify: 'yes please'}\n"
            "contexts:\n- name: x\n  context: {cluster: a}\ncurrent-context: x\n",
            "insecure-skip-tls-verify is not true or false",
        ),
    ],
)
def test_malformed_kubeconfig(root: Root, text: str, message: str) -> None:
    root.file("/root/.kube/config", text)
    with pytest.raises(ConfigError, match=message) as raised:
        root.resolve()
    assert "/root/.kube/config" in str(raised.value)


# -- where gpunode looks ------------------------------------------------------------------------------


def test_explicit_kubeconfig_must_exist(root: Root) -> None:
    root.file("/root/.kube/config", simple())
    with pytest.raises(NotFound, match=r"--kubeconfig /etc/missing\.conf does not exist"):
        root.resolve(kubeconfig="/etc/missing.conf")


def test_explicit_kubeconfig_wins_over_everything(root: Root) -> None:
    root.file("/root/.kube/config", simple(server="https://home:6443"))
    root.file("/etc/k/admin.conf", simple(server="https://explicit:6443"))
    root.env["KUBECONFIG"] = root.file("/etc/k/env.conf", simple(server="https://env:6443"))
    assert root.resolve(kubeconfig="/etc/k/admin.conf").server == "https://explicit:6443"


def test_kubeconfig_env_merges_first_file_wins(root: Root) -> None:
    root.file(
        "/etc/k/one.yaml",
        kubeconfig(
            {"shared": {"server": "https://one:6443"}},
            {"u": {"token": "token-one"}},
            {"ctx": ("shared", "u")},
        ),  # no current-context here
    )
    root.file(
        "/etc/k/two.yaml",
        kubeconfig(
            {"shared": {"server": "https://two:6443"}, "other": {"server": "https://other:6443"}},
            {"u": {"token": "token-two"}},
            {"ctx": ("other", "u"), "ctx2": ("other", "u")},
            "ctx",
        ),
    )
    root.env["KUBECONFIG"] = "/etc/k/missing.yaml:/etc/k/one.yaml::/etc/k/two.yaml"
    creds = root.resolve()
    # current-context "ctx" comes from two.yaml, but "ctx", its cluster and its user are one.yaml's.
    assert (creds.server, creds.token) == ("https://one:6443", "token-one")
    assert creds.source == 'kubeconfig /etc/k/one.yaml (from $KUBECONFIG), context "ctx"'
    assert root.resolve(context="ctx2").server == "https://other:6443"


def test_kubeconfig_env_naming_no_existing_file_falls_through(root: Root) -> None:
    root.env["KUBECONFIG"] = "/etc/k/missing.yaml"
    root.file("/root/.kube/config", simple(server="https://home:6443"))
    assert root.resolve().server == "https://home:6443"


def test_search_order(root: Root) -> None:
    root.file("/etc/rancher/rke2/rke2.yaml", simple(server="https://rke2:6443"))
    assert root.resolve().server == "https://rke2:6443"
    root.file("/etc/rancher/k3s/k3s.yaml", simple(server="https://k3s:6443"))
    assert root.resolve().server == "https://k3s:6443"
    root.file("/etc/kubernetes/kubelet.conf", simple(server="https://kubelet:6443"))
    assert root.resolve().server == "https://kubelet:6443"
    root.file("/root/.kube/config", simple(server="https://home:6443"))
    assert root.resolve().server == "https://home:6443"
    root.env["KUBECONFIG"] = root.file("/etc/k/env.yaml", simple(server="https://env:6443"))
    assert root.resolve().server == "https://env:6443"


def test_agent_kubelet_kubeconfig_on_k3s(root: Root) -> None:
    root.file("/var/lib/rancher/k3s/agent/kubelet.kubeconfig", simple(server="https://127.0.0.1:6444"))
    assert root.resolve().server == "https://127.0.0.1:6444"


def test_home_of_another_user(root: Root) -> None:
    root.env["HOME"] = "/home/ops"
    root.file("/home/ops/.kube/config", simple(server="https://ops:6443"))
    assert root.resolve().server == "https://ops:6443"


def test_an_empty_kubeconfig_is_passed_over(root: Root) -> None:
    root.file("/root/.kube/config", "apiVersion: v1\nclusters: null\ncontexts: null\ncurrent-context: ''\n")
    root.file("/etc/kubernetes/kubelet.conf", simple(server="https://kubelet:6443"))
    assert root.resolve().server == "https://kubelet:6443"


def test_in_cluster_service_account(root: Root) -> None:
    root.file("/var/run/secrets/kubernetes.io/serviceaccount/token", TOKEN)
    root.file("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt", CA)
    root.env.update({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    creds = root.resolve()
    assert creds.server == "https://10.96.0.1:443"
    assert creds.token == TOKEN
    assert isinstance(creds.verify, Pem)
    assert creds.verify.path == root.path / "var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    assert creds.source.startswith("in-cluster service account")
    assert creds.reload_token is not None  # projected tokens rotate
    root.env["KUBERNETES_SERVICE_HOST"] = "fd00:10:96::1"
    assert root.resolve().server == "https://[fd00:10:96::1]:443"


def test_in_cluster_comes_after_the_node_kubeconfigs(root: Root) -> None:
    root.file("/var/run/secrets/kubernetes.io/serviceaccount/token", TOKEN)
    root.env.update({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    root.file("/etc/kubernetes/kubelet.conf", simple(server="https://kubelet:6443"))
    assert root.resolve().server == "https://kubelet:6443"


def test_nothing_found_says_where_it_looked_and_the_fix(root: Root) -> None:
    root.env["KUBECONFIG"] = "/etc/k/missing.yaml"
    with pytest.raises(NotFound) as raised:
        root.resolve()
    message = raised.value.message
    for place in (
        "$KUBECONFIG=/etc/k/missing.yaml",
        "/root/.kube/config",
        "/etc/kubernetes/kubelet.conf",
        "/etc/rancher/k3s/k3s.yaml",
        "/etc/rancher/rke2/rke2.yaml",
        "in-cluster service account (KUBERNETES_SERVICE_HOST/PORT are not set",
    ):
        assert place in message
    assert raised.value.fix is not None
    assert "--kubeconfig PATH" in raised.value.fix and "--server URL" in raised.value.fix
    assert "\n" not in message


def test_context_with_nothing_found(root: Root) -> None:
    with pytest.raises(UsageError, match="--context prod: no kubeconfig was found"):
        root.resolve(context="prod")


# -- --server ---------------------------------------------------------------------------------------------


def test_server_override_plain_http_needs_no_credentials(root: Root) -> None:
    root.file("/root/.kube/config", simple())
    creds = root.resolve(server="http://127.0.0.1:8001/")
    assert creds.server == "http://127.0.0.1:8001"
    assert (creds.token, creds.cert) == (None, None)
    assert creds.source == "--server http://127.0.0.1:8001 (no credentials)"


def test_server_override_https_keeps_the_credentials(root: Root) -> None:
    root.file("/root/.kube/config", simple())
    creds = root.resolve(server="https://lb.example:443")
    assert creds.server == "https://lb.example:443"
    assert creds.token == TOKEN
    assert "server replaced by --server https://lb.example:443" in creds.source


def test_server_override_with_nothing_found(root: Root) -> None:
    creds = root.resolve(server="https://lb.example:443")
    assert (creds.server, creds.token, creds.verify) == ("https://lb.example:443", None, True)


def test_server_override_must_be_a_url(root: Root) -> None:
    with pytest.raises(UsageError, match="--server: 'ftp://x' is not an API server URL"):
        root.resolve(server="ftp://x")
    with pytest.raises(UsageError, match="is not an API server URL"):
        root.resolve(server="https://host:99999")


# -- input that reaches the API server is checked; secrets are never shown ----------------------------------

HALVES = ("first-half-3c1d-never-shown", "second-half-9e2f-never-shown")


def never_shows_the_token(error: BaseException) -> None:
    """Neither the error nor any exception chained to it (what --debug prints) shows a part of it."""
    pending: list[BaseException | None] = [error]
    seen: list[BaseException] = []
    while pending:
        current = pending.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        shown = f"{current} {current.args!r}"
        assert not any(half in shown for half in HALVES), shown
        pending.extend([current.__cause__, current.__context__])


@pytest.mark.parametrize(
    "token",
    [
        f"{HALVES[0]}\n{HALVES[1]}",
        f"{HALVES[0]}\r\nX-Injected: yes{HALVES[1]}",
        f"{HALVES[0]} {HALVES[1]}",
        f"{HALVES[0]}\x00{HALVES[1]}",
        f"{HALVES[0]}\u00e9{HALVES[1]}",
    ],
    ids=["line-break", "header-injection", "space", "nul", "non-ascii"],
)
def test_a_token_that_cannot_be_a_header_is_refused_without_showing_it(root: Root, token: str) -> None:
    root.file("/root/.kube/config", simple(user={"token": token}))
    with pytest.raises(ConfigError) as raised:
        root.resolve()
    assert raised.value.message.startswith(
        'the token from user "admin" in /root/.kube/config (token) holds a space, line break, control or '
        "non-ASCII character"
    )
    never_shows_the_token(raised.value)


def test_a_token_file_with_a_line_break_inside_is_refused_without_showing_it(root: Root) -> None:
    root.file("/etc/k/token", f"{HALVES[0]}\n{HALVES[1]}\n")
    root.file("/root/.kube/config", simple(user={"tokenFile": "/etc/k/token"}))
    with pytest.raises(ConfigError) as raised:
        root.resolve()
    assert "the token from the file /etc/k/token named by user" in raised.value.message
    never_shows_the_token(raised.value)
    # Whitespace around the token is no part of it (a file written with echo ends with a newline).
    root.file("/etc/k/token", f"  {HALVES[0]}\n")
    assert root.resolve().token == HALVES[0]


def test_a_token_file_that_is_not_ascii_is_refused_without_showing_it(root: Root) -> None:
    local = root.path / "etc/k/token"
    local.parent.mkdir(parents=True)
    local.write_bytes(HALVES[0].encode() + b"\xff\xfe" + HALVES[1].encode())
    root.file("/root/.kube/config", simple(user={"tokenFile": "/etc/k/token"}))
    with pytest.raises(ConfigError) as raised:
        root.resolve()
    assert "holds a non-ASCII byte" in raised.value.message
    never_shows_the_token(raised.value)


def test_a_service_account_token_with_a_line_break_is_refused_without_showing_it(root: Root) -> None:
    root.file("/var/run/secrets/kubernetes.io/serviceaccount/token", f"{HALVES[0]}\n{HALVES[1]}")
    root.env.update({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    with pytest.raises(ConfigError) as raised:
        root.resolve()
    assert "/var/run/secrets/kubernetes.io/serviceaccount/token" in raised.value.message
    never_shows_the_token(raised.value)


def test_an_impersonated_name_with_a_line_break_is_refused(root: Root) -> None:
    root.file("/root/.kube/config", simple(user={"token": TOKEN, "as": "admin\nX-Injected: yes"}))
    with pytest.raises(ConfigError, match=r"an impersonated name .* holds a control character"):
        root.resolve()


@pytest.mark.parametrize(
    "server", ["https://10.0.0.1:64\t43", "https://10.0.0.1\n.evil:6443", "https://a b:1"]
)
def test_a_server_url_with_a_control_character_or_space_is_refused(root: Root, server: str) -> None:
    # urlsplit would silently drop the line break and make another URL of it.
    with pytest.raises(UsageError, match="holds a space or control character"):
        root.resolve(server=server)
    root.file("/root/.kube/config", simple(server=server))
    with pytest.raises(ConfigError, match="holds a space or control character"):
        root.resolve()


def test_a_server_url_with_a_password_is_refused_without_showing_it(root: Root) -> None:
    with pytest.raises(UsageError) as raised:
        root.resolve(server="https://admin:pass-5e5e-never-shown@10.0.0.1:6443")
    assert "carries a user name or password" in raised.value.message
    assert "pass-5e5e-never-shown" not in str(raised.value)


def test_a_proxy_password_is_not_in_the_repr(root: Root) -> None:
    config = yaml.safe_load(simple())
    config["clusters"][0]["cluster"]["proxy-url"] = "http://u:proxy-pw-never-shown@proxy:3128"
    root.file("/root/.kube/config", yaml.safe_dump(config))
    creds = root.resolve()
    assert creds.proxy == "http://u:proxy-pw-never-shown@proxy:3128"  # still used as given
    assert "proxy-pw-never-shown" not in repr(creds) and "http://u:***@proxy:3128" in repr(creds)


# -- JSON pointers ------------------------------------------------------------------------------------------


def test_json_pointer_escaping() -> None:
    assert escape_json_pointer("nvidia.com/gpu") == "nvidia.com~1gpu"
    assert escape_json_pointer("a~b/c") == "a~0b~1c"
    assert escape_json_pointer("~1") == "~01"  # "~" first, or "/" would come back as "~01"
    assert json_pointer("status", "capacity", "nvidia.com/gpu") == "/status/capacity/nvidia.com~1gpu"
    assert json_pointer() == ""
