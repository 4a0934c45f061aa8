"""Read-only parsing of docker, containerd and CRI-O configuration, against realistic fixture files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tomlkit

from gpunode.errors import ConfigError
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import containerd, crio, docker

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

CONTAINERD_1_6 = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n"
CONTAINERD_2_0 = (
    "containerd github.com/containerd/containerd/v2 v2.0.0 207ad711eabd375a01713109a8a197d197ff6542\n"
)
CONTAINERD_2_1 = (
    "containerd github.com/containerd/containerd/v2 v2.1.1 cb1076646aa3740577fafbf3d914198b7fe8e3f7\n"
)


def install(root: Path, fixture: str, host_path: str) -> None:
    target = root / host_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(FIXTURES / fixture, target)


def write(root: Path, host_path: str, text: str) -> None:
    target = root / host_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def host_with(tmp_path: Path, containerd_version: str | None = CONTAINERD_1_6) -> Host:
    runner = ScriptedRunner()
    if containerd_version is not None:
        runner.answer(["containerd", "--version"], containerd_version)
    return Host(root=tmp_path, runner=runner)


# -- docker -----------------------------------------------------------------------------------------


def test_docker_missing_file_means_builtin_runc(tmp_path: Path) -> None:
    state = docker.read_state(Host(root=tmp_path))
    assert not state.exists
    assert state.default_runtime == "runc"
    assert state.nvidia_runtime is None
    assert state.runtimes == ()
    assert state.cdi_enabled is None


def test_docker_empty_file_parses_but_dockerd_would_refuse_it(tmp_path: Path) -> None:
    install(tmp_path, "docker/empty.json", docker.DAEMON_JSON)
    state = docker.read_state(Host(root=tmp_path))
    assert not state.exists
    assert state.default_runtime == "runc"
    assert any("is empty" in n and "{}" in n for n in state.notes)
    assert docker.parse_daemon_json("  \n\t", "/x.json") == {}


def test_docker_braces_only(tmp_path: Path) -> None:
    install(tmp_path, "docker/braces.json", docker.DAEMON_JSON)
    state = docker.read_state(Host(root=tmp_path))
    assert state.exists
    assert state.runtimes == ()
    assert state.default_runtime == "runc"
    assert state.notes == ()


def test_docker_configured_not_default(tmp_path: Path) -> None:
    install(tmp_path, "docker/configured.json", docker.DAEMON_JSON)
    state = docker.read_state(Host(root=tmp_path))
    assert state.runtimes == ("nvidia",)
    assert state.nvidia_runtime == "nvidia"
    assert state.nvidia_binary == "nvidia-container-runtime"
    assert state.default_runtime == "runc"
    assert not state.nvidia_is_default
    assert state.files == (docker.DAEMON_JSON,)


def test_docker_configured_as_default(tmp_path: Path) -> None:
    install(tmp_path, "docker/default.json", docker.DAEMON_JSON)
    state = docker.read_state(Host(root=tmp_path))
    assert state.nvidia_binary == "/usr/bin/nvidia-container-runtime"
    assert state.nvidia_is_default
    assert state.cdi_enabled is None


def test_docker_custom_name_and_cdi_feature(tmp_path: Path) -> None:
    install(tmp_path, "docker/cdi.json", docker.DAEMON_JSON)
    state = docker.read_state(Host(root=tmp_path))
    assert state.cdi_enabled is True
    # nvidia-container-runtime.cdi is another binary; "gpu" runs nvidia-container-runtime and is the default
    assert state.nvidia_runtime == "gpu"
    assert state.nvidia_is_default


def test_docker_malformed_json_names_file_line_and_column(tmp_path: Path) -> None:
    install(tmp_path, "docker/malformed.json", docker.DAEMON_JSON)
    with pytest.raises(ConfigError) as err:
        docker.read_state(Host(root=tmp_path))
    assert "/etc/docker/daemon.json is not valid JSON" in err.value.message
    assert "line 3, column 55" in err.value.message  # the } after the trailing comma
    assert "Expecting property name" in err.value.message
    assert err.value.fix is not None


def test_docker_top_level_array_is_rejected(tmp_path: Path) -> None:
    install(tmp_path, "docker/array.json", docker.DAEMON_JSON)
    with pytest.raises(ConfigError, match=r"/etc/docker/daemon.json must hold a JSON object .* not an array"):
        docker.read_state(Host(root=tmp_path))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"runtimes": []}', r'/d.json: "runtimes" must be an object'),
        ('{"runtimes": {"nvidia": "x"}}', r"/d.json: runtimes.nvidia must be an object"),
        ('{"runtimes": {"nvidia": {"path": 1}}}', r"/d.json: runtimes.nvidia.path must be a string"),
        ('{"features": {"cdi": "yes"}}', r"/d.json: features.cdi must be true or false"),
        ('{"default-runtime": 3}', r'/d.json: "default-runtime" must be a string'),
    ],
)
def test_docker_wrong_types_name_the_file(tmp_path: Path, text: str, message: str) -> None:
    write(tmp_path, "/d.json", text)
    with pytest.raises(ConfigError, match=message):
        docker.read_state(Host(root=tmp_path), "/d.json")


def test_docker_notes_what_dockerd_refuses(tmp_path: Path) -> None:
    write(
        tmp_path, docker.DAEMON_JSON, '{"default-runtime": "nvidia", "runtimes": {"runc": {"path": "runc"}}}'
    )
    notes = docker.read_state(Host(root=tmp_path)).notes
    assert any('named "runc"' in n for n in notes)
    assert any('default-runtime "nvidia" is not defined' in n for n in notes)


# -- containerd: versions and paths -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "installed", "expected"),
    [
        ({"version": 2}, None, 2),
        ({"version": 3}, 1, 3),
        ({"version": 1}, 2, 1),
        ({"plugins": {}}, 2, 1),
        ({"disabled_plugins": ["cri"]}, None, 1),
        ({}, 1, 2),
        ({}, 2, 3),
        ({}, None, 2),
    ],
)
def test_detect_version(doc: dict[str, object], installed: int | None, expected: int) -> None:
    assert containerd.detect_version(doc, installed) == expected


@pytest.mark.parametrize("bad", [4, 0, "2", True, 2.0])
def test_unknown_version_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"/c.toml: unknown config version"):
        containerd.detect_version({"version": bad}, None, path="/c.toml")


def test_unknown_version_from_a_file_names_it(tmp_path: Path) -> None:
    install(tmp_path, "containerd/unknown-version.toml", containerd.DEFAULT_CONFIG)
    with pytest.raises(ConfigError, match=r"/etc/containerd/config.toml: unknown config version 4"):
        containerd.read_state(host_with(tmp_path), containerd.DEFAULT_CONFIG)


def test_cri_table_paths() -> None:
    assert containerd.cri_table_path(1) == ("plugins", "cri")
    assert containerd.cri_table_path(2) == ("plugins", "io.containerd.grpc.v1.cri")
    assert containerd.cri_table_path(3) == ("plugins", "io.containerd.cri.v1.runtime")
    with pytest.raises(ValueError, match="version 7"):
        containerd.cri_table_path(7)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("containerd containerd.io 1.6.20 2806fc1057397dbaeefbea0e4e17bddfbd388f38\n", (1, 6)),
        (
            "containerd github.com/containerd/containerd v1.7.12 71909c1814c544ac47ab91d2e8b84718e517bb99\n",
            (1, 7),
        ),
        (CONTAINERD_1_6, (1, 6)),
        (CONTAINERD_2_0, (2, 0)),
        ("containerd github.com/k3s-io/containerd v1.7.23-k3s2\n", (1, 7)),
        ("garbage\n", None),
        ("", None),
    ],
)
def test_parse_containerd_version(output: str, expected: tuple[int, int] | None) -> None:
    assert containerd.parse_containerd_version(output) == expected


def test_installed_containerd_major(tmp_path: Path) -> None:
    runner = ScriptedRunner()
    runner.answer(["containerd", "--version"], CONTAINERD_2_0)
    assert containerd.installed_containerd_major(Host(root=tmp_path, runner=runner)) == 2
    assert runner.calls == [("containerd", "--version")]
    # Not installed: the scripted runner answers like a missing program.
    assert containerd.installed_containerd_major(Host(root=tmp_path, runner=ScriptedRunner())) is None
    failing = ScriptedRunner()
    failing.answer(["containerd", "--version"], "", returncode=1)
    assert containerd.installed_containerd_major(Host(root=tmp_path, runner=failing)) is None


def test_location_plain_containerd(tmp_path: Path) -> None:
    host = Host(root=tmp_path)
    assert containerd.detect_config_path(host) == (containerd.DEFAULT_CONFIG, None)
    location = containerd.detect_location(host)
    assert location.flavour == "containerd"
    assert not location.regenerated


def test_location_k3s_prefers_the_rendered_file(tmp_path: Path) -> None:
    install(tmp_path, "containerd/k3s-config.toml", containerd.K3S_CONFIG)
    install(tmp_path, "containerd/k3s-config.toml.tmpl", containerd.K3S_TEMPLATE)
    host = Host(root=tmp_path)
    location = containerd.detect_location(host)
    assert location.flavour == "k3s"
    assert location.template_path == containerd.K3S_TEMPLATE
    assert location.regenerated
    path, note = containerd.detect_config_path(host)
    assert path == containerd.K3S_CONFIG
    assert note is not None and "k3s regenerates" in note and containerd.K3S_TEMPLATE in note


def test_location_k3s_without_template_says_where_it_goes(tmp_path: Path) -> None:
    install(tmp_path, "containerd/k3s-config.toml", containerd.K3S_CONFIG)
    location = containerd.detect_location(Host(root=tmp_path))
    assert location.template_path is None
    assert location.template_candidates == (containerd.K3S_TEMPLATE_V3, containerd.K3S_TEMPLATE)
    assert location.note is not None and "config.toml.tmpl" in location.note


def test_location_k3s_not_rendered_yet_reads_the_template(tmp_path: Path) -> None:
    write(tmp_path, containerd.K3S_TEMPLATE_V3, "version = 3\n")
    path, note = containerd.detect_config_path(Host(root=tmp_path))
    assert path == containerd.K3S_TEMPLATE_V3
    assert note is not None and "gpunode reads the template" in note


def test_location_rke2_and_microk8s(tmp_path: Path) -> None:
    (tmp_path / containerd.RKE2_DIR.lstrip("/")).mkdir(parents=True)
    assert containerd.detect_location(Host(root=tmp_path)).flavour == "rke2"
    other = tmp_path / "mk"
    write(other, containerd.MICROK8S_TEMPLATE, "version = 2\n")
    location = containerd.detect_location(Host(root=other))
    assert location.flavour == "microk8s"
    assert location.config_path == containerd.MICROK8S_CONFIG
    assert location.template_path == containerd.MICROK8S_TEMPLATE
    assert containerd.detect_config_path(Host(root=other))[0] == containerd.MICROK8S_TEMPLATE


# -- containerd: reading ----------------------------------------------------------------------------


def test_stock_default_v2_config(tmp_path: Path) -> None:
    install(tmp_path, "containerd/default-v2.toml", containerd.DEFAULT_CONFIG)
    state = containerd.read_state(host_with(tmp_path))
    assert state.exists
    assert state.version == 2
    assert state.config_path == containerd.DEFAULT_CONFIG
    assert state.runtimes == ("runc",)
    assert state.default_runtime == "runc"
    assert state.nvidia_runtime is None
    assert state.cdi_enabled is None
    assert state.files == (containerd.DEFAULT_CONFIG,)
    assert state.notes == ()


def test_default_runtime_options_of_the_stock_file() -> None:
    doc = containerd.parse_toml((FIXTURES / "containerd/default-v2.toml").read_text(), "default-v2.toml")
    options = containerd.default_runtime_options(doc, 2)
    assert options["SystemdCgroup"] is False
    assert options["BinaryName"] == ""


def test_default_runtime_options_work_on_a_tomlkit_document() -> None:
    doc = tomlkit.parse((FIXTURES / "containerd/v3-nvidia.toml").read_text())
    options = containerd.default_runtime_options(doc, containerd.detect_version(doc, None))
    assert options == {"SystemdCgroup": True}
    assert type(options["SystemdCgroup"]) is bool


def test_missing_config_uses_builtin_defaults(tmp_path: Path) -> None:
    state = containerd.read_state(host_with(tmp_path, CONTAINERD_2_0))
    assert not state.exists
    assert state.version == 3
    assert state.default_runtime == "runc"
    assert state.files == ()
    assert state.notes == ()


def test_comments_only_config_takes_the_installed_version(tmp_path: Path) -> None:
    install(tmp_path, "containerd/comments-only.toml", containerd.DEFAULT_CONFIG)
    assert containerd.read_state(host_with(tmp_path, CONTAINERD_1_6)).version == 2
    state = containerd.read_state(host_with(tmp_path, CONTAINERD_2_0))
    assert state.version == 3
    assert not state.exists
    assert state.files == (containerd.DEFAULT_CONFIG,)


def test_v1_config_with_nvidia_default(tmp_path: Path) -> None:
    install(tmp_path, "containerd/v1-nvidia.toml", containerd.DEFAULT_CONFIG)
    state = containerd.read_state(host_with(tmp_path))
    assert state.version == 1
    assert state.runtimes == ("runc", "nvidia")
    assert state.nvidia_runtime == "nvidia"
    assert state.nvidia_binary == "/usr/bin/nvidia-container-runtime"
    assert state.nvidia_is_default


def test_v1_deprecated_default_runtime_with_engine(tmp_path: Path) -> None:
    install(tmp_path, "containerd/v1-default-runtime-engine.toml", containerd.DEFAULT_CONFIG)
    state = containerd.read_state(host_with(tmp_path))
    assert state.version == 1
    assert state.default_runtime == "default"
    assert state.nvidia_runtime == "default"
    assert state.nvidia_binary == "/usr/bin/nvidia-container-runtime"
    assert state.nvidia_is_default


def test_v1_runtime_from_the_linux_plugin() -> None:
    doc = {
        "plugins": {
            "linux": {"runtime": "nvidia-container-runtime"},
            "cri": {"containerd": {"runtimes": {"runc": {"runtime_type": "io.containerd.runtime.v1.linux"}}}},
        }
    }
    runtimes = containerd.configured_runtimes(doc, 1)
    assert containerd.find_nvidia_runtime(runtimes, doc, 1, "runc") == ("runc", "nvidia-container-runtime")


def test_v2_configured_as_default_with_systemd_cgroup(tmp_path: Path) -> None:
    install(tmp_path, "containerd/v2-nvidia-default.toml", containerd.DEFAULT_CONFIG)
    state = containerd.read_state(host_with(tmp_path))
    assert state.version == 2
    assert state.runtimes == ("runc", "nvidia")
    assert state.nvidia_is_default
    assert state.cdi_enabled is True
    assert state.notes == ()
    doc = containerd.parse_toml((FIXTURES / "containerd/v2-nvidia-default.toml").read_text(), "x")
    assert containerd.default_runtime_options(doc, 2) == {
        "BinaryName": "/usr/bin/nvidia-container-runtime",
        "SystemdCgroup": True,
    }


def test_nvidia_without_systemd_cgroup_is_noted(tmp_path: Path) -> None:
    install(tmp_path, "containerd/v2-nvidia-no-systemdcgroup.toml", containerd.DEFAULT_CONFIG)
    state = containerd.read_state(host_with(tmp_path))
    assert state.nvidia_runtime == "nvidia"
    assert state.nvidia_binary == "nvidia-container-runtime"
    assert not state.nvidia_is_default
    assert any('"nvidia" lacks `SystemdCgroup = true` while "runc" has it' in n for n in state.notes)


def test_v3_config(tmp_path: Path) -> None:
    install(tmp_path, "containerd/v3-nvidia.toml", containerd.DEFAULT_CONFIG)
    state = containerd.read_state(host_with(tmp_path, CONTAINERD_2_0))
    assert state.version == 3
    assert state.runtimes == ("runc", "nvidia")
    assert state.nvidia_runtime == "nvidia"
    assert state.default_runtime == "runc"
    assert state.cdi_enabled is False
    assert state.notes == ()


def test_v3_config_with_containerd_1_is_noted(tmp_path: Path) -> None:
    install(tmp_path, "containerd/v3-nvidia.toml", containerd.DEFAULT_CONFIG)
    state = containerd.read_state(host_with(tmp_path, CONTAINERD_1_6))
    assert any("version 3 file but containerd 1.6" in n for n in state.notes)


def test_cri_plugin_disabled_is_noted(tmp_path: Path) -> None:
    install(tmp_path, "containerd/cri-disabled.toml", containerd.DEFAULT_CONFIG)
    state = containerd.read_state(host_with(tmp_path))
    assert state.version == 1
    assert state.default_runtime == "runc"
    assert len(state.notes) == 1 and "disables the CRI plugin" in state.notes[0]


def test_default_runtime_that_is_not_defined_is_noted(tmp_path: Path) -> None:
    write(
        tmp_path,
        containerd.DEFAULT_CONFIG,
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        'BinaryName = "/usr/bin/nvidia-container-runtime"\n',
    )
    state = containerd.read_state(host_with(tmp_path))
    # A runtimes table replaces the built-in one: runc is gone and it is still the default.
    assert state.runtimes == ("nvidia",)
    assert any('default runtime "runc" is not defined' in n for n in state.notes)


def test_imports_replace_the_whole_cri_table(tmp_path: Path) -> None:
    install(tmp_path, "containerd/imports-main.toml", containerd.DEFAULT_CONFIG)
    install(tmp_path, "containerd/imports-99-nvidia.toml", "/etc/containerd/conf.d/99-nvidia.toml")
    write(tmp_path, "/etc/containerd/conf.d/99-nvidia.toml.gpunode-bak", "this is not toml = [")
    state = containerd.read_state(host_with(tmp_path))
    assert state.files == (containerd.DEFAULT_CONFIG, "/etc/containerd/conf.d/99-nvidia.toml")
    assert state.runtimes == ("nvidia",)
    assert state.nvidia_is_default
    assert any("replaces the whole CRI plugin table" in n and "runc" in n for n in state.notes)
    loaded = containerd.load_config(host_with(tmp_path), containerd.DEFAULT_CONFIG, (1, 6))
    assert "sandbox_image" not in loaded.merged["plugins"]["io.containerd.grpc.v1.cri"]
    assert loaded.main["imports"] == ["/etc/containerd/conf.d/*.toml"]


def test_imports_merge_deeply_from_containerd_2_1(tmp_path: Path) -> None:
    install(tmp_path, "containerd/imports-main.toml", containerd.DEFAULT_CONFIG)
    install(tmp_path, "containerd/imports-99-nvidia.toml", "/etc/containerd/conf.d/99-nvidia.toml")
    state = containerd.read_state(host_with(tmp_path, CONTAINERD_2_1))
    assert state.runtimes == ("runc", "nvidia")
    assert state.nvidia_is_default
    assert not any("replaces" in n for n in state.notes)


def test_missing_and_relative_imports_are_noted(tmp_path: Path) -> None:
    write(
        tmp_path,
        containerd.DEFAULT_CONFIG,
        'version = 2\nimports = ["/etc/containerd/gone.toml", "rel.toml"]\n',
    )
    write(tmp_path, "/etc/containerd/rel.toml", "version = 2\n")
    state = containerd.read_state(host_with(tmp_path))
    assert state.files == (containerd.DEFAULT_CONFIG, "/etc/containerd/rel.toml")
    assert any(
        "/etc/containerd/gone.toml, which does not exist: containerd refuses to start" in n
        for n in state.notes
    )
    assert any('relative import "rel.toml" read as /etc/containerd/rel.toml' in n for n in state.notes)


def test_import_cycles_and_globs_without_matches(tmp_path: Path) -> None:
    write(
        tmp_path,
        "/etc/containerd/config.toml",
        'version = 2\nimports = ["/etc/containerd/b.toml", "/none/*.toml"]\n',
    )
    write(tmp_path, "/etc/containerd/b.toml", 'version = 2\nimports = ["/etc/containerd/config.toml"]\n')
    state = containerd.read_state(host_with(tmp_path), "/etc/containerd/config.toml")
    assert state.files == ("/etc/containerd/config.toml", "/etc/containerd/b.toml")


def test_glob_host_matches_per_component(tmp_path: Path) -> None:
    for name in ("/d/a/x.toml", "/d/b/y.toml", "/d/b/y.conf", "/d/c.toml"):
        write(tmp_path, name, "")
    host = Host(root=tmp_path)
    assert containerd.glob_host(host, "/d/*/*.toml") == ["/d/a/x.toml", "/d/b/y.toml"]
    assert containerd.glob_host(host, "/d/*.toml") == ["/d/c.toml"]
    assert containerd.glob_host(host, "/nope/*.toml") == []


def test_bad_imports_value_names_the_file(tmp_path: Path) -> None:
    write(tmp_path, containerd.DEFAULT_CONFIG, 'version = 2\nimports = "/etc/x.toml"\n')
    with pytest.raises(ConfigError, match=r"/etc/containerd/config.toml: `imports` must be a list"):
        containerd.read_state(host_with(tmp_path))


def test_malformed_toml_names_file_line_and_column(tmp_path: Path) -> None:
    install(tmp_path, "containerd/malformed.toml", containerd.DEFAULT_CONFIG)
    with pytest.raises(ConfigError) as err:
        containerd.read_state(host_with(tmp_path))
    assert err.value.message.startswith("/etc/containerd/config.toml is not valid TOML")
    assert "(line 3, column" in err.value.message
    assert err.value.fix is not None and "line 3" in err.value.fix


def test_malformed_import_names_the_imported_file(tmp_path: Path) -> None:
    write(tmp_path, containerd.DEFAULT_CONFIG, 'version = 2\nimports = ["/etc/containerd/bad.toml"]\n')
    write(tmp_path, "/etc/containerd/bad.toml", "version = 2\nx = = 1\n")
    with pytest.raises(ConfigError, match=r"^/etc/containerd/bad.toml is not valid TOML.*line 2"):
        containerd.read_state(host_with(tmp_path))


def test_a_non_table_on_the_cri_path_names_the_file(tmp_path: Path) -> None:
    write(tmp_path, containerd.DEFAULT_CONFIG, 'version = 2\n[plugins]\n"io.containerd.grpc.v1.cri" = 5\n')
    with pytest.raises(
        ConfigError, match=r'/etc/containerd/config.toml: plugins."io.containerd.grpc.v1.cri" must be'
    ):
        containerd.read_state(host_with(tmp_path))


def test_k3s_layout_reads_the_rendered_file(tmp_path: Path) -> None:
    install(tmp_path, "containerd/k3s-config.toml", containerd.K3S_CONFIG)
    install(tmp_path, "containerd/k3s-config.toml.tmpl", containerd.K3S_TEMPLATE)
    state = containerd.read_state(host_with(tmp_path, None))
    assert state.config_path == containerd.K3S_CONFIG
    assert state.runtimes == ("runc", "nvidia")
    assert state.nvidia_runtime == "nvidia"
    assert state.default_runtime == "runc"
    assert any("k3s regenerates" in n for n in state.notes)


def test_k3s_go_template_is_not_parsed_as_toml(tmp_path: Path) -> None:
    install(tmp_path, "containerd/k3s-config.toml.tmpl", containerd.K3S_TEMPLATE)
    state = containerd.read_state(host_with(tmp_path, None))
    assert state.config_path == containerd.K3S_TEMPLATE
    assert state.default_runtime is None
    assert state.nvidia_runtime is None
    assert any("Go template" in n for n in state.notes)


# -- CRI-O ------------------------------------------------------------------------------------------


def install_crio(root: Path, *names: str) -> None:
    for name in names:
        install(root, f"crio/{name}", f"/etc/crio/{name}")


def test_crio_nothing_configured(tmp_path: Path) -> None:
    state = crio.read_state(Host(root=tmp_path))
    assert not state.exists
    assert state.runtimes == ()
    assert state.default_runtime == "crun"
    assert state.files == ()


def test_crio_main_file_only(tmp_path: Path) -> None:
    install_crio(tmp_path, "crio.conf")
    state = crio.read_state(Host(root=tmp_path))
    assert state.exists
    assert state.runtimes == ("runc",)
    assert state.default_runtime == "runc"
    assert state.nvidia_runtime is None


def test_crio_dropins_merge_in_lexical_order(tmp_path: Path) -> None:
    install_crio(tmp_path, "crio.conf", "crio.conf.d/99-nvidia.toml", "crio.conf.d/10-crio.conf")
    state = crio.read_state(Host(root=tmp_path))
    assert state.files == (
        "/etc/crio/crio.conf",
        "/etc/crio/crio.conf.d/10-crio.conf",
        "/etc/crio/crio.conf.d/99-nvidia.toml",
    )
    assert state.runtimes == ("runc", "crun", "nvidia")
    assert state.nvidia_runtime == "nvidia"
    assert state.nvidia_binary == "/usr/bin/nvidia-container-runtime"
    assert state.nvidia_is_default
    assert state.cdi_enabled is None
    assert state.notes == ()


def test_crio_runtime_entries_are_replaced_whole_other_tables_merged() -> None:
    base = {"crio": {"runtime": {"cgroup_manager": "systemd", "runtimes": {"runc": {"a": 1, "b": 2}}}}}
    overlay = {"crio": {"runtime": {"default_runtime": "runc", "runtimes": {"runc": {"b": 3}}}}}
    merged = crio.merge_dropin(base, overlay)
    assert merged["crio"]["runtime"] == {
        "cgroup_manager": "systemd",
        "default_runtime": "runc",
        "runtimes": {"runc": {"b": 3}},
    }


def test_crio_default_without_default_runtime() -> None:
    assert crio.default_runtime({}, {"runc": {}}) == "runc"
    assert crio.default_runtime({}, {"crun": {}}) == "crun"
    assert crio.default_runtime({"crio": {"runtime": {"default_runtime": "kata"}}}, {}) == "kata"


def test_crio_wrong_dropin_directory_is_noted(tmp_path: Path) -> None:
    install_crio(tmp_path, "crio.conf", "conf.d/99-nvidia.toml")
    state = crio.read_state(Host(root=tmp_path))
    assert state.nvidia_runtime is None
    assert any("does not read /etc/crio/conf.d" in n and "99-nvidia.toml" in n for n in state.notes)


def test_crio_backups_in_the_dropin_directory_are_applied_and_noted(tmp_path: Path) -> None:
    install_crio(tmp_path, "crio.conf.d/99-nvidia.toml")
    write(tmp_path, "/etc/crio/crio.conf.d/99-nvidia.toml.gpunode-bak", "[crio.runtime]\n")
    write(tmp_path, "/etc/crio/crio.conf.d/sub/50-x.conf", '[crio.runtime]\ncgroup_manager = "systemd"\n')
    state = crio.read_state(Host(root=tmp_path))
    assert state.files == (
        "/etc/crio/crio.conf.d/99-nvidia.toml",
        "/etc/crio/crio.conf.d/99-nvidia.toml.gpunode-bak",
        "/etc/crio/crio.conf.d/sub/50-x.conf",
    )
    assert any("backups included" in n for n in state.notes)


def test_crio_undefined_default_runtime_is_noted(tmp_path: Path) -> None:
    write(tmp_path, crio.CRIO_CONF, '[crio.runtime]\ndefault_runtime = "nvidia"\n')
    state = crio.read_state(Host(root=tmp_path))
    assert state.default_runtime == "nvidia"
    assert state.nvidia_runtime is None
    assert any("CRI-O refuses to start" in n for n in state.notes)


def test_crio_malformed_dropin_names_the_file_and_line(tmp_path: Path) -> None:
    install_crio(tmp_path, "crio.conf")
    install(tmp_path, "crio/malformed.conf", "/etc/crio/crio.conf.d/50-bad.conf")
    with pytest.raises(ConfigError, match=r"^/etc/crio/crio.conf.d/50-bad.conf is not valid TOML.*line 2"):
        crio.read_state(Host(root=tmp_path))


def test_crio_runtimes_must_be_tables(tmp_path: Path) -> None:
    write(tmp_path, crio.CRIO_CONF, '[crio.runtime]\nruntimes = "runc"\n')
    with pytest.raises(ConfigError, match=r"/etc/crio/crio.conf: crio.runtime.runtimes must be"):
        crio.read_state(Host(root=tmp_path))
