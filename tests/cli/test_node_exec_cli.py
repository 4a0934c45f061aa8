"""`gpunode node advertise|withdraw`, `up` and `down` with the credentials managed clusters use: an exec
credential plugin (a real program under the temp root), a token file that rotates between runs, and
kubectl's --request-timeout. The whole CLI in this process, the test API server over real TLS; a token
with odd content never appears in the output, the logs or what --debug prints."""

from __future__ import annotations

import base64
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, SubprocessRunner
from gpunode.kube import execplugin
from gpunode.kube.execplugin import V1
from tests.kubeapi.apiserver import ApiServer
from tests.kubeapi.pki import Pki

NODE = "gpu-node-1"
# Quotes, a dollar and a backslash: what a shell, a format string or a repr would mangle or show.
TOKEN = "exec-cli-token-'$(id)\\\"never-shown-3c1d"  # noqa: S105 (test tokens)
FILE_TOKEN = "file-token-first-never-shown-1a1a"  # noqa: S105
ROTATED = "file-token-rotated-never-shown-2b2b"
ARG_SECRET = "arg-secret-never-shown-9e9e"  # noqa: S105
SECRETS = (TOKEN, FILE_TOKEN, ROTATED, ARG_SECRET)

PLUGIN = """#!{python}
import json, os, sys
stem = os.path.splitext(os.path.abspath(__file__))[0]
with open(stem + ".json") as f:
    conf = json.load(f)
with open(stem + ".runs", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if conf.get("stderr"):
    sys.stderr.write(conf["stderr"])
if "raw" in conf:
    sys.stdout.write(conf["raw"])
else:
    out = {{"apiVersion": "{v1}", "kind": "ExecCredential", "status": {{"token": conf["token"]}}}}
    sys.stdout.write(json.dumps(out))
sys.exit(conf.get("exit", 0))
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def api(pki: Pki) -> Iterator[ApiServer]:
    with ApiServer(pki, tokens={TOKEN: "admin", FILE_TOKEN: "admin"}, allow=[("admin", "*", "*")]) as server:
        server.add_node(NODE)
        yield server


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """No plugin credentials kept from another test, no terminal, and no secret in any log record."""
    execplugin.forget_all()
    monkeypatch.setattr(execplugin, "stdin_is_terminal", lambda: False)
    caplog.set_level(logging.DEBUG)
    yield
    execplugin.forget_all()
    for secret in SECRETS:
        assert secret not in caplog.text


class Node:
    """This node's files under a temp root, a kubeconfig for the test server, and the CLI run on them
    with the real runner (the plugin is a real program)."""

    def __init__(self, root: Path, api: ApiServer, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
        self.root = root
        self.api = api
        self.pki = pki
        self.capsys = capsys
        self.file("/etc/hostname", f"{NODE}\n")
        self.plugin = self.file("/root/.kube/get-token", PLUGIN.format(python=sys.executable, v1=V1))
        self.plugin.chmod(0o755)
        self.plugin_says(token=TOKEN)

    def file(self, host_path: str, text: str) -> Path:
        path = self.root / host_path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def plugin_says(self, **conf: Any) -> None:
        self.plugin.with_suffix(".json").write_text(json.dumps(conf))

    @property
    def plugin_runs(self) -> list[list[str]]:
        runs = self.plugin.with_suffix(".runs")
        return [json.loads(line) for line in runs.read_text().splitlines()] if runs.exists() else []

    def kubeconfig(self, user: dict[str, Any]) -> None:
        ca = base64.b64encode(self.pki.ca.cert.read_bytes()).decode()
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "c", "cluster": {"server": self.api.url, "certificate-authority-data": ca}}
            ],
            "users": [{"name": "u", "user": user}],
            "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "ctx",
        }
        self.file("/root/.kube/config", yaml.safe_dump(document))

    def exec_kubeconfig(self, **extra: Any) -> None:
        exec_ = {"apiVersion": V1, "command": "./get-token", "interactiveMode": "Never", **extra}
        self.kubeconfig({"exec": exec_})

    def run(self, *args: str) -> tuple[int, str, str]:
        host = Host(
            root=self.root,
            runner=SubprocessRunner(),
            env={"HOME": "/root", "PATH": "/usr/sbin:/usr/bin:/bin"},
            euid=0,
        )
        code = main(list(args), host=host)
        out, err = self.capsys.readouterr()
        for secret in SECRETS:
            assert secret not in out and secret not in err
        return code, out, err

    def advertise(self, *args: str, debug: bool = False) -> tuple[int, str, str]:
        # A count and no labels: no NVML needed, one status patch.
        first = ["--debug"] if debug else []
        return self.run(*first, "node", "advertise", "--count", "2", "--no-labels", *args)


@pytest.fixture
def node(tmp_path: Path, api: ApiServer, pki: Pki, capsys: pytest.CaptureFixture[str]) -> Node:
    return Node(tmp_path / "root", api, pki, capsys)


def error_line(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("gpunode: error:"))


# -- exec plugins --------------------------------------------------------------------------------------------


def test_advertise_with_an_exec_plugin_and_debug_never_shows_the_token(node: Node) -> None:
    node.exec_kubeconfig(args=["token", f"--key={ARG_SECRET}"])
    code, out, _ = node.advertise(debug=True)
    assert code == ExitCode.OK, out
    assert node.api.node(NODE)["status"]["capacity"]["nvidia.com/gpu"] == "2"
    assert {(r.user, r.authenticated_by) for r in node.api.requests} == {("admin", "token")}
    assert node.plugin_runs == [["token", f"--key={ARG_SECRET}"]]  # once for all the run's requests


def test_a_failing_plugin_is_exit_8_naming_it_with_its_stderr(node: Node) -> None:
    node.exec_kubeconfig(args=[ARG_SECRET])
    node.plugin_says(exit=1, stderr="error: you must be logged in: run `kubelogin login`\n")
    code, out, err = node.advertise(debug=True)
    assert code == ExitCode.COMMAND_FAILED
    assert error_line(err) == (
        'gpunode: error: the exec plugin `./get-token` of user "u" in /root/.kube/config failed with exit '
        "status 1 (its messages are above)"
    )
    assert "run `kubelogin login`" in err
    assert out == "" and node.api.requests == []


def test_a_token_with_a_line_break_from_the_plugin_is_never_shown(node: Node) -> None:
    node.exec_kubeconfig()
    node.plugin_says(token=f"{TOKEN}\nX-Injected: yes")
    code, _, err = node.advertise(debug=True)
    assert code == ExitCode.COMMAND_FAILED
    assert "(it is not shown here)" in error_line(err)
    assert "X-Injected" not in err
    assert node.api.requests == []


def test_a_plugin_that_is_not_installed_says_how_to_install_it(node: Node) -> None:
    node.kubeconfig(
        {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1",
                "command": "aws",
                "args": ["eks", "get-token", "--cluster-name", "prod"],
                "installHint": "Install the AWS CLI: https://aws.amazon.com/cli/",
            }
        }
    )
    code, _, err = node.advertise()
    assert code == ExitCode.NOT_FOUND
    assert error_line(err) == (
        'gpunode: error: the exec plugin `aws` of user "u" in /root/.kube/config is not installed (not found '
        "on PATH)"
    )
    assert "  fix: Install the AWS CLI: https://aws.amazon.com/cli/" in err


def test_withdraw_reuses_nothing_across_runs_but_runs_the_plugin_once_per_run(node: Node) -> None:
    node.exec_kubeconfig()
    assert node.advertise()[0] == ExitCode.OK
    execplugin.forget_all()  # a new process
    assert node.run("node", "withdraw")[0] == ExitCode.OK
    assert len(node.plugin_runs) == 2


# -- token files ---------------------------------------------------------------------------------------------


def test_a_token_file_is_read_afresh_on_each_run(node: Node) -> None:
    token_file = node.file("/var/run/secrets/gpunode/token", f"{FILE_TOKEN}\n")
    node.kubeconfig({"tokenFile": "/var/run/secrets/gpunode/token"})
    assert node.advertise("--dry-run")[0] == ExitCode.OK
    # Rotated between two runs of the same process: the second run sends the new token.
    node.api.tokens = {ROTATED: "admin"}
    token_file.write_text(f"{ROTATED}\n")
    assert node.advertise()[0] == ExitCode.OK
    assert [r.status for r in node.api.requests][-1] == 200
    assert 401 not in [r.status for r in node.api.requests]


# -- --request-timeout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["node", "advertise"], ["node", "withdraw"], ["up"], ["down"]])
def test_request_timeout_that_is_no_duration_is_a_usage_error(node: Node, command: list[str]) -> None:
    code, _, err = node.run(*command, "--request-timeout", "5x")
    assert code == ExitCode.USAGE
    assert "--request-timeout '5x' is not a timeout" in err
    assert node.api.requests == []


def test_request_timeout_bounds_the_whole_request(node: Node) -> None:
    node.exec_kubeconfig()
    node.api.trickle_next(0.25, limit=20.0)  # every byte well within a read timeout
    code, _, err = node.advertise("--request-timeout", "1s")
    assert code == ExitCode.API
    assert error_line(err) == (
        f"gpunode: error: the Kubernetes API at {node.api.url}/api/v1/nodes/{NODE} did not send its whole "
        "answer within 1 s"
    )
    assert node.api.streamed < 200


def test_request_timeout_zero_means_no_timeout(node: Node) -> None:
    node.exec_kubeconfig()
    node.api.delay_next(0.5)
    code, _, _ = node.advertise("--request-timeout", "0")
    assert code == ExitCode.OK
