"""configure-runtime's editors, apply and revert, against realistic files under a temp root."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from gpunode.errors import CommandFailed, ConfigError, NotFound, UsageError
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import containerd, crio, records
from gpunode.runtimes.configure import apply, choose_runtime, plan_configure, plan_revert
from gpunode.runtimes.plan import ConfigureOptions, RuntimePlan
from tests import tomlread

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"
CONTAINERD_1_7 = (
    "containerd github.com/containerd/containerd v1.7.24 88bf19b2105c8b17560993bee28a01ddc2f97182\n"
)
CONTAINERD_2_0 = (
    "containerd github.com/containerd/containerd/v2 v2.0.0 207ad711eabd375a01713109a8a197d197ff6542\n"
)
CONTAINERD_2_1 = (
    "containerd github.com/containerd/containerd/v2 v2.1.1 cb1076646aa3740577fafbf3d914198b7fe8e3f7\n"
)
NVIDIA = "/usr/bin/nvidia-container-runtime"
CRI = ("plugins", "io.containerd.grpc.v1.cri")


def put(root: Path, host_path: str, text: str) -> Path:
    target = root / host_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def make_host(root: Path, version: str | None = CONTAINERD_1_6) -> tuple[Host, ScriptedRunner]:
    runner = ScriptedRunner()
    if version is not None:
        runner.answer(["containerd", "--version"], version)
    return Host(root=root, runner=runner), runner


def configure(host: Host, runtime: str, **options: Any) -> RuntimePlan:
    plan = plan_configure(host, runtime, ConfigureOptions(**options))
    apply(host, plan, restart=False)
    return plan


def revert(host: Host, runtime: str, **options: Any) -> RuntimePlan:
    plan = plan_revert(host, runtime, ConfigureOptions(**options))
    apply(host, plan, restart=False)
    return plan


def toml_at(path: Path) -> dict[str, Any]:
    return tomlread.loads(path.read_text())


def dig(doc: Any, *keys: str) -> Any:
    for key in keys:
        doc = doc[key]
    return doc


def lines_kept(before: str, after: str) -> None:
    """Every line of the user's file is still there, in the same order (gpunode only adds and replaces
    the values of keys it owns)."""
    remaining = iter(after.splitlines())
    for line in before.splitlines():
        if "default_runtime_name" in line or "default-runtime" in line:
            continue
        assert any(candidate == line for candidate in remaining), f"lost or moved: {line!r}"


# -- containerd ---------------------------------------------------------------------------------------


def test_stock_default_config_gets_a_runc_copy_with_systemd_cgroup(tmp_path: Path) -> None:
    original = fixture("containerd/default-v2.toml").replace("SystemdCgroup = false", "SystemdCgroup = true")
    path = put(tmp_path, "/etc/containerd/config.toml", original)
    host, _ = make_host(tmp_path)
    configure(host, "containerd", set_as_default=True)
    doc = toml_at(path)
    containerd_table = dig(doc, *CRI, "containerd")
    nvidia = containerd_table["runtimes"]["nvidia"]
    runc = containerd_table["runtimes"]["runc"]
    assert containerd_table["default_runtime_name"] == "nvidia"
    assert nvidia["runtime_type"] == "io.containerd.runc.v2"
    assert nvidia["options"] == {**runc["options"], "BinaryName": NVIDIA}
    assert nvidia["options"]["SystemdCgroup"] is True
    # Every key but the v1 shim's own (runtime_engine, runtime_root: refused on runc v2 by 1.x,
    # unknown to 2.x).
    v1_only = ("options", "runtime_engine", "runtime_root")
    assert {k: v for k, v in nvidia.items() if k != "options"} == {
        k: v for k, v in runc.items() if k not in v1_only
    }
    assert "runtime_engine" in runc and "runtime_engine" not in nvidia
    text = path.read_text()
    lines_kept(original, text)
    # The new table looks like its neighbour: same header indentation, blank line before the next table.
    assert '\n        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n' in text
    assert (
        '            SystemdCgroup = true\n\n      [plugins."io.containerd.grpc.v1.cri".containerd.untrusted'
        in text
    )
    state = containerd.read_state(host, "/etc/containerd/config.toml")
    assert state.nvidia_runtime == "nvidia" and state.nvidia_is_default and not state.problems


def test_second_run_is_already_configured_and_does_not_touch_the_file(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/default-v2.toml"))
    host, _ = make_host(tmp_path)
    configure(host, "containerd", set_as_default=True)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    plan = plan_configure(host, "containerd", ConfigureOptions(set_as_default=True))
    assert not plan.pending
    outcome = apply(host, plan, restart=False)
    assert not outcome.changed
    assert path.stat().st_mtime_ns == 1_000_000_000


def test_comments_quoting_and_odd_formatting_survive(tmp_path: Path) -> None:
    original = (
        "# Managed by hand. Do not lose this comment.\n"
        "version = 2   # trailing comment\n"
        "\n"
        "[plugins.'io.containerd.grpc.v1.cri']\n"
        "    sandbox_image = 'registry.local/pause:3.9'   # literal string\n"
        "\n\n"
        '  [plugins."io.containerd.grpc.v1.cri".containerd]\n'
        '  snapshotter="overlayfs"\n'
        '  default_runtime_name = "runc" # the default\n'
        "\n"
        '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        '      runtime_type = "io.containerd.runc.v2"\n'
        '      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
        "        SystemdCgroup = true\n"
        "\n"
        "[metrics]\n"
        '  address = "127.0.0.1:1338"\n'
    )
    path = put(tmp_path, "/etc/containerd/config.toml", original)
    host, _ = make_host(tmp_path)
    configure(host, "containerd", set_as_default=True)
    text = path.read_text()
    lines_kept(original, text)
    assert '  default_runtime_name = "nvidia" # the default\n' in text
    doc = tomlread.loads(text)
    assert dig(doc, *CRI, "containerd", "runtimes", "nvidia", "options") == {
        "SystemdCgroup": True,
        "BinaryName": NVIDIA,
    }
    assert doc["metrics"] == {"address": "127.0.0.1:1338"}


def test_existing_nvidia_runtime_without_systemd_cgroup_is_repaired(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/v2-nvidia-no-systemdcgroup.toml"))
    host, _ = make_host(tmp_path)
    plan = configure(host, "containerd")
    options = dig(toml_at(path), *CRI, "containerd", "runtimes", "nvidia", "options")
    assert options == {"BinaryName": NVIDIA, "SystemdCgroup": True}
    assert any("SystemdCgroup = true" in m for m in plan.messages)
    assert dig(toml_at(path), *CRI, "containerd", "default_runtime_name") == "runc"  # not asked to change


def test_version_1_file_uses_the_cri_plugin_table(tmp_path: Path) -> None:
    original = '[plugins.cri.containerd]\n  snapshotter = "overlayfs"\n'
    path = put(tmp_path, "/etc/containerd/config.toml", original)
    host, _ = make_host(tmp_path)
    configure(host, "containerd", set_as_default=True)
    doc = toml_at(path)
    assert "version" not in doc  # still version 1
    runtimes = doc["plugins"]["cri"]["containerd"]["runtimes"]
    assert runtimes["nvidia"]["options"]["BinaryName"] == NVIDIA
    assert runtimes["runc"] == {"runtime_type": "io.containerd.runc.v2"}  # built-in runc kept
    assert doc["plugins"]["cri"]["containerd"]["default_runtime_name"] == "nvidia"


def test_version_1_with_cdi_is_refused(tmp_path: Path) -> None:
    put(tmp_path, "/etc/containerd/config.toml", '[plugins.cri]\n  sandbox_image = "x"\n')
    host, _ = make_host(tmp_path)
    with pytest.raises(ConfigError, match="version 2"):
        plan_configure(host, "containerd", ConfigureOptions(cdi=True))


def test_version_3_with_containerd_2(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/v3-nvidia.toml"))
    host, _ = make_host(tmp_path, CONTAINERD_2_0)
    configure(host, "containerd", set_as_default=True, cdi=True)
    table = dig(toml_at(path), "plugins", "io.containerd.cri.v1.runtime")
    assert table["containerd"]["default_runtime_name"] == "nvidia"
    assert table["enable_cdi"] is True
    assert table["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == NVIDIA


def test_version_3_file_with_containerd_1_is_refused(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/v3-nvidia.toml"))
    before = path.read_bytes()
    host, _ = make_host(tmp_path, CONTAINERD_1_6)
    with pytest.raises(ConfigError, match=r"version 3 configuration, but containerd 1\.6"):
        plan_configure(host, "containerd", ConfigureOptions())
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("content", "installed", "version", "cri"),
    [
        (None, CONTAINERD_1_6, 2, "io.containerd.grpc.v1.cri"),
        ("", CONTAINERD_1_7, 2, "io.containerd.grpc.v1.cri"),
        ("# only a comment\n\n", CONTAINERD_1_6, 2, "io.containerd.grpc.v1.cri"),
        (None, CONTAINERD_2_0, 3, "io.containerd.cri.v1.runtime"),
    ],
)
def test_missing_or_empty_file_takes_the_installed_version(
    tmp_path: Path, content: str | None, installed: str, version: int, cri: str
) -> None:
    if content is not None:
        put(tmp_path, "/etc/containerd/config.toml", content)
    host, _ = make_host(tmp_path, installed)
    configure(host, "containerd", set_as_default=True)
    text = (tmp_path / "etc/containerd/config.toml").read_text()
    doc = tomlread.loads(text)
    assert doc["version"] == version
    runtimes = doc["plugins"][cri]["containerd"]["runtimes"]
    assert set(runtimes) == {"runc", "nvidia"}  # a table with only nvidia would lose the built-in runc
    if content:
        assert text.startswith(content.rstrip("\n"))


def test_enable_cdi_on_containerd_1_6_is_written_with_a_warning(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/default-v2.toml"))
    host, _ = make_host(tmp_path, CONTAINERD_1_6)
    plan = configure(host, "containerd", cdi=True)
    assert dig(toml_at(path), *CRI, "enable_cdi") is True
    assert any("CDI needs containerd 1.7" in m for m in plan.messages)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("malformed", 'version = 2\n[plugins\nfoo = "x"\n', r"not valid TOML: .*line 2"),
        ("unknown version", "version = 7\n", "unknown config version 7"),
        ("cri disabled", 'disabled_plugins = ["cri"]\n', "disables the CRI plugin"),
        ("not a table", 'version = 2\nplugins = "x"\n', "must be a table"),
    ],
)
def test_bad_containerd_files_are_refused_and_untouched(
    tmp_path: Path, name: str, text: str, match: str
) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", text)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    host, _ = make_host(tmp_path)
    with pytest.raises(ConfigError, match=match):
        configure(host, "containerd", set_as_default=True)
    assert path.read_text() == text and path.stat().st_mtime_ns == 1_000_000_000
    assert not (tmp_path / "var/lib/gpunode/backups").exists()


def test_a_directory_as_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "etc/containerd/config.toml").mkdir(parents=True)
    host, _ = make_host(tmp_path)
    with pytest.raises(ConfigError, match="is a directory"):
        plan_configure(host, "containerd", ConfigureOptions())


def test_symlinked_config_is_written_through_to_its_target(tmp_path: Path) -> None:
    target = put(tmp_path, "/opt/conf/containerd.toml", fixture("containerd/default-v2.toml"))
    (tmp_path / "etc/containerd").mkdir(parents=True)
    (tmp_path / "etc/containerd/config.toml").symlink_to("/opt/conf/containerd.toml")
    target.chmod(0o600)
    host, _ = make_host(tmp_path)
    configure(host, "containerd")
    assert (tmp_path / "etc/containerd/config.toml").is_symlink()
    assert "runtimes.nvidia]" in target.read_text()
    assert target.stat().st_mode & 0o777 == 0o600


def test_an_import_that_replaces_the_cri_table_makes_in_place_edits_useless(tmp_path: Path) -> None:
    put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/imports-main.toml"))
    put(tmp_path, "/etc/containerd/conf.d/50-cri.toml", '[plugins."io.containerd.grpc.v1.cri"]\n  x = 1\n')
    host, _ = make_host(tmp_path)
    with pytest.raises(ConfigError, match="--drop-in"):
        plan_configure(host, "containerd", ConfigureOptions())


def test_drop_in_carries_the_complete_cri_table_and_an_absolute_import(tmp_path: Path) -> None:
    main = put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/default-v2.toml"))
    main.write_text(main.read_text().replace("SystemdCgroup = false", "SystemdCgroup = true"))
    host, _ = make_host(tmp_path)
    configure(host, "containerd", set_as_default=True, drop_in="/etc/containerd/conf.d/99-nvidia.toml")
    main_doc = toml_at(main)
    assert main_doc["imports"] == ["/etc/containerd/conf.d/99-nvidia.toml"]
    assert "nvidia" not in dig(main_doc, *CRI, "containerd", "runtimes")
    drop = toml_at(tmp_path / "etc/containerd/conf.d/99-nvidia.toml")
    assert drop["version"] == 2
    cri = dig(drop, *CRI)
    main_cri = dig(main_doc, *CRI)
    assert set(main_cri) <= set(cri)  # nothing the import would reset to defaults
    assert cri["sandbox_image"] == main_cri["sandbox_image"]
    assert cri["containerd"]["default_runtime_name"] == "nvidia"
    assert cri["containerd"]["runtimes"]["runc"] == main_cri["containerd"]["runtimes"]["runc"]
    assert cri["containerd"]["runtimes"]["nvidia"]["options"]["SystemdCgroup"] is True
    # What containerd ends up with (imports merged the way containerd < 2.1 merges them):
    state = containerd.read_state(host, "/etc/containerd/config.toml")
    assert state.nvidia_is_default and not state.problems
    assert state.files == ("/etc/containerd/config.toml", "/etc/containerd/conf.d/99-nvidia.toml")


def test_drop_in_with_containerd_2_1_holds_only_the_runtime(tmp_path: Path) -> None:
    put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/v3-nvidia.toml"))
    host, _ = make_host(tmp_path, CONTAINERD_2_1)
    configure(host, "containerd", drop_in="/etc/containerd/conf.d/99-nvidia.toml", set_as_default=True)
    cri = dig(
        toml_at(tmp_path / "etc/containerd/conf.d/99-nvidia.toml"), "plugins", "io.containerd.cri.v1.runtime"
    )
    assert set(cri) == {"containerd"}
    assert cri["containerd"]["default_runtime_name"] == "nvidia"


def test_drop_in_already_matched_by_an_import_glob_is_not_added_twice(tmp_path: Path) -> None:
    main = put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/imports-main.toml"))
    host, _ = make_host(tmp_path)
    configure(host, "containerd", drop_in="/etc/containerd/conf.d/99-nvidia.toml")
    assert toml_at(main)["imports"] == ["/etc/containerd/conf.d/*.toml"]
    assert (tmp_path / "etc/containerd/conf.d/99-nvidia.toml").is_file()


def test_relative_drop_in_is_a_usage_error(tmp_path: Path) -> None:
    host, _ = make_host(tmp_path)
    with pytest.raises(UsageError, match="absolute"):
        plan_configure(host, "containerd", ConfigureOptions(drop_in="conf.d/99-nvidia.toml"))


def test_k3s_generated_config_is_never_frozen_into_a_template(tmp_path: Path) -> None:
    # The generated file already has k3s's own nvidia runtime (k3s found the binary): nothing to add, and
    # no copy of config.toml as config.toml.tmpl (k3s upgrades would stop reaching containerd).
    generated = fixture("containerd/k3s-config.toml")
    put(tmp_path, containerd.K3S_CONFIG, generated)
    host, _ = make_host(tmp_path, None)
    plan = configure(host, "containerd")
    assert plan.flavour == "k3s" and plan.unit == "k3s.service" and not plan.pending
    assert any("already adds" in m for m in plan.messages)
    assert not (tmp_path / containerd.K3S_TEMPLATE.lstrip("/")).exists()
    assert (tmp_path / containerd.K3S_CONFIG.lstrip("/")).read_text() == generated
    with pytest.raises(ConfigError, match="default runtime"):  # k3s's default-runtime is the way that lasts
        plan_configure(host, "containerd", ConfigureOptions(set_as_default=True))


def test_k3s_go_template_is_refused_untouched(tmp_path: Path) -> None:
    put(tmp_path, containerd.K3S_CONFIG, fixture("containerd/k3s-config.toml"))
    template = put(tmp_path, containerd.K3S_TEMPLATE, fixture("containerd/k3s-config.toml.tmpl"))
    host, _ = make_host(tmp_path, None)
    with pytest.raises(ConfigError, match="Go template"):
        plan_configure(host, "containerd", ConfigureOptions())
    assert template.read_text() == fixture("containerd/k3s-config.toml.tmpl")


def test_microk8s_template_is_edited(tmp_path: Path) -> None:
    path = put(tmp_path, containerd.MICROK8S_TEMPLATE, fixture("containerd/default-v2.toml"))
    host, _ = make_host(tmp_path, None)
    plan = configure(host, "containerd")
    assert plan.flavour == "microk8s"
    assert "nvidia" in dig(toml_at(path), *CRI, "containerd", "runtimes")


# -- docker -------------------------------------------------------------------------------------------


def test_docker_missing_file_is_created(tmp_path: Path) -> None:
    host, _ = make_host(tmp_path)
    configure(host, "docker", set_as_default=True)
    text = (tmp_path / "etc/docker/daemon.json").read_text()
    assert json.loads(text) == {
        "runtimes": {"nvidia": {"path": NVIDIA}},
        "default-runtime": "nvidia",
    }
    assert text.startswith('{\n    "runtimes"') and text.endswith("}\n")


def test_docker_empty_file_becomes_valid(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/docker/daemon.json", "")
    host, _ = make_host(tmp_path)
    plan = configure(host, "docker")
    assert json.loads(path.read_text()) == {"runtimes": {"nvidia": {"path": NVIDIA}}}
    assert any("empty" in m for m in plan.messages)


def test_docker_keeps_other_keys_features_and_indentation(tmp_path: Path) -> None:
    original = (
        '{\n\t"log-driver": "json-file",\n\t"log-opts": {"max-size": "10m"},\n'
        '\t"features": {"buildkit": true},\n\t"runtimes": {"kata": {"path": "/usr/bin/kata-runtime"}},\n'
        '\t"default-runtime": "kata"\n}\n'
    )
    path = put(tmp_path, "/etc/docker/daemon.json", original)
    host, _ = make_host(tmp_path)
    configure(host, "docker", cdi=True)
    text = path.read_text()
    doc = json.loads(text)
    assert list(doc) == ["log-driver", "log-opts", "features", "runtimes", "default-runtime"]
    assert doc["features"] == {"buildkit": True, "cdi": True}  # merged, not replaced
    assert doc["default-runtime"] == "kata"  # not asked to change it
    assert doc["log-opts"] == {"max-size": "10m"}
    assert doc["runtimes"]["kata"] == {"path": "/usr/bin/kata-runtime"}
    assert '\n\t"log-driver"' in text  # tabs, as the file had


def test_docker_existing_entry_keeps_its_args(tmp_path: Path) -> None:
    original = '{"runtimes": {"nvidia": {"path": "nvidia-container-runtime", "args": ["--debug"]}}}'
    path = put(tmp_path, "/etc/docker/daemon.json", original)
    host, _ = make_host(tmp_path)
    configure(host, "docker", set_as_default=True)
    doc = json.loads(path.read_text())
    assert doc["runtimes"]["nvidia"] == {"path": NVIDIA, "args": ["--debug"]}
    assert "\n" not in path.read_text().rstrip("\n")  # a one-line file stays on one line


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"runtimes": {"nvidia": {"path": "x"}},\n}', r"not valid JSON: .* at line 2"),
        ("[1, 2]", "JSON object"),
        ('{"runtimes": {"runc": {"path": "/usr/bin/runc"}}}', 'named "runc"'),
        ('{"default-runtime": "kata"}', 'default-runtime "kata" is not defined'),
        ('{"runtimes": "x"}', '"runtimes" must be an object'),
        ('{"features": [1]}', '"features" must be an object'),
        ('{"debug": true, "log-opt": {"max-size": "1m"}}', "dockerd does not know: log-opt"),
    ],
)
def test_docker_bad_files_are_refused_and_untouched(tmp_path: Path, text: str, match: str) -> None:
    path = put(tmp_path, "/etc/docker/daemon.json", text)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    host, _ = make_host(tmp_path)
    with pytest.raises(ConfigError, match=match):
        configure(host, "docker", set_as_default=True)
    assert path.read_text() == text and path.stat().st_mtime_ns == 1_000_000_000


def test_docker_undefined_default_that_gpunode_adds_is_accepted(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/docker/daemon.json", '{"default-runtime": "nvidia"}\n')
    host, _ = make_host(tmp_path)
    configure(host, "docker")
    assert json.loads(path.read_text())["runtimes"]["nvidia"]["path"] == NVIDIA


def test_docker_runtime_named_runc_is_a_usage_error(tmp_path: Path) -> None:
    host, _ = make_host(tmp_path)
    with pytest.raises(UsageError, match="reserves"):
        plan_configure(host, "docker", ConfigureOptions(runtime_name="runc"))


# -- CRI-O ----------------------------------------------------------------------------------------------


def crio_node(root: Path) -> None:
    put(root, crio.CRIO_CONF, fixture("crio/crio.conf"))
    put(root, "/etc/crio/crio.conf.d/10-crio.conf", fixture("crio/crio.conf.d/10-crio.conf"))


def test_crio_drop_in_copies_the_default_runtime(tmp_path: Path) -> None:
    crio_node(tmp_path)
    host, _ = make_host(tmp_path)
    plan = configure(host, "crio", set_as_default=True)
    path = tmp_path / "etc/crio/crio.conf.d/99-nvidia.toml"
    text = path.read_text()
    assert text.startswith("# Written by `gpunode configure-runtime crio`")
    doc = tomlread.loads(text)
    assert doc["crio"]["runtime"]["default_runtime"] == "nvidia"
    nvidia = doc["crio"]["runtime"]["runtimes"]["nvidia"]
    assert nvidia["runtime_path"] == NVIDIA and nvidia["runtime_type"] == "oci"
    assert nvidia["runtime_root"] == "/run/crun" and nvidia["monitor_path"] == "/usr/libexec/crio/conmon"
    state = crio.read_state(host)
    assert state.nvidia_is_default and not state.problems
    # No backup or record inside crio.conf.d: CRI-O would apply it.
    assert sorted(os.listdir(tmp_path / "etc/crio/crio.conf.d")) == ["10-crio.conf", "99-nvidia.toml"]
    assert plan.unit == "crio.service"
    revert(host, "crio")
    assert not path.exists()


def test_crio_existing_drop_in_is_edited_and_its_original_kept_outside(tmp_path: Path) -> None:
    crio_node(tmp_path)
    existing = fixture("crio/crio.conf.d/99-nvidia.toml")
    path = put(tmp_path, "/etc/crio/crio.conf.d/99-nvidia.toml", existing)
    host, _ = make_host(tmp_path)
    configure(host, "crio", runtime_path="/opt/nvidia/nvidia-container-runtime")
    doc = tomlread.loads(path.read_text())
    assert (
        doc["crio"]["runtime"]["runtimes"]["nvidia"]["runtime_path"] == "/opt/nvidia/nvidia-container-runtime"
    )
    assert (tmp_path / "var/lib/gpunode/backups/etc/crio/crio.conf.d/99-nvidia.toml").read_text() == existing
    assert sorted(os.listdir(path.parent)) == ["10-crio.conf", "99-nvidia.toml"]
    revert(host, "crio")
    assert path.read_text() == existing


def test_crio_later_drop_in_overriding_the_default_is_reported(tmp_path: Path) -> None:
    crio_node(tmp_path)
    put(tmp_path, "/etc/crio/crio.conf.d/99-zz-local.conf", '[crio.runtime]\ndefault_runtime = "crun"\n')
    host, _ = make_host(tmp_path)
    with pytest.raises(ConfigError, match=r"99-zz-local\.conf is read after"):
        plan_configure(host, "crio", ConfigureOptions(set_as_default=True))


def test_crio_in_place_edits_crio_conf(tmp_path: Path) -> None:
    path = put(tmp_path, crio.CRIO_CONF, fixture("crio/crio.conf"))
    host, _ = make_host(tmp_path)
    configure(host, "crio", in_place=True)
    assert tomlread.loads(path.read_text())["crio"]["runtime"]["runtimes"]["nvidia"]["runtime_path"] == NVIDIA
    assert not (tmp_path / "etc/crio/crio.conf.d/99-nvidia.toml").exists()


# -- revert -------------------------------------------------------------------------------------------


def test_revert_is_byte_identical(tmp_path: Path) -> None:
    original = fixture("containerd/default-v2.toml")
    path = put(tmp_path, "/etc/containerd/config.toml", original)
    path.chmod(0o640)
    host, _ = make_host(tmp_path)
    configure(host, "containerd", set_as_default=True)
    configure(
        host, "containerd", set_as_default=True, cdi=True
    )  # a second change: the backup stays the first
    revert(host, "containerd")
    assert path.read_text() == original
    assert path.stat().st_mode & 0o777 == 0o640
    # No empty directory is left behind where the backup was, backups/ included.
    assert not (tmp_path / "var/lib/gpunode/backups").exists()
    assert records.load(host).files == {}


def test_revert_keeps_the_backup_directories_still_in_use(tmp_path: Path) -> None:
    # Another backup (here the plugin's unit, kept in the same tree) keeps the directories on its path, and
    # no directory outside backups/ is touched, empty or not.
    put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/default-v2.toml"))
    other = put(tmp_path, "/var/lib/gpunode/backups/etc/systemd/system/unit.service", "[Unit]\n")
    (tmp_path / "var/lib/gpunode/empty-by-someone").mkdir()
    host, _ = make_host(tmp_path)
    configure(host, "containerd", set_as_default=True)
    assert (tmp_path / "var/lib/gpunode/backups/etc/containerd/config.toml").exists()
    revert(host, "containerd")
    assert not (tmp_path / "var/lib/gpunode/backups/etc/containerd").exists()
    assert other.read_text() == "[Unit]\n"
    assert (tmp_path / "var/lib/gpunode/empty-by-someone").is_dir()


def test_revert_after_user_edits_removes_only_what_gpunode_added(tmp_path: Path) -> None:
    original = (
        '{\n  "log-driver": "journald",\n  "default-runtime": "kata",\n'
        '  "runtimes": {"kata": {"path": "/k"}}\n}\n'
    )
    path = put(tmp_path, "/etc/docker/daemon.json", original)
    host, _ = make_host(tmp_path)
    configure(host, "docker", set_as_default=True, cdi=True)
    doc = json.loads(path.read_text())
    doc["debug"] = True  # the user's own change after gpunode's
    doc["runtimes"]["nvidia"]["args"] = ["--log"]  # tuning gpunode's entry does not keep it
    path.write_text(json.dumps(doc, indent=2) + "\n")
    plan = revert(host, "docker")
    assert json.loads(path.read_text()) == {
        "log-driver": "journald",
        "default-runtime": "kata",  # the previous default is back
        "runtimes": {"kata": {"path": "/k"}},
        "debug": True,
    }
    assert any("edited since" in m for m in plan.messages)


def test_revert_after_user_edits_to_containerd_keeps_their_change(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/default-v2.toml"))
    host, _ = make_host(tmp_path)
    configure(host, "containerd", set_as_default=True)
    path.write_text(
        path.read_text().replace('sandbox_image = "registry.k8s.io/pause:3.6"', 'sandbox_image = "x"')
    )
    revert(host, "containerd")
    doc = toml_at(path)
    assert dig(doc, *CRI, "sandbox_image") == "x"
    assert dig(doc, *CRI, "containerd", "default_runtime_name") == "runc"
    assert "nvidia" not in dig(doc, *CRI, "containerd", "runtimes")
    assert path.read_text() == fixture("containerd/default-v2.toml").replace(
        'sandbox_image = "registry.k8s.io/pause:3.6"', 'sandbox_image = "x"'
    )


def test_revert_of_a_drop_in_removes_the_file_and_the_import(tmp_path: Path) -> None:
    original = fixture("containerd/default-v2.toml")
    main = put(tmp_path, "/etc/containerd/config.toml", original)
    host, _ = make_host(tmp_path)
    configure(host, "containerd", drop_in="/etc/containerd/conf.d/99-nvidia.toml")
    revert(host, "containerd")
    assert main.read_text() == original
    assert not (tmp_path / "etc/containerd/conf.d/99-nvidia.toml").exists()


def test_revert_without_a_record_says_so(tmp_path: Path) -> None:
    host, _ = make_host(tmp_path)
    with pytest.raises(NotFound, match="no record of changing docker"):
        plan_revert(host, "docker", ConfigureOptions())


def test_damaged_record_is_a_clear_error(tmp_path: Path) -> None:
    put(tmp_path, records.RECORDS, "{not json")
    host, _ = make_host(tmp_path)
    with pytest.raises(ConfigError, match="damaged"):
        plan_revert(host, "docker", ConfigureOptions())


def test_stale_backup_from_an_earlier_cycle_is_replaced(tmp_path: Path) -> None:
    put(tmp_path, "/var/lib/gpunode/backups/etc/docker/daemon.json", '{"debug": false}\n')
    path = put(tmp_path, "/etc/docker/daemon.json", '{"debug": true}\n')
    host, _ = make_host(tmp_path)
    configure(host, "docker")
    revert(host, "docker")
    assert path.read_text() == '{"debug": true}\n'


# -- restart, verify and rollback -------------------------------------------------------------------


def docker_info(runner: ScriptedRunner, runtimes: str, default: str) -> None:
    runner.answer(["docker", "-H", "unix:///var/run/docker.sock", "info"], f"{runtimes}\t{default}\n")


def test_restart_then_verify_docker(tmp_path: Path) -> None:
    host, runner = make_host(tmp_path)
    runner.answer(["systemctl", "restart", "docker.service"])
    docker_info(
        runner, '{"nvidia":{"path":"/usr/bin/nvidia-container-runtime"},"runc":{"path":"runc"}}', "nvidia"
    )
    plan = plan_configure(host, "docker", ConfigureOptions(set_as_default=True))
    outcome = apply(host, plan, restart=True)
    assert ("systemctl", "restart", "docker.service") in runner.calls
    assert outcome.restarted is not None and "as its default" in outcome.restarted


def test_runtime_that_does_not_come_back_gets_the_old_file_and_another_restart(tmp_path: Path) -> None:
    original = fixture("containerd/default-v2.toml")
    path = put(tmp_path, "/etc/containerd/config.toml", original)
    host, runner = make_host(tmp_path)
    runner.answer(["systemctl", "restart", "containerd.service"])
    runner.answer(["ctr"], "TYPE ID PLATFORMS STATUS\nio.containerd.grpc.v1 cri - error\n")
    runner.answer(["journalctl"], 'level=error msg="failed to load plugin io.containerd.grpc.v1.cri"\n')
    (tmp_path / "usr/bin").mkdir(parents=True)
    shutil.copy("/bin/true", tmp_path / "usr/bin/ctr")
    plan = plan_configure(host, "containerd", ConfigureOptions(set_as_default=True))
    with pytest.raises(CommandFailed) as caught:
        apply(host, plan, restart=True, ready_timeout=0)
    message = caught.value.message
    assert "CRI plugin is in state 'error'" in message
    assert "failed to load plugin" in message  # the runtime's own words
    assert "put back the previous content of /etc/containerd/config.toml" in message
    assert path.read_text() == original
    assert runner.calls.count(("systemctl", "restart", "containerd.service")) == 2
    assert "and restarted containerd.service with it" in message
    assert records.load(host).files == {}
    assert not (tmp_path / "var/lib/gpunode/backups/etc/containerd/config.toml").exists()


def test_failed_systemctl_restart_is_rolled_back(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/docker/daemon.json", "{}\n")
    host, runner = make_host(tmp_path)
    runner.answer(
        ["systemctl", "restart", "docker.service"], returncode=1, stderr="Job for docker.service failed"
    )
    runner.answer(["journalctl"], "unable to configure the Docker daemon with file /etc/docker/daemon.json\n")
    plan = plan_configure(host, "docker", ConfigureOptions())
    with pytest.raises(CommandFailed, match="unable to configure the Docker daemon"):
        apply(host, plan, restart=True, ready_timeout=0)
    assert path.read_text() == "{}\n"


# -- choosing the runtime -----------------------------------------------------------------------------


def test_kubelet_endpoint_chooses_the_runtime(tmp_path: Path) -> None:
    put(
        tmp_path,
        "/var/lib/kubelet/kubeadm-flags.env",
        'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///var/run/crio/crio.sock"\n',
    )
    host, _ = make_host(tmp_path)
    runtime, why = choose_runtime(host, None)
    assert runtime == "crio" and why is not None and "kubelet" in why


def test_only_installed_runtime_is_chosen_and_several_are_ambiguous(tmp_path: Path) -> None:
    host, _ = make_host(tmp_path)
    with pytest.raises(NotFound, match="no container runtime"):
        choose_runtime(host, None)
    for program in ("containerd", "dockerd"):
        exe = put(tmp_path, f"/usr/bin/{program}", "#!/bin/sh\n")
        exe.chmod(0o755)
        if program == "containerd":
            assert choose_runtime(host, None)[0] == "containerd"
    with pytest.raises(UsageError, match=r"several container runtimes .*docker, containerd"):
        choose_runtime(host, None)


def test_docker_whitespace_only_file_is_repaired_like_an_empty_one(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/docker/daemon.json", "  \n")
    host, _ = make_host(tmp_path)
    configure(host, "docker")
    assert json.loads(path.read_text())["runtimes"]["nvidia"]["path"] == NVIDIA


def test_docker_unknown_key_is_accepted_when_dockerd_validates_the_file(tmp_path: Path) -> None:
    path = put(tmp_path, "/etc/docker/daemon.json", '{"cdi-spec-dirs": ["/etc/cdi"]}\n')  # dockerd 25+
    dockerd = put(tmp_path, "/usr/bin/dockerd", "#!/bin/sh\n")
    dockerd.chmod(0o755)
    host, runner = make_host(tmp_path)
    runner.answer(["dockerd", "--validate"], "configuration OK\n")
    configure(host, "docker")
    assert json.loads(path.read_text())["cdi-spec-dirs"] == ["/etc/cdi"]
    assert ("dockerd", "--validate", "--config-file", str(path)) in runner.calls


def test_record_left_by_a_run_that_stopped_before_writing_is_started_over(tmp_path: Path) -> None:
    original = fixture("containerd/default-v2.toml")
    path = put(tmp_path, "/etc/containerd/config.toml", original)
    host, _ = make_host(tmp_path)
    plan = plan_configure(host, "containerd", ConfigureOptions(set_as_default=True))
    # What a run killed between saving its record and writing leaves: a record, no backup, the original.
    change = plan.changes[0]
    stopped = records.Records().updated(
        "containerd", change.path, change.before, change.after, change.edits, owned=False
    )
    records.save(host, records.Records({change.path: stopped}))
    configure(host, "containerd", set_as_default=True, cdi=True)
    assert (tmp_path / "var/lib/gpunode/backups/etc/containerd/config.toml").read_text() == original
    revert(host, "containerd")
    assert path.read_text() == original


def test_revert_restores_the_main_file_before_removing_its_drop_in(tmp_path: Path) -> None:
    put(tmp_path, "/etc/containerd/config.toml", fixture("containerd/default-v2.toml"))
    host, _ = make_host(tmp_path)
    configure(host, "containerd", drop_in="/etc/containerd/conf.d/99-nvidia.toml")
    plan = plan_revert(host, "containerd", ConfigureOptions())
    # A crash between the two steps must not leave an import of a file that is gone.
    assert [c.path for c in plan.changes] == [
        "/etc/containerd/config.toml",
        "/etc/containerd/conf.d/99-nvidia.toml",
    ]
    assert plan.changes[-1].after is None


def test_file_without_a_final_newline_stays_valid(tmp_path: Path) -> None:
    path = put(tmp_path, crio.CRIO_CONF, '[crio]\n  [crio.runtime]\n    default_runtime = "crun"')
    host, _ = make_host(tmp_path)
    configure(host, "crio", in_place=True)
    doc = tomlread.loads(path.read_text())
    assert doc["crio"]["runtime"]["default_runtime"] == "crun"
    assert doc["crio"]["runtime"]["runtimes"]["nvidia"]["runtime_path"] == NVIDIA


def test_layout_gpunode_cannot_edit_is_refused_not_a_crash(tmp_path: Path) -> None:
    text = (
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
        'runtimes = { runc = { runtime_type = "io.containerd.runc.v2" } }\n'
    )
    path = put(tmp_path, "/etc/containerd/config.toml", text)
    host, _ = make_host(tmp_path)
    with pytest.raises(ConfigError, match="cannot safely edit"):
        plan_configure(host, "containerd", ConfigureOptions())
    assert path.read_text() == text
