"""NVIDIA's device-plugin config file (tests/fixtures/nvidia-plugin): read as it is, keys refused by name and
line, precedence, what each setting does to the served resources and Allocate, and import-config."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from gpunode.cli.main import main
from gpunode.errors import ConfigError, ExitCode, NotFound
from gpunode.host import Host
from gpunode.plugin.allocate import AllocateSettings, DeviceNodes, allocate, read_device_nodes
from gpunode.plugin.config import PluginConfig, load_config
from gpunode.plugin.devices import (
    DeviceRegistry,
    NamedResource,
    Resource,
    SharedResource,
    Sharing,
    build_resources,
)
from gpunode.plugin.import_config import render
from gpunode.plugin.lifecycle import _sharing
from gpunode.plugin.simulate import simulated_inventory
from tests import tomlread as tomllib

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-plugin"
LOADABLE = sorted(
    p.name for p in FIXTURES.iterdir() if p.suffix in (".yaml", ".json") and p.stem != "unknown-key"
)


MPS_ONE = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      replicas: 1\n"


def nvidia(tmp_path: Path, text: str, name: str = "config.yaml") -> tuple[Host, str]:
    (tmp_path / name).write_text(text)
    return Host(root=tmp_path, env={}), f"/{name}"


def gpunode_in(root: Path) -> None:
    """gpunode installed in the root at the paths these tests name (install under --root checks it)."""
    for executable in ("usr/local/bin/gpunode", "tmp/venv/bin/gpunode"):
        program = root / executable
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)


def fixture(tmp_path: Path, name: str) -> tuple[Host, str]:
    return nvidia(tmp_path, (FIXTURES / name).read_text(), name)


def load(tmp_path: Path, name: str, **kwargs: object) -> PluginConfig:
    host, path = fixture(tmp_path, name)
    return load_config(host, config_path=path, env={}, **kwargs)  # type: ignore[arg-type]


def served(config: PluginConfig, profile: str) -> dict[str, tuple[int, int]]:
    """resource name -> (devices, replicas per device), as the plugin would serve them."""
    resources = build_resources(
        simulated_inventory(profile),
        resource_name=config.resource_name,
        mig_strategy=config.mig_strategy,
        device_id_strategy=config.device_id_strategy,
        sharing=_sharing(config),
        gpu_names=config.gpu_resources,
        mig_names=config.mig_resources,
    )
    return {r.name: (len(r.devices), r.replicas) for r in resources}


# -- the fixtures, as NVIDIA documents them -------------------------------------------------------------


def test_flags_file_maps_onto_gpunode_options(tmp_path: Path) -> None:
    config = load(tmp_path, "flags.yaml")
    assert config == PluginConfig()  # the README's file spells out NVIDIA's defaults, which are gpunode's
    assert config.origins["mig_strategy"] == "file /flags.yaml (flags.migStrategy)"
    assert config.origins["device_id_strategy"] == "file /flags.yaml (flags.plugin.deviceIDStrategy)"


def test_time_slicing_makes_replicas_of_every_gpu(tmp_path: Path) -> None:
    config = load(tmp_path, "time-slicing.yaml")
    assert config.shared_resources == (SharedResource("nvidia.com/gpu", 10),)
    assert served(config, "pcie-4") == {"nvidia.com/gpu": (40, 10)}


def test_rename_by_default_and_fail_requests_greater_than_one(tmp_path: Path) -> None:
    config = load(tmp_path, "time-slicing-rename.yaml")
    assert config.rename_by_default and config.fail_requests_greater_than_one
    assert served(config, "pcie-4") == {"nvidia.com/gpu.shared": (40, 10)}


def test_json_with_per_resource_rename_and_devices(tmp_path: Path) -> None:
    # NVIDIA's plugin parses rename and devices, then disables them; here they work: GPUs 0 and 1 are
    # shared as nvidia.com/shared-gpu, GPUs 2 and 3 stay whole under nvidia.com/gpu.
    config = load(tmp_path, "time-slicing-devices.json")
    assert config.shared_resources == (SharedResource("nvidia.com/gpu", 4, "shared-gpu", ("0", "1")),)
    assert config.device_list_strategy == ("envvar", "volume-mounts")
    assert config.placement == "packed"  # sharedDevicesAllocationPolicy packed
    assert served(config, "pcie-4") == {"nvidia.com/gpu": (2, 1), "nvidia.com/shared-gpu": (8, 4)}
    inventory = simulated_inventory("pcie-4")
    [_, shared] = build_resources(inventory, sharing=Sharing(resources=config.shared_resources))
    assert {d.gpu_index for d in shared.devices} == {0, 1}


def test_mig_mixed_shares_each_profile_its_own_way(tmp_path: Path) -> None:
    config = load(tmp_path, "mig-mixed-sharing.yaml")
    # The mig profile: GPU 0 in MIG mode (two 1g.5gb, one 2g.10gb), GPU 1 whole.
    assert served(config, "mig") == {
        "nvidia.com/mig-1g.5gb": (4, 2),
        "nvidia.com/mig-2g.10gb": (3, 3),
        "nvidia.com/gpu": (2, 2),
    }


def test_mig_single_needs_every_gpu_in_mig_mode(tmp_path: Path) -> None:
    config = load(tmp_path, "mig-single.yaml")
    assert config.mig_strategy == "single"
    assert served(config, "pcie-4") == {"nvidia.com/gpu": (4, 1)}  # no MIG at all: the whole GPUs
    with pytest.raises(ConfigError, match="GPU 1 is not"):
        served(config, "mig")


def test_per_model_and_per_profile_resource_names(tmp_path: Path) -> None:
    config = load(tmp_path, "per-model.yaml")
    assert config.gpu_resources == (NamedResource("*A100*", "a100"), NamedResource("*", "gpu"))
    assert served(config, "mig") == {
        "nvidia.com/mig-small": (4, 2),  # the two 1g.5gb instances, 2 replicas each
        "nvidia.com/mig-large": (1, 1),
        "nvidia.com/a100": (1, 1),  # GPU 1, not in MIG mode
    }
    # A node with two models: each its own resource; the first matching pattern wins.
    inventory = simulated_inventory("pcie-4")
    gpus = list(inventory.gpus)
    gpus[3] = dataclasses.replace(gpus[3], name="NVIDIA A100-SXM4-80GB")
    resources = build_resources(
        dataclasses.replace(inventory, gpus=tuple(gpus)), gpu_names=config.gpu_resources
    )
    assert {r.name: [d.gpu_index for d in r.devices] for r in resources} == {
        "nvidia.com/gpu": [0, 1, 2],
        "nvidia.com/a100": [3],
    }


def test_a_gpu_no_pattern_matches_is_not_served(tmp_path: Path) -> None:
    # NVIDIA's rule: with resources.gpus set, a GPU matches one of them or is not advertised.
    names = (NamedResource("A100", "a100"),)
    assert build_resources(simulated_inventory("pcie-4"), gpu_names=names) == ()


def test_extras_reach_allocate(tmp_path: Path) -> None:
    config = load(tmp_path, "extras.yaml")
    assert (config.gds_enabled, config.mofed_enabled, config.gdrcopy_enabled) == (True, True, True)
    assert (config.imex_channel_ids, config.imex_required) == ((0,), False)


# -- what gpunode refuses, and how it says so -----------------------------------------------------------


def test_mps_shares_through_a_control_daemon_per_resource(tmp_path: Path) -> None:
    config = load(tmp_path, "mps.yaml")
    assert config.mps_resources == (SharedResource("nvidia.com/gpu", 10),)
    assert config.origins["mps_resources"] == "file /mps.yaml (sharing.mps.resources)"
    assert served(config, "pcie-4") == {"nvidia.com/gpu": (40, 10)}
    [resource] = build_resources(simulated_inventory("pcie-4"), sharing=_sharing(config))
    assert resource.sharing == "mps"


def test_mps_flags_and_sharing_keys(tmp_path: Path) -> None:
    host, path = nvidia(
        tmp_path,
        "version: v1\nflags:\n  mpsRoot: /run/mps\nsharing:\n  mps:\n    renameByDefault: true\n"
        "    failRequestsGreaterThanOne: true\n    resources:\n    - name: gpu\n      replicas: 2\n",
    )
    config = load_config(host, config_path=path, env={})
    assert (config.mps_root, config.rename_by_default, config.fail_requests_greater_than_one) == (
        "/run/mps",
        True,
        True,
    )
    assert served(config, "pcie-4") == {"nvidia.com/gpu.shared": (8, 2)}
    host, path = nvidia(tmp_path, "version: v1\nflags:\n  mpsRoot: ''\n")
    assert load_config(host, config_path=path, env={}).mps_root == "/run/nvidia/mps"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n"
            "  mps:\n    resources:\n    - {name: gpu, replicas: 2}\n",
            "mps.resources and time-slicing",
        ),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
            "  mps:\n    renameByDefault: false\n",
            "sharing.timeSlicing and sharing.mps both set renameByDefault",
        ),
        (
            "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  mps:\n    resources:\n"
            "    - {name: gpu, replicas: 2}\n",
            "MPS shares whole GPUs only",
        ),
    ],
)
def test_mps_combinations_gpunode_refuses(tmp_path: Path, text: str, message: str) -> None:
    host, path = nvidia(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(host, config_path=path, env={})
    assert message in err.value.message


def test_an_mps_section_that_shares_nothing_is_accepted(tmp_path: Path) -> None:
    host, path = nvidia(tmp_path, MPS_ONE)
    config = load_config(host, config_path=path, env={})
    assert served(config, "pcie-4") == {"nvidia.com/gpu": (4, 1)}


def test_mps_entries_are_checked_like_time_slicing_ones(tmp_path: Path) -> None:
    host, path = nvidia(tmp_path, MPS_ONE.replace("replicas: 1", "replicas: 0"))
    with pytest.raises(ConfigError, match=r"sharing\.mps\.resources.*replicas.*at least 1"):
        load_config(host, config_path=path, env={})


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("version: v1\nflag:\n  migStrategy: none\n", "flag", 2),
        ("version: v1\nflags:\n  migStrategy: none\n  migstrategy: mixed\n", "flags.migstrategy", 4),
        (
            "version: v1\nflags:\n  plugin:\n    deviceListStrategys: envvar\n",
            "flags.plugin.deviceListStrategys",
            4,
        ),
        ("version: v1\nflags:\n  gfd:\n    oneShot: true\n", "flags.gfd.oneShot", 4),
        ("version: v1\nsharing:\n  timeslicing: {}\n", "sharing.timeslicing", 3),
        ("version: v1\nimex:\n  channelIds: [0]\n", "imex.channelIds", 3),
        ("version: v1\nresources:\n  gpus:\n  - pattern: '*'\n    nam: gpu\n", "resources.gpus[0].nam", 5),
    ],
)
def test_unknown_keys_are_refused_with_key_and_line(tmp_path: Path, text: str, key: str, line: int) -> None:
    host, path = nvidia(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(host, config_path=path, env={})
    assert f"/config.yaml, line {line}: unknown key {key} " in err.value.message
    assert "NVIDIA's plugin would ignore it silently" in (err.value.fix or "") or "entry takes" in (
        err.value.fix or ""
    )


def test_the_fixture_typo_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"line 6: unknown key sharing\.timeSlicing\.resources\[0\]\.replica "
    ):
        load(tmp_path, "unknown-key.yaml")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("version: v2\n", "unknown version 'v2'"),
        ("version: v1\nflags:\n  migStrategy: half\n", r"flags\.migStrategy \(/config\.yaml, line 3\).*half"),
        (
            "version: v1\nflags:\n  plugin:\n    sharedDevicesAllocationPolicy: random\n",
            "distributed or packed",
        ),
        ("version: v1\nflags:\n  nvidiaDriverRoot: run/nvidia\n", "not an absolute path"),
        ("version: v1\nflags:\n  mpsRoot: relative\n", r"flags\.mpsRoot.*not an absolute path"),
        ("version: v1\nimex:\n  channelIDs: [1]\n", r"must be \[\] or \[0\]"),
        ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n", "replicas missing"),
        (
            "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: a, replicas: 2, devices: x}]\n",
            "not 'all', a count",
        ),
        ("version: v1\nflags: [1, 2]\n", "flags must be a mapping"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, problem: str) -> None:
    host, path = nvidia(tmp_path, text)
    with pytest.raises(ConfigError, match=problem):
        load_config(host, config_path=path, env={})


def test_keys_nvidia_has_and_gpunode_needs_not_are_accepted_with_a_note(tmp_path: Path) -> None:
    """NVIDIA's plugin and GFD read one file: GFD's block and the plugin's own CDI and discovery keys are
    part of the format (NVIDIA's example config has flags.gfd), so they load; import-config says why each
    sets nothing."""
    text = (
        "version: v1\nflags:\n  useNodeFeatureAPI: true\n  deviceDiscoveryStrategy: auto\n"
        "  restartOnDeviceUnhealthy: false\n  plugin:\n    nvidiaCTKPath: /usr/bin/nvidia-ctk\n"
        "    cdiFeatureFlags: ''\n  gfd:\n    oneshot: false\n"
        "    machineTypeFile: /sys/class/dmi/id/product_name\n"
    )
    host, path = nvidia(tmp_path, text)
    assert load_config(host, config_path=path, env={}) == PluginConfig()
    out = render(text, path)
    assert "# flags.gfd.machineTypeFile (line 11): GPU feature discovery's settings" in out
    assert "# flags.plugin.nvidiaCTKPath (line 7): the nvidia-ctk" in out
    assert "# flags.deviceDiscoveryStrategy (line 4): gpunode finds the GPUs through NVML" in out


def test_kubelet_socket_names_the_socket_directory(tmp_path: Path) -> None:
    host, path = nvidia(
        tmp_path,
        "version: v1\nflags:\n  plugin:\n"
        "    kubeletSocket: /var/lib/k0s/kubelet/device-plugins/kubelet.sock\n",
    )
    config = load_config(host, config_path=path, env={})
    assert config.socket_dir == "/var/lib/k0s/kubelet/device-plugins"
    assert config.origins["socket_dir"] == "file /config.yaml (flags.plugin.kubeletSocket)"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "version: v1\nflags:\n  plugin:\n    kubeletSocket: /run/kubelet\n",
            "not an absolute path to kubelet.sock",
        ),
        ("version: v1\nflags:\n  deviceDiscoveryStrategy: tegra\n", r"'tegra' is not supported by gpunode"),
        (
            "version: v1\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n",
            "gpunode gives an MPS container one replica",
        ),
    ],
)
def test_nvidia_settings_gpunode_cannot_honour_are_refused(tmp_path: Path, text: str, problem: str) -> None:
    host, path = nvidia(tmp_path, text)
    with pytest.raises(ConfigError, match=problem):
        load_config(host, config_path=path, env={})


def test_json_indented_with_tabs_is_read_as_nvidias_reader_reads_it(tmp_path: Path) -> None:
    text = (
        '{\n\t"version": "v1",\n\t"sharing": {\n\t\t"timeSlicing": {\n\t\t\t"resources": '
        '[{"name": "nvidia.com/gpu", "replicas": 3}]\n\t\t}\n\t},\n\t"flags": {"migStrategi": "none"}\n}\n'
    )
    host, path = nvidia(tmp_path, text.replace("migStrategi", "migStrategy"), "config.json")
    assert served(load_config(host, config_path=path, env={}), "pcie-4") == {"nvidia.com/gpu": (12, 3)}
    host, path = nvidia(tmp_path, text, "typo.json")
    with pytest.raises(ConfigError, match=r"line 8: unknown key flags\.migStrategi"):
        load_config(host, config_path=path, env={})  # lines still count as in the file


def test_null_values_leave_nvidias_defaults(tmp_path: Path) -> None:
    host, path = nvidia(
        tmp_path, "version: v1\nflags:\n  migStrategy: null\n  nvidiaDriverRoot:\n  plugin: ~\n"
    )
    assert load_config(host, config_path=path, env={}) == PluginConfig()


def test_yaml_merge_keys_are_resolved_and_what_they_bring_is_checked(tmp_path: Path) -> None:
    text = (
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - &shared {name: nvidia.com/mig-1g.10gb, replicas: 2, devices: all}\n"
        "    - <<: *shared\n      name: nvidia.com/mig-2g.20gb\n      rename: mig-medium\n"
    )
    host, path = nvidia(tmp_path, text)
    config = load_config(host, config_path=path, env={})
    assert [e.as_dict() for e in config.shared_resources] == [
        {"name": "nvidia.com/mig-1g.10gb", "replicas": 2},
        {"name": "nvidia.com/mig-2g.20gb", "replicas": 2, "rename": "mig-medium"},
    ]
    host, path = nvidia(tmp_path, "version: v1\nbase: &b {replica: 2}\n")
    with pytest.raises(ConfigError, match="unknown key base"):
        load_config(host, config_path=path, env={})
    host, path = nvidia(
        tmp_path,
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - <<: {name: gpu, replica: 2}\n"
        "      replicas: 2\n",
    )
    with pytest.raises(ConfigError, match=r"unknown key sharing\.timeSlicing\.resources\[0\]\.replica "):
        load_config(host, config_path=path, env={})


def test_toml_that_is_broken_is_still_a_toml_error(tmp_path: Path) -> None:
    host, path = nvidia(tmp_path, 'resource-name = "x\n', "plugin.toml")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(host, config_path=path, env={})


# -- precedence: flag > environment > NVIDIA's file -----------------------------------------------------


def test_flags_and_environment_win_over_the_nvidia_file(tmp_path: Path) -> None:
    host, path = nvidia(
        tmp_path, "version: v1\nflags:\n  migStrategy: single\n  plugin:\n    deviceIDStrategy: index\n"
    )
    config = load_config(
        host,
        config_path=path,
        env={"GPUNODE_MIG_STRATEGY": "mixed", "GPUNODE_DEVICE_ID_STRATEGY": "uuid"},
        flags={"device_id_strategy": "index"},
    )
    assert config.mig_strategy == "mixed" and config.origins["mig_strategy"] == "env GPUNODE_MIG_STRATEGY"
    assert config.device_id_strategy == "index"
    assert config.origins["device_id_strategy"] == "flag --device-id-strategy"


def test_per_resource_entries_from_the_environment_as_json(tmp_path: Path) -> None:
    host, path = fixture(tmp_path, "time-slicing.yaml")
    env = {"GPUNODE_TIME_SLICING_RESOURCES": '[{"name": "nvidia.com/gpu", "replicas": 2, "devices": 1}]'}
    config = load_config(host, config_path=path, env=env)
    assert config.shared_resources == (SharedResource("nvidia.com/gpu", 2, devices=1),)
    # Without a rename, the first GPU's 2 replicas and the 3 other GPUs are one resource (NVIDIA's rule).
    assert served(config, "pcie-4") == {"nvidia.com/gpu": (5, 2)}


# -- Allocate: GDS, MOFED, GDRCopy, IMEX, the CDI annotation prefix -------------------------------------


def gpu_resource() -> Resource:
    [resource] = build_resources(simulated_inventory("pcie-4"))
    return resource


def answer(settings: AllocateSettings) -> tuple[dict[str, str], list[tuple[str, str, bool]], list[str]]:
    resource = gpu_resource()
    registry = DeviceRegistry([resource])
    [container] = allocate(resource, [[resource.devices[1].id]], registry.health_of, settings)
    return container.envs, list(container.mounts), [p for p, _, _ in container.devices]


def test_gds_mofed_gdrcopy_environment_whatever_the_strategy() -> None:
    extra = {"NVIDIA_GDS": "enabled", "NVIDIA_MOFED": "enabled", "NVIDIA_GDRCOPY": "enabled"}
    for strategies in (("envvar",), ("cdi-cri",)):
        envs, _, _ = answer(AllocateSettings(device_list_strategy=strategies, extra_envs=extra))
        assert {k: envs[k] for k in extra} == extra


def test_imex_channels_as_nvidia_passes_them() -> None:
    nodes = DeviceNodes(driver_root="/run/nvidia/driver", imex_channels=("0",))
    settings = AllocateSettings(device_list_strategy=("envvar",), pass_device_specs=True, nodes=nodes)
    envs, _, devices = answer(settings)
    assert envs["NVIDIA_IMEX_CHANNELS"] == "0"
    assert "/dev/nvidia-caps-imex-channels/channel0" in devices
    _, mounts, _ = answer(AllocateSettings(device_list_strategy=("volume-mounts",), nodes=nodes))
    assert ("/var/run/nvidia-container-devices/imex/0", "/dev/null", True) in mounts
    envs, _, devices = answer(AllocateSettings(device_list_strategy=("envvar",)))
    assert "NVIDIA_IMEX_CHANNELS" not in envs and not devices


def test_cdi_annotation_prefix() -> None:
    resource = gpu_resource()
    registry = DeviceRegistry([resource])
    settings = AllocateSettings(
        device_list_strategy=("cdi-annotations",), annotation_prefix="cdi.example.com/"
    )
    [container] = allocate(resource, [[resource.devices[0].id]], registry.health_of, settings)
    [(key, value)] = container.annotations.items()
    assert key.startswith("cdi.example.com/gpunode_") and value == f"nvidia.com/gpu={resource.devices[0].id}"


def test_imex_channel_found_skipped_or_required(tmp_path: Path) -> None:
    host = Host(root=tmp_path, env={})
    resources = [gpu_resource()]
    assert read_device_nodes(host, "/", resources, imex_channel_ids=[0]).imex_channels == ()
    with pytest.raises(ConfigError, match=r"channel0 does not exist.*imex\.required"):
        read_device_nodes(host, "/", resources, imex_channel_ids=[0], imex_required=True)
    channel = tmp_path / "dev/nvidia-caps-imex-channels/channel0"
    channel.parent.mkdir(parents=True)
    channel.write_text("")  # a plain file is not the channel's device node
    assert read_device_nodes(host, "/", resources, imex_channel_ids=[0]).imex_channels == ()
    channel.unlink()
    try:
        os.mknod(channel, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.fail("creating a character device needs CAP_MKNOD; the test machine has it")
    nodes = read_device_nodes(host, "/", resources, imex_channel_ids=[0], imex_required=True)
    assert nodes.imex_channels == ("0",)


# -- import-config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOADABLE)
def test_import_config_round_trip(tmp_path: Path, name: str) -> None:
    host, path = fixture(tmp_path, name)
    text = render((FIXTURES / name).read_text(), path)
    tomllib.loads(text)  # valid TOML
    (tmp_path / "gpunode.toml").write_text(text)
    assert load_config(host, config_path="/gpunode.toml", env={}) == load_config(
        host, config_path=path, env={}
    )
    # One comment per translated key: every NVIDIA key that set something is named.
    for line in text.splitlines():
        if " = " in line:
            assert "  # from NVIDIA's " in line and "(line " in line


def test_import_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host, path = fixture(tmp_path, "time-slicing-rename.yaml")
    assert main(["plugin", "import-config", path], host=host) == 0
    out = capsys.readouterr().out
    assert "rename-by-default = true  # from NVIDIA's sharing.timeSlicing.renameByDefault (line 4)" in out
    assert tomllib.loads(out)["time-slicing"]["resources"] == [{"name": "nvidia.com/gpu", "replicas": 10}]

    assert main(["plugin", "import-config", "/missing.yaml"], host=host) == ExitCode.NOT_FOUND
    (tmp_path / "gpunode.toml").write_text('mig-strategy = "mixed"\n')
    assert main(["plugin", "import-config", "/gpunode.toml"], host=host) == ExitCode.CONFIG
    assert "is not NVIDIA's device-plugin config" in capsys.readouterr().err
    host, path = fixture(tmp_path, "mps.yaml")
    assert main(["plugin", "import-config", path], host=host) == 0
    assert tomllib.loads(capsys.readouterr().out)["mps"]["resources"] == [
        {"name": "nvidia.com/gpu", "replicas": 10}
    ]
    # A file the plugin refuses as a whole gets no TOML either (exit 4, the plugin's message).
    text = (FIXTURES / "mps.yaml").read_text() + "flags:\n  migStrategy: mixed\n"
    host, path = nvidia(tmp_path, text, "mps-mig.yaml")
    assert main(["plugin", "import-config", path], host=host) == ExitCode.CONFIG
    captured = capsys.readouterr()
    assert captured.out == "" and "MPS shares whole GPUs only" in captured.err


def test_install_turns_the_nvidia_file_into_gpunode_toml(tmp_path: Path) -> None:
    from gpunode.systemd.service import CONFIG_PATH, plan_install

    gpunode_in(tmp_path)

    host, path = fixture(tmp_path, "time-slicing.yaml")
    plan = plan_install(host, config_file=path, start=False, executable="/usr/local/bin/gpunode")
    [config] = [f for f in plan.files if f.path == CONFIG_PATH]
    assert tomllib.loads(config.content)["time-slicing"]["resources"][0]["replicas"] == 10


@pytest.mark.parametrize(
    ("root", "executable", "refused"),
    [
        ("/tmp/nvidia-mps", "/usr/local/bin/gpunode", "PrivateTmp=yes"),  # MPS's own default pipe dir
        ("/root/mps", "/usr/local/bin/gpunode", "ProtectHome=yes"),
        ("/etc/mps", "/usr/local/bin/gpunode", "ProtectSystem=full"),
        ("/run/nvidia/mps", "/usr/local/bin/gpunode", None),
        ("/var/lib/mps", "/usr/local/bin/gpunode", None),
        ("/tmp/nvidia-mps", "/tmp/venv/bin/gpunode", None),  # the unit relaxes PrivateTmp for this one
    ],
)
def test_install_refuses_an_mps_root_the_unit_hides_from_pods(
    tmp_path: Path, root: str, executable: str, refused: str | None
) -> None:
    from gpunode.systemd.service import plan_install

    gpunode_in(tmp_path)

    shared = MPS_ONE.split("\n", 1)[1].replace("replicas: 1", "replicas: 2")
    host, path = nvidia(tmp_path, f"version: v1\nflags:\n  mpsRoot: {root}\n{shared}")
    if refused is None:
        plan_install(host, config_file=path, start=False, executable=executable)
        return
    with pytest.raises(ConfigError) as err:
        plan_install(host, config_file=path, start=False, executable=executable)
    assert f"mps.root {root}" in err.value.message and refused in err.value.message
    assert "/run/nvidia/mps" in (err.value.fix or "")
    # Without MPS sharing the root is never used, and nothing is refused.
    host, path = nvidia(tmp_path, f"version: v1\nflags:\n  mpsRoot: {root}\n")
    plan_install(host, config_file=path, start=False, executable=executable)


def test_install_checks_the_mps_root_the_units_environment_file_sets(tmp_path: Path) -> None:
    from gpunode.systemd.service import plan_install

    gpunode_in(tmp_path)

    shared = MPS_ONE.split("\n", 1)[1].replace("replicas: 1", "replicas: 2")
    host, path = nvidia(tmp_path, f"version: v1\n{shared}")
    env_file = tmp_path / "etc/default/gpunode-device-plugin"
    env_file.parent.mkdir(parents=True)
    env_file.write_text("# set by hand\nGPUNODE_MPS_ROOT='/tmp/nvidia-mps'  # MPS's own default\n")
    with pytest.raises(ConfigError, match=r"mps\.root /tmp/nvidia-mps lies under /tmp"):
        plan_install(host, config_file=path, start=False, executable="/usr/local/bin/gpunode")
    env_file.write_text("GPUNODE_MPS_ROOT=/run/mps\n")
    plan_install(host, config_file=path, start=False, executable="/usr/local/bin/gpunode")
    # NVIDIA's own variable, copied from a DaemonSet, is read and checked the same way.
    env_file.write_text("MPS_ROOT=/tmp/nvidia-mps\n")
    with pytest.raises(ConfigError, match=r"mps\.root /tmp/nvidia-mps lies under /tmp"):
        plan_install(host, config_file=path, start=False, executable="/usr/local/bin/gpunode")


@pytest.mark.parametrize("variable", ["CONFIG_FILE", "GPUNODE_PLUGIN_CONFIG"])
def test_install_refuses_an_environment_file_that_names_another_config(tmp_path: Path, variable: str) -> None:
    """The unit runs `plugin run` without --config: a config named in its environment file would be read
    instead of the one plugin install writes."""
    from gpunode.systemd.service import plan_install

    gpunode_in(tmp_path)

    host, path = nvidia(tmp_path, "version: v1\nflags:\n  migStrategy: single\n")
    env_file = tmp_path / "etc/default/gpunode-device-plugin"
    env_file.parent.mkdir(parents=True)
    env_file.write_text(f"{variable}=/etc/nvidia/dp.yaml\n")
    with pytest.raises(ConfigError) as info:
        plan_install(host, config_file=path, start=False, executable="/usr/local/bin/gpunode")
    assert f"sets {variable}=/etc/nvidia/dp.yaml: the service would read that file" in info.value.message
    assert f"remove {variable} from /etc/default/gpunode-device-plugin" in (info.value.fix or "")
    env_file.write_text(f"{variable}=/etc/gpunode/plugin.toml\n")  # the installed file itself: fine
    plan_install(host, config_file=path, start=False, executable="/usr/local/bin/gpunode")


def test_install_judges_only_the_config_variable_plugin_run_takes(tmp_path: Path) -> None:
    from gpunode.systemd.service import plan_install

    gpunode_in(tmp_path)

    host, path = nvidia(tmp_path, "version: v1\n")
    env_file = tmp_path / "etc/default/gpunode-device-plugin"
    env_file.parent.mkdir(parents=True)
    # $GPUNODE_PLUGIN_CONFIG wins over NVIDIA's $CONFIG_FILE: the service reads the installed file.
    env_file.write_text("GPUNODE_PLUGIN_CONFIG=/etc/gpunode/plugin.toml\nCONFIG_FILE=/etc/nvidia/dp.yaml\n")
    plan_install(host, config_file=path, start=False, executable="/usr/local/bin/gpunode")


def test_advertise_reads_sharing_from_an_installed_nvidia_file(tmp_path: Path) -> None:
    from gpunode.advertise import plugin_sharing
    from gpunode.kube.labels import Sharing as LabelSharing

    target = tmp_path / "etc/gpunode/plugin.toml"
    target.parent.mkdir(parents=True)
    target.write_text((FIXTURES / "time-slicing-rename.yaml").read_text())
    assert plugin_sharing(Host(root=tmp_path, env={})) == LabelSharing(replicas=10, rename_by_default=True)
    target.write_text((FIXTURES / "time-slicing-devices.json").read_text())
    assert plugin_sharing(Host(root=tmp_path, env={})) == LabelSharing(replicas=4, rename_by_default=True)
    target.write_text((FIXTURES / "mps.yaml").read_text())
    assert plugin_sharing(Host(root=tmp_path, env={})) == LabelSharing(replicas=10, mps=True)
    # Only MIG profiles shared: GFD's gpu.* labels speak of nvidia.com/gpu alone, so 1 and none.
    target.write_text(
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - {name: nvidia.com/mig-1g.5gb, replicas: 2}\n"
    )
    assert plugin_sharing(Host(root=tmp_path, env={})) == LabelSharing()
    target.write_text(
        "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/other, replicas: 2}\n"
    )
    assert plugin_sharing(Host(root=tmp_path, env={})) == LabelSharing(mps=True)


def test_an_entry_for_a_resource_the_node_lacks_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gpunode.plugin.lifecycle import _warn_unused_sharing

    config = load(tmp_path, "mig-mixed-sharing.yaml")
    resources = build_resources(
        simulated_inventory("pcie-4"),
        mig_strategy="mixed",
        sharing=Sharing(resources=config.shared_resources),
    )
    with caplog.at_level("WARNING", logger="gpunode.plugin"):
        _warn_unused_sharing(config, resources)
    assert [r.getMessage().split(" is not")[0] for r in caplog.records] == [
        "time-slicing.resources: nvidia.com/mig-1g.5gb",
        "time-slicing.resources: nvidia.com/mig-2g.10gb",
    ]


def test_imex_cdi_names_with_the_cdi_strategies() -> None:
    nodes = DeviceNodes(imex_channels=("0",), imex_cdi=("nvidia.com/imex-channel=0",))
    resource = gpu_resource()
    registry = DeviceRegistry([resource])
    settings = AllocateSettings(device_list_strategy=("cdi-cri", "cdi-annotations"), nodes=nodes)
    [container] = allocate(resource, [[resource.devices[0].id]], registry.health_of, settings)
    assert container.cdi_devices[-1] == "nvidia.com/imex-channel=0"
    assert container.annotations["cdi.k8s.io/gpunode_imex-channel-0"] == "nvidia.com/imex-channel=0"


@pytest.mark.parametrize("name", LOADABLE)
def test_show_config_of_an_nvidia_file_reads_back_the_same(tmp_path: Path, name: str) -> None:
    from gpunode.plugin.config import to_toml

    config = load(tmp_path, name)
    text = to_toml(config)
    assert f"# from: file /{name} (" in text  # each value names the NVIDIA key it came from
    (tmp_path / "shown.toml").write_text(text)
    assert load_config(Host(root=tmp_path, env={}), config_path="/shown.toml", env={}) == config


@pytest.mark.parametrize(
    ("name", "resource"),
    [
        ("time-slicing.yaml", "nvidia.com/gpu"),
        ("time-slicing-rename.yaml", "nvidia.com/gpu.shared"),
        ("mps.yaml", "nvidia.com/gpu"),
        ("flags.yaml", "nvidia.com/gpu"),
    ],
)
def test_the_advertised_resource_follows_the_sharing_rename(tmp_path: Path, name: str, resource: str) -> None:
    from gpunode.advertise import plugin_resource

    target = tmp_path / "etc/gpunode/plugin.toml"
    target.parent.mkdir(parents=True)
    target.write_text((FIXTURES / name).read_text())
    assert plugin_resource(Host(root=tmp_path, env={})) == resource


def test_the_advertised_resource_with_an_mps_rename(tmp_path: Path) -> None:
    from gpunode.advertise import plugin_resource

    target = tmp_path / "etc/gpunode/plugin.toml"
    target.parent.mkdir(parents=True)
    target.write_text('[mps]\nresources = [{name = "nvidia.com/gpu", replicas = 2, rename = "gpu-mps"}]\n')
    assert plugin_resource(Host(root=tmp_path, env={})) == "nvidia.com/gpu-mps"


# -- NVIDIA's environment variables ---------------------------------------------------------------------

# Every variable NVIDIA's command line reads (its flags' EnvVars) that sets something, spelled as its Helm
# chart or a DaemonSet would: Go's boolean spellings, comma-separated lists.
NVIDIA_ENV = {
    "MIG_STRATEGY": "mixed",
    "FAIL_ON_INIT_ERROR": "F",
    "NVIDIA_DRIVER_ROOT": "/run/nvidia/driver",
    "NVIDIA_DEV_ROOT": "/",
    "PASS_DEVICE_SPECS": "t",
    "DEVICE_LIST_STRATEGY": "envvar,volume-mounts",
    "DEVICE_ID_STRATEGY": "index",
    "GDS_ENABLED": "true",
    "MOFED_ENABLED": "1",
    "GDRCOPY_ENABLED": "TRUE",
    "KUBELET_SOCKET": "/var/lib/kubelet/plugins-k/kubelet.sock",
    "CDI_ANNOTATION_PREFIX": "cdi.example.com/",
    "MPS_ROOT": "/run/nvidia/mps-2",
    "IMEX_CHANNEL_IDS": "0",
    "IMEX_REQUIRED": "True",
}


def test_nvidias_environment_variables_set_their_options(tmp_path: Path) -> None:
    config = load_config(Host(root=tmp_path, env={}), env=NVIDIA_ENV)
    assert config.mig_strategy == "mixed" and config.fail_on_init_error is False
    assert config.driver_root == "/run/nvidia/driver" and config.dev_root == "/"
    assert config.pass_device_specs is True
    assert config.device_list_strategy == ("envvar", "volume-mounts")
    assert config.device_id_strategy == "index"
    assert config.gds_enabled and config.mofed_enabled and config.gdrcopy_enabled
    assert config.socket_dir == "/var/lib/kubelet/plugins-k"  # the directory of the kubelet.sock named
    assert config.cdi_annotation_prefix == "cdi.example.com/"
    assert config.mps_root == "/run/nvidia/mps-2"
    assert config.imex_channel_ids == (0,) and config.imex_required is True
    assert config.origins["mig_strategy"] == "env MIG_STRATEGY"
    assert config.origins["socket_dir"] == "env KUBELET_SOCKET"


def test_nvidias_variables_rank_above_the_file_and_below_gpunodes_own_and_flags(tmp_path: Path) -> None:
    host, path = nvidia(tmp_path, "version: v1\nflags:\n  migStrategy: single\n  failOnInitError: true\n")
    env = {"MIG_STRATEGY": "mixed", "FAIL_ON_INIT_ERROR": "false"}
    config = load_config(host, config_path=path, env=env)
    assert (config.mig_strategy, config.origins["mig_strategy"]) == ("mixed", "env MIG_STRATEGY")
    config = load_config(host, config_path=path, env={**env, "GPUNODE_MIG_STRATEGY": "none"})
    assert (config.mig_strategy, config.origins["mig_strategy"]) == ("none", "env GPUNODE_MIG_STRATEGY")
    config = load_config(host, config_path=path, env=env, flags={"mig_strategy": "single"})
    assert config.mig_strategy == "single" and config.fail_on_init_error is False
    # Empty is unset, as for gpunode's own variables: the file's value stands.
    config = load_config(host, config_path=path, env={"MIG_STRATEGY": ""})
    assert config.mig_strategy == "single"


def test_nvidias_integer_and_alias_spellings_are_read_as_its_command_line_reads_them(tmp_path: Path) -> None:
    host = Host(root=tmp_path, env={})
    for spelled in ("0", "00", "0x0", "0o0", " 0 "):
        assert load_config(host, env={"IMEX_CHANNEL_IDS": spelled}).imex_channel_ids == (0,), spelled
    # Of two names for one flag the first one set wins (urfave/cli): the second is not even read.
    env = {"DRIVER_ROOT_CTR_PATH": "/driver-root", "CONTAINER_DRIVER_ROOT": "relative"}
    assert load_config(host, env=env) == PluginConfig()
    with pytest.raises(ConfigError, match="env CONTAINER_DRIVER_ROOT"):
        load_config(host, env={"CONTAINER_DRIVER_ROOT": "relative"})


def test_nvidias_variables_with_no_effect_are_checked_and_change_nothing(tmp_path: Path) -> None:
    env = {
        "NVIDIA_CTK_PATH": "/usr/bin/nvidia-ctk",
        "NVIDIA_CDI_HOOK_PATH": "/usr/bin/nvidia-cdi-hook",
        "CONTAINER_DRIVER_ROOT": "/driver-root",
        "DRIVER_ROOT_CTR_PATH": "/driver-root",
        "CDI_FEATURE_FLAGS": "disable-multiple-csv-devices",
        "DEVICE_DISCOVERY_STRATEGY": "nvml",
        "RESTART_ON_DEVICE_UNHEALTHY": "false",
        "RESOURCE_NAME_PREFIX": "nvidia.com",
    }
    assert load_config(Host(root=tmp_path, env={}), env=env) == PluginConfig()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DEVICE_DISCOVERY_STRATEGY": "tegra"}, "env DEVICE_DISCOVERY_STRATEGY: 'tegra' is not supported"),
        ({"FAIL_ON_INIT_ERROR": "maybe"}, "env FAIL_ON_INIT_ERROR: 'maybe' is not a boolean"),
        ({"KUBELET_SOCKET": "kubelet.sock"}, "env KUBELET_SOCKET: 'kubelet.sock' is not an absolute path"),
        ({"CONTAINER_DRIVER_ROOT": "driver"}, "env CONTAINER_DRIVER_ROOT: 'driver' is not an absolute path"),
        ({"IMEX_CHANNEL_IDS": "zero"}, "env IMEX_CHANNEL_IDS: 'zero' is not a comma-separated list"),
        ({"IMEX_CHANNEL_IDS": "1"}, "IMEX channel IDs must be [] or [0]"),
        ({"IMEX_CHANNEL_IDS": "\u00b2"}, "env IMEX_CHANNEL_IDS: '\u00b2' is not a comma-separated list"),
        ({"IMEX_CHANNEL_IDS": "0,"}, "env IMEX_CHANNEL_IDS: '0,' is not a comma-separated list"),
        ({"IMEX_CHANNEL_IDS": "\u0660"}, "env IMEX_CHANNEL_IDS: '\u0660' is not a comma-separated list"),
        ({"MIG_STRATEGY": "all"}, "env MIG_STRATEGY (flags.migStrategy): 'all' is not one of"),
        ({"DEVICE_LIST_STRATEGY": "envvar,cdi"}, "unknown device-list strategy 'cdi'"),
        ({"RESOURCE_NAME_PREFIX": "example.com"}, "env RESOURCE_NAME_PREFIX: 'example.com'"),
    ],
    ids=[
        "tegra",
        "bool",
        "socket",
        "ctr-root",
        "imex-text",
        "imex-1",
        "imex-superscript",
        "imex-empty-item",
        "imex-arabic-indic-zero",
        "mig",
        "list",
        "prefix",
    ],
)
def test_a_bad_nvidia_variable_is_refused_by_name(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Host(root=tmp_path, env={}), env=env)
    assert message in info.value.message, info.value.message
    assert info.value.fix, f"no fix for {info.value.message}"
    assert info.value.exit_code == ExitCode.CONFIG


def test_config_file_names_nvidias_file_below_gpunodes_variable(tmp_path: Path) -> None:
    host, path = fixture(tmp_path, "time-slicing.yaml")
    config = load_config(host, env={"CONFIG_FILE": path})
    assert config.shared_resources == (SharedResource("nvidia.com/gpu", 10),)
    assert config.origins["shared_resources"] == f"file {path} (sharing.timeSlicing.resources)"
    (tmp_path / "own.toml").write_text("[time-slicing]\nreplicas = 2\n")
    config = load_config(host, env={"CONFIG_FILE": path, "GPUNODE_PLUGIN_CONFIG": "/own.toml"})
    assert config.replicas == 2 and config.shared_resources == ()
    with pytest.raises(NotFound) as info:
        load_config(host, env={"CONFIG_FILE": "/missing.yaml"})
    assert info.value.message == "plugin config /missing.yaml does not exist (given by $CONFIG_FILE)"
    assert info.value.fix == "create it, or unset CONFIG_FILE"


def test_show_config_names_nvidias_variable_as_the_origin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MIG_STRATEGY", "mixed")
    monkeypatch.setenv("PASS_DEVICE_SPECS", "t")
    code = main(["plugin", "run", "--show-config"], host=Host(root=tmp_path, env={}))
    out = capsys.readouterr().out
    assert code == ExitCode.OK
    assert 'mig-strategy = "mixed"  # from: env MIG_STRATEGY' in out.splitlines()
    assert "pass-device-specs = true  # from: env PASS_DEVICE_SPECS" in out.splitlines()


def test_a_huge_imex_channel_value_is_quoted_short(tmp_path: Path) -> None:
    # The error echoed the whole 5,000-digit value.
    with pytest.raises(ConfigError) as caught:
        load_config(Host(root=tmp_path, env={}), env={"GPUNODE_IMEX_CHANNEL_IDS": "9" * 5000})
    message = caught.value.message
    assert "IMEX channel IDs must be [] or [0]" in message and "(5002 characters)" in message
    assert len(message) < 300
