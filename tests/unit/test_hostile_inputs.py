"""Hostile input ends in a clear error with its exit code: never a traceback (70), a hang or a memory
blow-up. YAML bombs, deep nesting, duplicate keys, numbers of thousands of digits, garbage from programs,
/dev/zero and FIFOs where files are read, odd API answers (issue 23)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from gpunode import safeyaml
from gpunode.cli.main import main
from gpunode.errors import ConfigError, ExitCode
from gpunode.host import Host
from gpunode.safeyaml import YamlRefused, load_yaml, load_yaml_nodes


def bomb(levels: int, width: int = 9) -> str:
    """A 'billion laughs' document: each level a list of `width` aliases of the one before."""
    lines = ['a0: &a0 ["lol"' + ', "lol"' * (width - 1) + "]"]
    lines += [f"a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * width) + "]" for n in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.fixture(params=["libyaml", "python"])
def loader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both of PyYAML's parsers: libyaml's where PyYAML has it, the pure-Python one where it does not."""
    if request.param == "python":
        import yaml

        monkeypatch.setattr(safeyaml, "_loader_class", lambda: safeyaml._make_loader(yaml.SafeLoader))
    return str(request.param)


# -- the loader ------------------------------------------------------------------------------------------


def test_a_billion_laughs_is_refused_before_it_is_expanded(loader: str) -> None:
    text = bomb(9)
    assert len(text) < 2000
    with pytest.raises(YamlRefused) as err:
        load_yaml(text, "/x.yaml")
    assert err.value.exit_code == ExitCode.CONFIG
    assert "more than 100,000 values" in err.value.message and "/x.yaml, line " in err.value.message
    assert len(str(err.value)) < 500


def test_aliases_that_stay_small_are_read(loader: str) -> None:
    assert load_yaml(bomb(3), "/x.yaml")["a3"][0][0][0] == ["lol"] * 9
    merged = load_yaml("base: &b {a: 1, b: 2}\nmine:\n  <<: *b\n  a: 3\n", "/x.yaml")
    assert merged["mine"] == {"a": 3, "b": 2}  # a mapping's own key wins over a merged one: not a duplicate


def test_an_alias_inside_its_own_anchor_is_refused(loader: str) -> None:
    # PyYAML builds a list that contains itself: every later walk of it recurses without end.
    with pytest.raises(YamlRefused, match=r"the alias \*x is inside the node it names"):
        load_yaml("a: &x [1, *x]\n", "/x.yaml")


@pytest.mark.parametrize("kind", ["flow", "block"])
def test_deep_nesting_is_refused(loader: str, kind: str) -> None:
    depth = 5000 if kind == "flow" else 400  # a block mapping 5,000 deep is over the size limit
    text = "[" * depth + "]" * depth if kind == "flow" else "".join(" " * n + "a:\n" for n in range(depth))
    with pytest.raises(YamlRefused) as err:  # refused, not tried as another format
        load_yaml(text, "/x.yaml")
    assert err.value.exit_code == ExitCode.CONFIG and err.value.message.startswith("/x.yaml, line ")


def test_duplicate_keys_are_refused_with_both_lines(loader: str) -> None:
    with pytest.raises(YamlRefused) as err:
        load_yaml("a: 1\nb:\n  c: 2\na: 3\n", "/x.yaml")
    assert "the key 'a' is given twice (lines 1 and 4)" in err.value.message
    with pytest.raises(YamlRefused, match="the key 'c' is given twice"):
        load_yaml("b: {c: 1, c: 1}\n", "/x.yaml")
    with pytest.raises(YamlRefused, match="is given twice"):
        load_yaml('{"a": 1, "a": 2}', "/x.json")  # JSON read as YAML too


def test_a_number_python_cannot_hold_is_refused_without_quoting_it(loader: str) -> None:
    with pytest.raises(YamlRefused) as err:
        load_yaml("replicas: " + "1" * 4301 + "\n", "/x.yaml")
    assert "4300 digits" in err.value.message and "1111111111" not in str(err.value)
    with pytest.raises(YamlRefused, match="day is out of range"):
        load_yaml("when: 2024-02-30\n", "/x.yaml")


def test_a_large_document_is_refused_by_its_size_before_parsing(
    loader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def parse(*args: Any) -> None:
        raise AssertionError("parsed")

    monkeypatch.setattr(safeyaml, "_check_events", parse)
    text = "a: " + "x" * (4 * 2**20)
    with pytest.raises(YamlRefused) as err:
        load_yaml(text, "/x.yaml")
    assert "is 4194307 bytes, more than the 1 MiB gpunode reads as YAML" in err.value.message
    with pytest.raises(YamlRefused, match="more than the 1 MiB"):
        load_yaml(text.encode(), "/x.yaml")


def test_bytes_and_syntax_errors(loader: str) -> None:
    assert load_yaml(b"\xef\xbb\xbfa: 1\n", "/x.yaml") == {"a": 1}
    with pytest.raises(ConfigError, match=r"/x.yaml is not UTF-8 text \(invalid start byte at byte 3\)"):
        load_yaml(b"a: \xff\n", "/x.yaml")
    with pytest.raises(ConfigError) as err:
        load_yaml("token: secret-token-value\nb: [\n", "/x.yaml")
    assert not isinstance(err.value, YamlRefused)
    assert "/x.yaml is not valid YAML: " in err.value.message and "(line 3, column 1)" in err.value.message
    assert "secret" not in str(err.value)  # no line quoted


def test_nodes_come_with_the_data(loader: str) -> None:
    data, node = load_yaml_nodes("x: &d {a: 1}\ny: {<<: *d, b: 2}\n", "/x.yaml")
    assert data["y"] == {"a": 1, "b": 2}
    # The node tree is the document as written: the merge key is still there (constructing flattens it).
    assert node.value[1][1].value[0][0].tag == "tag:yaml.org,2002:merge"


def test_messages_never_echo_a_huge_value() -> None:
    assert safeyaml.shorten("x" * 10_000) == "x" * 80 + "... (10000 characters)"
    with pytest.raises(YamlRefused) as err:
        load_yaml(f"{'k' * 1000}: 1\n{'k' * 1000}: 2\n", "/x.yaml")
    assert len(str(err.value)) < 500


# -- NVIDIA's config: import-config, plugin run --config --------------------------------------------------


def nvidia_file(tmp_path: Path, text: str) -> tuple[Host, str]:
    (tmp_path / "nvidia.yaml").write_text(text)
    return Host(root=tmp_path, env={}), "/nvidia.yaml"


@pytest.mark.parametrize(
    "argv",
    [
        ["plugin", "import-config", "/nvidia.yaml"],
        ["plugin", "run", "--config", "/nvidia.yaml", "--show-config"],
    ],
)
def test_a_yaml_bomb_in_nvidias_config_is_refused_in_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    # The bomb's value where NVIDIA's reader echoes a value it refuses (a device-list strategy): before the
    # loader's limits, the message alone held every expanded "lol" (6 levels: 4 MB; 9 levels: no end).
    text = bomb(6) + "version: v1\nflags:\n  plugin:\n    deviceListStrategy: *a6\n"
    host, _ = nvidia_file(tmp_path, text)
    assert main(argv, host=host) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "more than 100,000 values" in err and len(err) < 1000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # NVIDIA's reader keeps the last silently: a typo'd second block turned sharing off unseen.
        ("version: v1\nflags:\n  migStrategy: none\n  migStrategy: mixed\n", "'migStrategy' is given twice"),
        # Two sections: the walk of the first read the keys of the second (a KeyError before the loader).
        (
            "version: v1\nflags:\n  plugin:\n    passDeviceSpecs: true\nflags:\n  migStrategy: none\n",
            "'flags' is given twice (lines 2 and 5)",
        ),
    ],
)
def test_duplicate_keys_in_nvidias_config_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    host, path = nvidia_file(tmp_path, text)
    for argv in (["plugin", "import-config", path], ["plugin", "run", "--config", path, "--show-config"]):
        assert main(argv, host=host) == ExitCode.CONFIG
        assert expected in capsys.readouterr().err


def test_a_deep_nvidia_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, path = nvidia_file(tmp_path, "version: v1\nflags: " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["plugin", "import-config", path], host=host) == ExitCode.CONFIG
    assert "/nvidia.yaml, line 2" in capsys.readouterr().err


def test_a_huge_number_in_nvidias_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: "
    host, path = nvidia_file(tmp_path, text + "9" * 4301 + "\n")
    assert main(["plugin", "import-config", path], host=host) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "holds a value gpunode cannot read" in err and "9999999999" not in err


def test_a_kubeconfig_bomb_or_duplicate_is_refused(tmp_path: Path) -> None:
    from gpunode.kube.credentials import _parse_yaml

    host = Host(root=tmp_path, env={})
    (tmp_path / "kubeconfig").write_text(bomb(9) + "clusters: []\n")
    with pytest.raises(YamlRefused, match=r"^kubeconfig /kubeconfig, line \d+: more than 100,000 values"):
        _parse_yaml(host, "/kubeconfig")
    (tmp_path / "kubeconfig").write_text("users: []\nusers:\n- name: a\n")
    with pytest.raises(YamlRefused, match="the key 'users' is given twice"):
        _parse_yaml(host, "/kubeconfig")


# -- files that never end or never open: Host.read_bytes ---------------------------------------------------


def special_files(tmp_path: Path) -> dict[str, str]:
    """Host paths under tmp_path of a FIFO with no writer (open would wait for one) and of /dev/zero (a
    read never ends): made with mkfifo and mknod, as root (the test run is)."""
    (tmp_path / "dev").mkdir(exist_ok=True)
    os.mkfifo(tmp_path / "dev" / "fifo")
    os.mknod(tmp_path / "dev" / "zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    return {"fifo": "/dev/fifo", "zero": "/dev/zero"}


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_read_bytes_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    path = special_files(tmp_path)[kind]
    with pytest.raises(ConfigError, match=f"^{path} is not a regular file where a file was expected"):
        Host(root=tmp_path).read_bytes(path)


def test_read_bytes_refuses_a_file_over_the_limit(tmp_path: Path) -> None:
    from gpunode.host import MAX_READ

    with (tmp_path / "big").open("wb") as fh:
        fh.truncate(MAX_READ + 1)  # sparse: no disk used
    with pytest.raises(ConfigError, match=r"^/big is larger than 8 MiB"):
        Host(root=tmp_path).read_bytes("/big")
    (tmp_path / "small").write_bytes(b"\xff\x00")
    assert Host(root=tmp_path).read_bytes("/small") == b"\xff\x00"
    assert Host(root=tmp_path).read_bytes("/missing") is None


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_token_file_that_never_ends_is_refused(tmp_path: Path, kind: str) -> None:
    from gpunode.kube import resolve_credentials

    path = special_files(tmp_path)[kind]
    config = tmp_path / "root" / ".kube" / "config"
    config.parent.mkdir(parents=True)
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters:\n- name: k\n  cluster: {server: 'https://10.0.0.1:6443'}\n"
        f"users:\n- name: u\n  user: {{tokenFile: {path}}}\n"
        "contexts:\n- name: c\n  context: {cluster: k, user: u}\n"
    )
    host = Host(root=tmp_path, env={"HOME": "/root"}, euid=0)
    with pytest.raises(ConfigError, match="is not a regular file"):
        resolve_credentials(host)


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_an_ld_cache_that_never_ends_is_taken_as_no_cache(tmp_path: Path, kind: str) -> None:
    from gpunode.cdi.hostfacts import LD_CACHE, Roots, find_libraries

    path = special_files(tmp_path)[kind]
    (tmp_path / "etc").mkdir()
    os.symlink(path, tmp_path / LD_CACHE.lstrip("/"))  # a link inside the root: /dev/... of the root
    lib = tmp_path / "usr" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.550.54").write_bytes(b"")
    found = find_libraries(Host(root=tmp_path), Roots(), "550.54", loaded_nvml=["/usr/lib/libnvidia-ml.so.1"])
    assert found == ("/usr/lib/libcuda.so.550.54",)  # found next to NVML's library, as with no cache


# -- numbers of thousands of digits, digits int() refuses, JSON nested thousands deep ----------------------

HUGE = "9" * 4301  # one past int()'s 4,300-digit limit: a ValueError, not a number


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("GPUNODE_REPLICAS", HUGE, "is not a whole number of at least 1"),
        ("GPUNODE_REPLICAS", "²", "'²' is not a whole number"),  # isdigit() says yes, int() says no
        ("GPUNODE_TIME_SLICING_RESOURCES", "[" * 5000 + "]" * 5000, "JSON nested too deeply"),
        ("GPUNODE_TIME_SLICING_RESOURCES", f'[{{"name": "gpu", "replicas": {HUGE}}}]', "not a JSON list"),
        ("GPUNODE_METRICS_ADDRESS", "127.0.0.1:²", "is not HOST:PORT"),
    ],
)
def test_hostile_plugin_variables(
    *,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    expected: str,
) -> None:
    monkeypatch.setenv(variable, value)  # the plugin's settings come from the process's environment
    assert main(["plugin", "run", "--show-config"], host=Host(root=tmp_path, env={})) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert expected in err and len(err) < 600  # the value is never echoed whole


@pytest.mark.parametrize("argv", [["--replicas", HUGE], [f"--replicas={HUGE}"]])
def test_a_huge_replicas_flag_is_a_usage_error_quoted_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    from gpunode.plugin.argv import parse

    assert parse(argv) is None  # the fast parser leaves it to click, which words the error
    assert main(["plugin", "run", *argv, "--show-config"], host=Host(root=tmp_path, env={})) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "(4301 characters) is not a valid integer" in err and len(err) < 400


def test_version_parsers_take_garbage_as_unknown() -> None:
    from gpunode.runtimes.containerd import parse_containerd_version
    from gpunode.runtimes.docker import parse_dockerd_version
    from gpunode.runtimes.k3s import parse_release

    garbage = "\ufffd\ufffd\x00\ufffd"  # what undecodable bytes become when decoded with errors="replace"
    for text in (f"containerd x v{HUGE}.1.2", f"containerd {garbage}", "containerd x v\u0661.\u0667.0", ""):
        assert parse_containerd_version(text) is None
    assert parse_containerd_version(f"containerd {garbage} v1.7.24 {garbage}") == (1, 7)
    for text in (
        f"k3s version v{HUGE}.1.2+k3s1",
        f"k3s {garbage}",
        "k3s version v\u0661.\u0663\u0663.\u0661",
    ):
        assert parse_release(text) is None
    assert parse_release(f"k3s version v1.33.1+k3s1 ({garbage})") == (1, 33, 1)
    assert parse_dockerd_version(f"Docker version {HUGE}.1, build x") is None
    assert parse_dockerd_version(f"Docker version 28.5.2{garbage}, build x") == (28, 5)


def test_mps_pid_files_with_garbage_are_no_pid() -> None:
    from gpunode.plugin.mps import _pid

    assert [_pid(t) for t in ("1234\n", "²", HUGE, "", "-1", "12 34")] == [1234, None, None, None, None, None]


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"resources": [' + HUGE + "]}", "\ufffd{"])
def test_json_state_files_with_hostile_content_are_not_a_crash(tmp_path: Path, text: str) -> None:
    from gpunode import kubelet, paths
    from gpunode.plugin import statusfile
    from gpunode.runtimes import records

    host = Host(root=tmp_path, env={})
    for path in (paths.PLUGIN_STATUS_FILE, records.RECORDS, kubelet.KUBELET_CHECKPOINT):
        (tmp_path / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path.lstrip("/")).write_text(text)
    with pytest.raises(ConfigError, match="is damaged"):
        records.load(host)
    assert kubelet.registered_resources(host) == []
    found = statusfile.find(host, flag=paths.PLUGIN_STATUS_FILE, env={}, unit="u", unit_properties={})
    assert found.problem is not None and len(found.problem) < 400
