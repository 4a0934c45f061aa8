"""Exec credential plugins, run as client-go runs them: real programs (small Python and sh scripts written
under a temp root) that print ExecCredential JSON, against the test API server over real TLS, which
checks the token or client certificate they gave. Every test also checks that the token never reaches a
log line."""

from __future__ import annotations

import base64
import json
import logging
import os
import pty
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.errors import ApiError, CommandFailed, ConfigError, ExitCode, NotFound, UsageError
from gpunode.host import Host
from gpunode.kube import execplugin
from gpunode.kube.client import KubeClient, RetryPolicy, Timeouts
from gpunode.kube.credentials import resolve_credentials
from gpunode.kube.execplugin import V1, V1BETA1
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.pki import CertPair, Pki

# Odd on purpose: shell metacharacters and quotes, so that a token that went through a shell or a format
# string would show.
TOKEN = "exec-token-'$(id)\";never-shown-7f3a"  # noqa: S105 (test tokens)
NEW_TOKEN = "exec-token-rotated-never-shown-91c2"  # noqa: S105
ARG_SECRET = "arg-secret-never-shown-0b7d"  # noqa: S105 (a plugin taking a key as an argument)
ENV_SECRET = "env-secret-never-shown-5e11"  # noqa: S105
SH_TOKEN = "sh-token-never-shown-c4d8"  # noqa: S105 (JSON-safe: the sh plugin prints it with printf)
SECRETS = (TOKEN, NEW_TOKEN, ARG_SECRET, ENV_SECRET, SH_TOKEN)
FAST = RetryPolicy(attempts=2, backoff=0.001, max_backoff=0.01, conflict_attempts=2)
TIMEOUTS = Timeouts(connect=5.0, read=20.0)

# The fake plugin: it records how it was run (arguments, KUBERNETES_EXEC_INFO, the variables asked for,
# whether stdin is a terminal and what it holds), then does what its JSON file next to it says.
PLUGIN = """#!{python}
import json, os, sys, time
stem = os.path.splitext(os.path.abspath(__file__))[0]
with open(stem + ".json") as f:
    conf = json.load(f)
info = json.loads(os.environ.get("KUBERNETES_EXEC_INFO", "null"))
interactive = bool(info and info["spec"]["interactive"])
# Not interactive, stdin must be empty (/dev/null); interactive, a line is read from the terminal.
if not interactive:
    stdin = sys.stdin.read(64)
else:
    stdin = sys.stdin.readline() if conf.get("prompt") else None
record = {{
    "argv": sys.argv[1:],
    "info": info,
    "env": {{k: os.environ.get(k) for k in conf.get("show_env", [])}},
    "stdin_tty": os.isatty(0),
    "stdin": stdin,
}}
with open(stem + ".runs", "a") as f:
    f.write(json.dumps(record) + "\\n")
if conf.get("stderr"):
    sys.stderr.write(conf["stderr"])
    sys.stderr.flush()
if conf.get("sleep"):
    time.sleep(conf["sleep"])
if "raw" in conf:
    sys.stdout.write(conf["raw"])
else:
    keys = ("token", "clientCertificateData", "clientKeyData", "expirationTimestamp")
    status = {{k: conf[k] for k in keys if k in conf}}
    out = {{"apiVersion": conf.get("apiVersion", "{v1}"), "kind": conf.get("kind", "ExecCredential")}}
    out["status"] = status
    sys.stdout.write(json.dumps(out))
sys.exit(conf.get("exit", 0))
"""

# A v1beta1 plugin in sh, its token from a variable the kubeconfig's `env` sets.
SH_PLUGIN = """#!/bin/sh
printf '{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential",'
printf '"status":{"token":"%s"}}' "$PLUGIN_TOKEN"
"""


class Plugin:
    """A fake plugin at a host path under the root; `set` says what its next runs do."""

    def __init__(self, root: Path, host_path: str) -> None:
        self.host_path = host_path
        self.local = root / host_path.lstrip("/")
        self.local.parent.mkdir(parents=True, exist_ok=True)
        self.local.write_text(PLUGIN.format(python=sys.executable, v1=V1))
        self.local.chmod(0o755)
        self.set(token=TOKEN)

    def set(self, **conf: Any) -> None:
        self.local.with_suffix(".json").write_text(json.dumps(conf))

    @property
    def runs(self) -> list[dict[str, Any]]:
        log = self.local.with_suffix(".runs")
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


class Node:
    """A temp root with a kubeconfig for the test API server whose user runs an exec plugin."""

    def __init__(self, root: Path, api: ApiServer, pki: Pki) -> None:
        self.root = root
        self.api = api
        self.pki = pki
        self.env: dict[str, str] = {"HOME": "/root", "PATH": "/usr/bin:/bin"}
        self.plugin = Plugin(root, "/root/.kube/plugin")

    def kubeconfig(
        self,
        exec_: dict[str, Any],
        *,
        path: str = "/root/.kube/config",
        cluster: dict[str, Any] | None = None,
    ) -> None:
        ca = base64.b64encode(self.pki.ca.cert.read_bytes()).decode()
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "c",
                    "cluster": {"server": self.api.url, "certificate-authority-data": ca, **(cluster or {})},
                }
            ],
            "users": [{"name": "u", "user": {"exec": exec_}}],
            "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "ctx",
        }
        local = self.root / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(yaml.safe_dump(document))

    def host(self) -> Host:
        return Host(root=self.root, env=self.env, euid=0)

    def client(self, **kwargs: Any) -> KubeClient:
        kwargs.setdefault("retry", FAST)
        kwargs.setdefault("timeouts", TIMEOUTS)
        return KubeClient.from_host(self.host(), **kwargs)

    def get(self) -> dict[str, Any]:
        with self.client() as kube:
            return kube.get_node("n1")


def exec_v1(command: str = "./plugin", **extra: Any) -> dict[str, Any]:
    return {"apiVersion": V1, "command": command, "interactiveMode": "Never", **extra}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(pki, tokens={TOKEN: "admin"}, allow=[("admin", "*", "*")]) as server:
        server.add_node("n1")
        yield server


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test a process of its own as far as the plugin cache goes, and no terminal (pytest's stdin
    may be one when run by hand)."""
    execplugin.forget_all()
    monkeypatch.setattr(execplugin, "stdin_is_terminal", lambda: False)
    yield
    execplugin.forget_all()


@pytest.fixture(autouse=True)
def secrets_never_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    for secret in SECRETS:
        assert secret not in caplog.text


@pytest.fixture
def node(tmp_path: Path, api: ApiServer, pki: Pki) -> Node:
    return Node(tmp_path / "root", api, pki)


def shows_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


# -- running the plugin --------------------------------------------------------------------------------------


def test_v1_plugin_token_reaches_the_server_and_the_plugin_gets_exec_info(node: Node) -> None:
    args = ["get-token", "--cluster", "a b", "$(touch /tmp/x)", f"--key={ARG_SECRET}"]
    node.kubeconfig(exec_v1(args=args))
    assert node.get()["metadata"]["name"] == "n1"
    (run,) = node.plugin.runs
    # An argument list, never a shell: spaces and $( ) arrive as written.
    assert run["argv"] == args
    assert run["info"] == {"kind": "ExecCredential", "apiVersion": V1, "spec": {"interactive": False}}
    assert run["stdin_tty"] is False and run["stdin"] == ""  # interactiveMode Never: no stdin at all
    assert [(r.user, r.authenticated_by, r.status) for r in node.api.requests] == [("admin", "token", 200)]


def test_v1beta1_sh_plugin_with_env_over_the_parent_environment(node: Node) -> None:
    script = node.root / "usr/local/bin/sh-plugin"
    script.parent.mkdir(parents=True)
    script.write_text(SH_PLUGIN)
    script.chmod(0o755)
    node.env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    node.env["PLUGIN_TOKEN"] = "the-parent-value"  # noqa: S105
    # v1beta1 defaults interactiveMode to IfAvailable; a bare name is looked up on PATH (under the root).
    node.api.tokens[SH_TOKEN] = "admin"
    node.kubeconfig(
        {"apiVersion": V1BETA1, "command": "sh-plugin", "env": [{"name": "PLUGIN_TOKEN", "value": SH_TOKEN}]}
    )
    assert node.get()["metadata"]["name"] == "n1"
    assert [(r.user, r.status) for r in node.api.requests] == [("admin", 200)]


def test_env_entries_and_the_exec_info_as_the_plugin_sees_them(node: Node) -> None:
    node.env["AWS_PROFILE"] = "parent"
    node.env["KEPT"] = "from-the-parent"
    node.plugin.set(token=TOKEN, show_env=["AWS_PROFILE", "KEPT", "SECRETISH"])
    node.kubeconfig(
        exec_v1(
            env=[{"name": "AWS_PROFILE", "value": "prod"}, {"name": "SECRETISH", "value": ENV_SECRET}],
            interactiveMode="IfAvailable",
        )
    )
    node.get()
    (run,) = node.plugin.runs
    assert run["env"] == {"AWS_PROFILE": "prod", "KEPT": "from-the-parent", "SECRETISH": ENV_SECRET}
    # IfAvailable without a terminal: not interactive, and no stdin.
    assert run["info"]["spec"] == {"interactive": False}
    assert run["stdin"] == ""


def test_provide_cluster_info(node: Node) -> None:
    extension = {"name": "client.authentication.k8s.io/exec", "extension": {"audience": "06e3fbd18de8"}}
    node.kubeconfig(exec_v1(provideClusterInfo=True), cluster={"extensions": [extension]})
    node.get()
    cluster = node.plugin.runs[0]["info"]["spec"]["cluster"]
    assert cluster["server"] == node.api.url
    assert base64.b64decode(cluster["certificate-authority-data"]) == node.pki.ca.cert.read_bytes()
    assert cluster["config"] == {"audience": "06e3fbd18de8"}


def test_provide_cluster_info_with_a_ca_file(node: Node) -> None:
    ca = node.root / "etc/kubernetes/pki/ca.crt"
    ca.parent.mkdir(parents=True)
    ca.write_bytes(node.pki.ca.cert.read_bytes())
    cluster = {"certificate-authority-data": None, "certificate-authority": "/etc/kubernetes/pki/ca.crt"}
    node.kubeconfig(exec_v1(provideClusterInfo=True), cluster=cluster)
    node.get()
    sent = node.plugin.runs[0]["info"]["spec"]["cluster"]["certificate-authority-data"]
    assert base64.b64decode(sent) == node.pki.ca.cert.read_bytes()


def test_without_provide_cluster_info_no_cluster_is_sent(node: Node) -> None:
    node.kubeconfig(exec_v1())
    node.get()
    assert "cluster" not in node.plugin.runs[0]["info"]["spec"]


def test_server_override_reaches_the_cluster_info(node: Node) -> None:
    node.kubeconfig(exec_v1(provideClusterInfo=True))
    other = node.api.url.replace("127.0.0.1", "localhost")
    with node.client(server=other) as kube:
        kube.get_node("n1")
    assert node.plugin.runs[0]["info"]["spec"]["cluster"]["server"] == other


def test_command_with_a_slash_is_relative_to_the_kubeconfig(node: Node) -> None:
    plugin = Plugin(node.root, "/etc/cluster/bin/get-token")
    node.kubeconfig(exec_v1("bin/get-token"), path="/etc/cluster/kubeconfig")
    node.env["KUBECONFIG"] = "/etc/cluster/kubeconfig"
    node.get()
    assert len(plugin.runs) == 1 and node.plugin.runs == []


def test_client_certificate_from_the_plugin(node: Node) -> None:
    pair: CertPair = node.pki.client("system:node:n1", ["system:nodes"])
    node.api.allow("system:node:n1", "*", "*")
    node.plugin.set(clientCertificateData=pair.cert.read_text(), clientKeyData=pair.key.read_text())
    node.kubeconfig(exec_v1())
    with node.client() as kube:
        kube.get_node("n1")
        private = kube._tempdir  # where requests loads the key from
        assert private is not None  # the inline CA is there too
        assert {"exec-1.crt", "exec-1.key"} <= set(os.listdir(private))
    assert not os.path.exists(private)  # gone with the client
    assert [(r.user, r.authenticated_by) for r in node.api.requests] == [("system:node:n1", "certificate")]


def test_a_token_from_the_kubeconfig_wins_and_the_plugin_is_not_run(node: Node) -> None:
    node.kubeconfig(exec_v1())
    config = node.root / "root/.kube/config"
    document = yaml.safe_load(config.read_text())
    document["users"][0]["user"]["token"] = TOKEN
    config.write_text(yaml.safe_dump(document))
    node.get()
    assert node.plugin.runs == []


# -- caching -------------------------------------------------------------------------------------------------


def test_cached_for_the_process_across_clients_without_an_expiry(node: Node) -> None:
    node.kubeconfig(exec_v1())
    for _ in range(2):
        with node.client() as kube:
            kube.get_node("n1")
            kube.get_node("n1")
    assert len(node.plugin.runs) == 1
    assert len(node.api.requests) == 4


def test_cached_until_the_expiration_timestamp(node: Node) -> None:
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    node.plugin.set(token=TOKEN, expirationTimestamp=later)
    node.kubeconfig(exec_v1())
    node.get()
    node.get()
    assert len(node.plugin.runs) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2030-01-02T03:04:05Z", datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)),
        ("2030-01-02T03:04:05.123456789Z", datetime(2030, 1, 2, 3, 4, 5, 123456, tzinfo=timezone.utc)),
        ("2030-01-02T05:04:05+02:00", datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)),
        ("2030-01-02T03:04:05", None),  # no zone: Go's RFC 3339 layout wants one
        ("2030-02-30T03:04:05Z", None),
        ("2030-01-02 03:04:05Z", None),
    ],
)
def test_expiration_timestamps_as_metav1_time_reads_them(text: str, expected: datetime | None) -> None:
    assert execplugin._rfc3339(text) == expected


def test_expired_credentials_run_the_plugin_again(node: Node) -> None:
    past = (datetime.now(timezone.utc) - timedelta(minutes=1)).isoformat()
    node.plugin.set(token=TOKEN, expirationTimestamp=past)
    node.kubeconfig(exec_v1())
    with node.client() as kube:
        kube.get_node("n1")
        kube.get_node("n1")
    assert len(node.plugin.runs) == 2


def test_a_rejected_token_runs_the_plugin_again_once(node: Node) -> None:
    node.kubeconfig(exec_v1())
    with node.client() as kube:
        kube.get_node("n1")
        # The cluster rotates the credential; the plugin now gives the new one.
        node.api.tokens = {NEW_TOKEN: "admin"}
        node.plugin.set(token=NEW_TOKEN)
        kube.get_node("n1")
    assert len(node.plugin.runs) == 2
    assert [r.status for r in node.api.requests] == [200, 401, 200]


def test_a_token_rejected_again_is_a_401_after_one_more_run(node: Node) -> None:
    node.kubeconfig(exec_v1())
    node.api.tokens = {}
    with node.client() as kube, pytest.raises(ApiError) as raised:
        kube.get_node("n1")
    assert "401" in raised.value.message
    assert "exec plugin `./plugin`" in raised.value.message
    assert len(node.plugin.runs) == 2  # the first run, and one after the 401: no loop
    shows_no_secret(str(raised.value))


# -- failures ------------------------------------------------------------------------------------------------


def test_a_failing_plugin_names_the_program_and_its_stderr_is_shown(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    node.plugin.set(exit=3, stderr="error: the SSO session has expired; run `aws sso login`\n")
    node.kubeconfig(exec_v1(args=[f"--key={ARG_SECRET}"], env=[{"name": "K", "value": ENV_SECRET}]))
    with pytest.raises(CommandFailed) as raised:
        node.get()
    error = raised.value
    assert error.exit_code == ExitCode.COMMAND_FAILED
    assert "`./plugin`" in error.message and 'user "u"' in error.message
    assert "exit status 3" in error.message
    assert "aws sso login" in capsys.readouterr().err
    shows_no_secret(str(error))
    assert node.api.requests == []  # nothing was sent without credentials


def test_stderr_of_a_successful_plugin_is_shown_with_the_token_hidden(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    node.plugin.set(token=TOKEN, stderr=f"debug: got {TOKEN}\nwarning: profile is deprecated\n")
    node.kubeconfig(exec_v1())
    node.get()
    err = capsys.readouterr().err
    assert "warning: profile is deprecated" in err
    assert "debug: got <hidden>" in err
    shows_no_secret(err)


def test_a_flood_on_stderr_is_bounded(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    node.plugin.set(token=TOKEN, stderr="x" * 200_000)
    node.kubeconfig(exec_v1())
    node.get()
    err = capsys.readouterr().err
    assert len(err) < 20_000
    assert "more characters from `./plugin` not shown" in err


def test_a_plugin_that_is_not_installed_shows_the_install_hint(node: Node) -> None:
    hint = "Install gke-gcloud-auth-plugin: gcloud components install gke-gcloud-auth-plugin"
    node.kubeconfig(exec_v1("gke-gcloud-auth-plugin", installHint=hint))
    with pytest.raises(NotFound) as raised:
        node.get()
    assert "`gke-gcloud-auth-plugin`" in raised.value.message
    assert "not found on PATH" in raised.value.message
    assert raised.value.fix == hint


def test_a_missing_plugin_file_is_named(node: Node) -> None:
    node.kubeconfig(exec_v1("./no-such-plugin"))
    with pytest.raises(NotFound, match=r"no such file /root/\.kube/no-such-plugin") as raised:
        node.get()
    assert raised.value.fix is not None and "client-go-credential-plugins" in raised.value.fix


def test_a_plugin_that_hangs_is_stopped(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execplugin, "TIMEOUT", 1.0)
    node.plugin.set(token=TOKEN, sleep=60)
    node.kubeconfig(exec_v1(args=[ARG_SECRET]))
    with pytest.raises(CommandFailed) as raised:
        node.get()
    assert "`./plugin`" in raised.value.message
    assert "did not finish within 1 s and was stopped" in raised.value.message
    shows_no_secret(str(raised.value))


@pytest.mark.parametrize(
    ("conf", "said"),
    [
        ({"raw": "hello, here is your token\n"}, "not a JSON object"),
        ({"raw": ""}, "not a JSON object"),
        ({"raw": "[" * 100_000}, "not a JSON object"),
        ({"raw": json.dumps({"apiVersion": V1, "kind": "Secret", "status": {"token": TOKEN}})}, "its kind"),
        ({"token": TOKEN, "apiVersion": V1BETA1}, f"apiVersion {V1BETA1}, but the kubeconfig says {V1}"),
        ({"token": TOKEN, "apiVersion": TOKEN}, "another apiVersion"),
        ({"raw": json.dumps({"apiVersion": V1, "kind": "ExecCredential"})}, "without a status"),
        ({}, "neither a token nor a client certificate and key"),
        ({"clientCertificateData": "-----BEGIN CERTIFICATE-----\n"}, "certificate without its key"),
        ({"token": 42}, "status.token is not a string"),
        ({"token": TOKEN, "expirationTimestamp": "tomorrow"}, "not an RFC 3339 time"),
        ({"token": f"{TOKEN}\nX-Injected: 1"}, "(it is not shown here)"),
        ({"token": f"{TOKEN} second-half"}, "(it is not shown here)"),
    ],
)
def test_output_that_is_no_exec_credential(node: Node, conf: dict[str, Any], said: str) -> None:
    node.plugin.set(**conf)
    node.kubeconfig(exec_v1())
    with pytest.raises(CommandFailed) as raised:
        node.get()
    assert "`./plugin`" in raised.value.message
    assert said in raised.value.message
    shows_no_secret(str(raised.value))
    assert node.api.requests == []


def test_a_certificate_and_key_that_do_not_load(node: Node) -> None:
    node.plugin.set(
        clientCertificateData="-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        clientKeyData="-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    node.kubeconfig(exec_v1())
    with pytest.raises(CommandFailed, match=r"client certificate and key from the exec plugin `\./plugin`"):
        node.get()


# -- interactive mode ----------------------------------------------------------------------------------------


def test_always_interactive_without_a_terminal_is_refused_before_running(node: Node) -> None:
    node.kubeconfig(exec_v1(interactiveMode="Always"))
    with pytest.raises(UsageError, match="standard input is not a terminal") as raised:
        node.get()
    assert "`./plugin`" in raised.value.message
    assert node.plugin.runs == []


def test_if_available_with_a_terminal_is_interactive(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execplugin, "stdin_is_terminal", lambda: True)
    node.kubeconfig(exec_v1(interactiveMode="IfAvailable"))
    node.get()
    assert node.plugin.runs[0]["info"]["spec"] == {"interactive": True}


def test_always_on_a_real_terminal_reads_from_it(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    # gpunode's standard input becomes a pseudo-terminal with a line typed on it: the plugin (run with
    # the terminal handed over) must see a terminal and read that line.
    monkeypatch.undo()  # the real terminal test, not the fixture's "no terminal"
    execplugin.forget_all()
    node.plugin.set(token=TOKEN, prompt=True)
    node.kubeconfig(exec_v1(interactiveMode="Always"))
    main, replica = pty.openpty()
    saved = os.dup(0)
    try:
        os.write(main, b"typed-at-the-prompt\n")
        os.dup2(replica, 0)
        node.get()
    finally:
        os.dup2(saved, 0)
        for fd in (saved, main, replica):
            os.close(fd)
    (run,) = node.plugin.runs
    assert run["info"]["spec"] == {"interactive": True}
    assert run["stdin_tty"] is True
    assert run["stdin"] == "typed-at-the-prompt\n"


def test_never_is_not_interactive_even_with_a_terminal(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execplugin, "stdin_is_terminal", lambda: True)
    node.kubeconfig(exec_v1(interactiveMode="Never"))
    node.get()
    assert node.plugin.runs[0]["info"]["spec"] == {"interactive": False}
    assert node.plugin.runs[0]["stdin"] == ""


# -- the kubeconfig's exec, checked --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exec_", "said"),
    [
        ({"apiVersion": V1, "command": "./plugin"}, "interactiveMode must be set"),
        (
            {"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"},
            "removed in Kubernetes 1.24",
        ),
        ({"command": "./plugin", "interactiveMode": "Never"}, "exec has no apiVersion"),
        ({"apiVersion": V1, "interactiveMode": "Never"}, "exec has no command"),
        ({"apiVersion": V1, "command": "x", "interactiveMode": "Sometimes"}, "is not one of Never"),
        ({"apiVersion": V1, "command": "x", "interactiveMode": "Never", "env": [{"value": "v"}]}, "env[0]"),
        ({"apiVersion": V1, "command": "x", "interactiveMode": "Never", "args": "get-token"}, "args"),
    ],
)
def test_an_exec_stanza_kubectl_would_refuse(node: Node, exec_: dict[str, Any], said: str) -> None:
    node.kubeconfig(exec_)
    with pytest.raises(ConfigError) as raised:
        resolve_credentials(node.host())
    assert said in raised.value.message
    assert 'user "u" in /root/.kube/config' in raised.value.message


def test_the_reprs_show_the_command_only(node: Node) -> None:
    node.kubeconfig(exec_v1(args=[ARG_SECRET], env=[{"name": "K", "value": ENV_SECRET}]))
    credentials = resolve_credentials(node.host())
    with KubeClient(credentials, env={}, host=node.host(), retry=FAST, timeouts=TIMEOUTS) as kube:
        kube.get_node("n1")
        texts = [repr(credentials), repr(kube), repr(credentials.exec_plugin)]
        texts.append(repr(execplugin.authenticator(node.host(), credentials.exec_plugin)))  # type: ignore[arg-type]
    for text in texts:
        shows_no_secret(text)
    assert "./plugin" in repr(credentials)
    assert credentials.auth == "the credentials of the exec plugin `./plugin`"


def test_resolution_does_not_run_the_plugin(node: Node) -> None:
    # doctor and `up` resolve credentials before they know they will send anything.
    node.kubeconfig(exec_v1())
    resolve_credentials(node.host())
    assert node.plugin.runs == []
    assert not os.path.exists(node.plugin.local.with_suffix(".runs"))
