"""The plugin's settings: file, environment and flags, their precedence, and the errors they give."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.errors import ConfigError, NotFound
from gpunode.host import Host
from gpunode.plugin.config import (
    DEFAULT_CONFIG,
    OPTIONS,
    PluginConfig,
    describe,
    load_config,
    resource_name_problem,
)
from gpunode.plugin.devices import NamedResource, SharedResource
from gpunode.plugin.health import APPLICATION_XIDS
from tests.integration.kubelet import is_valid_extended_resource_name

FULL = """\
# every option gpunode's plugin has
resource-name = "example.com/accel"
mig-strategy = "mixed"
device-list-strategy = ["envvar", "cdi-cri"]
device-id-strategy = "index"
pass-device-specs = true
pre-start-required = true
fail-on-init-error = false
driver-root = "/run/nvidia/driver"
socket-dir = "/tmp/dp"
cdi-kind = "example.com/accel"
dev-root = "/run/nvidia/dev"
cdi-annotation-prefix = "cdi.example.com/"
gds-enabled = true
mofed-enabled = true
gdrcopy-enabled = true
node-name = "gpu-node-7"

[time-slicing]
replicas = 4
rename-by-default = true
fail-requests-greater-than-one = true
placement = "packed"
resources = [{name = "example.com/a100", replicas = 2, devices = [0, "1:0"], rename = "a100-shared"}]

[resources]
gpus = [{pattern = "*A100*", name = "a100"}]
mig = [{pattern = "1g.10gb", name = "mig-small"}]

[imex]
channel-ids = [0]
required = true

[health]
enabled = true
ignored-xids = [13, 31]
critical-xids = [43]
recovery-quiet-period = 5

[mps]  # MPS instead of time-slicing: a control daemon per shared resource (none shared here)
resources = []
root = "/run/gpunode/mps"
active-thread-percentage = 30
pinned-memory-limit = "8G"

[metrics]
address = "127.0.0.1:9402"

[events]
enabled = false
kubeconfig = "/etc/kubernetes/node.conf"
"""


def host_with(tmp_path: Path, text: str | None, path: str = DEFAULT_CONFIG) -> Host:
    if text is not None:
        target = tmp_path / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return Host(root=tmp_path, env={})


def test_defaults_without_a_file(tmp_path: Path) -> None:
    config = load_config(host_with(tmp_path, None), env={})
    assert config == PluginConfig()
    assert config.resource_name == "nvidia.com/gpu"
    assert config.device_list_strategy == ("envvar",)
    assert config.socket_dir == "/var/lib/kubelet/device-plugins"
    assert config.fail_on_init_error is True
    assert config.health.ignored_xids == APPLICATION_XIDS == frozenset({13, 31, 43, 45, 68, 109})
    assert all(origin == "default" for _, _, origin in describe(config))


def test_every_option_from_the_file(tmp_path: Path) -> None:
    config = load_config(host_with(tmp_path, FULL), env={})
    assert config.resource_name == "example.com/accel"
    assert config.mig_strategy == "mixed"
    assert config.device_list_strategy == ("envvar", "cdi-cri")
    assert config.device_id_strategy == "index"
    assert config.pass_device_specs and config.pre_start_required
    assert not config.fail_on_init_error
    assert config.driver_root == "/run/nvidia/driver"
    assert config.socket_dir == "/tmp/dp"
    assert config.cdi_kind == "example.com/accel"
    assert (config.replicas, config.rename_by_default, config.fail_requests_greater_than_one) == (
        4,
        True,
        True,
    )
    assert config.placement == "packed"
    assert config.shared_resources == (SharedResource("example.com/a100", 2, "a100-shared", ("0", "1:0")),)
    assert config.gpu_resources == (NamedResource("*A100*", "a100"),)
    assert config.mig_resources == (NamedResource("1g.10gb", "mig-small"),)
    assert (config.dev_root, config.cdi_annotation_prefix) == ("/run/nvidia/dev", "cdi.example.com/")
    assert config.gds_enabled and config.mofed_enabled and config.gdrcopy_enabled
    assert (config.imex_channel_ids, config.imex_required) == ((0,), True)
    assert (config.mps_resources, config.mps_root) == ((), "/run/gpunode/mps")
    assert (config.mps_active_thread_percentage, config.mps_pinned_memory_limit) == (30, 8192)
    assert config.health.ignored_xids == {13, 31}
    assert config.health.critical_xids == {43}
    assert config.health.recovery_quiet_period == 5.0
    assert (config.metrics_address, config.events_enabled) == ("127.0.0.1:9402", False)
    assert (config.events_kubeconfig, config.node_name) == ("/etc/kubernetes/node.conf", "gpu-node-7")
    # Every option in the table is in the example, so the README's example stays complete.
    assert {o.key for o in OPTIONS} == {
        key for key, _, origin in describe(config) if origin.startswith("file")
    }


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    host = host_with(tmp_path, 'mig-strategy = "single"\n[time-slicing]\nreplicas = 2\n')
    env = {"GPUNODE_MIG_STRATEGY": "mixed", "GPUNODE_REPLICAS": "3"}
    config = load_config(host, env=env, flags={"replicas": 8, "mig_strategy": None})
    assert config.mig_strategy == "mixed"  # env over file; the flag was not given
    assert config.replicas == 8  # flag over env
    origins = {key: origin for key, _, origin in describe(config)}
    assert origins["mig-strategy"] == "env GPUNODE_MIG_STRATEGY"
    assert origins["time-slicing.replicas"] == "flag --replicas"
    assert origins["resource-name"] == "default"


def test_explicit_config_path_and_env_variable(tmp_path: Path) -> None:
    host = host_with(tmp_path, 'resource-name = "a.example/x"\n', "/srv/p.toml")
    assert load_config(host, config_path="/srv/p.toml", env={}).resource_name == "a.example/x"
    assert load_config(host, env={"GPUNODE_PLUGIN_CONFIG": "/srv/p.toml"}).resource_name == "a.example/x"
    with pytest.raises(NotFound, match=r"/srv/missing\.toml does not exist"):
        load_config(host, config_path="/srv/missing.toml", env={})


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    text = 'resource-name = "nvidia.com/gpu"\nmigStrategy = "none"\n'
    text += "[time-slicing]\nreplica = 2\n[extra]\na = 1\n"
    with pytest.raises(ConfigError) as err:
        load_config(host_with(tmp_path, text), env={})
    assert "migStrategy" in err.value.message
    assert "time-slicing.replica" in err.value.message
    assert "extra" in err.value.message
    assert err.value.fix and "resource-name" in err.value.fix


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('mig-strategy = "some"\n', "mig-strategy"),
        ('device-list-strategy = "env"\n', "unknown device-list strategy 'env'"),
        ("device-id-strategy = 3\n", "device-id-strategy"),
        ("pass-device-specs = 1\n", "not a boolean"),
        ('driver-root = "run/nvidia"\n', "not an absolute path"),
        ("[time-slicing]\nreplicas = 0\n", "at least 1"),
        ('[health]\nignored-xids = ["x"]\n', "not an Xid number"),
        ('[health]\nrecovery-quiet-period = "soon"\n', "not a number of seconds"),
        ('resource-name = "kubernetes.io/gpu"\n', "reserved by Kubernetes"),
        ('resource-name = "gpu"\n', "must be <domain>/<name>"),
        ("resource-name = [\n", "not valid TOML"),
    ],
)
def test_bad_values_name_the_key_and_the_file(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(host_with(tmp_path, text), env={})
    assert expected in err.value.message
    assert DEFAULT_CONFIG in err.value.message


def test_bad_env_and_flag_values_name_their_source_once(tmp_path: Path) -> None:
    host = host_with(tmp_path, None)
    with pytest.raises(ConfigError) as err:
        load_config(host, env={"GPUNODE_REPLICAS": "many"})
    assert err.value.message == "env GPUNODE_REPLICAS: 'many' is not a whole number of at least 1"
    with pytest.raises(ConfigError) as err:
        load_config(host, env={}, flags={"mig_strategy": "all"})
    assert err.value.message == "flag --mig-strategy: 'all' is not one of: none, single, mixed"


def test_renamed_shared_resource_must_stay_valid(tmp_path: Path) -> None:
    name = "example.com/" + "g" * 60
    with pytest.raises(ConfigError, match="rename-by-default"):
        load_config(host_with(tmp_path, None), env={}, flags={"resource_name": name, "replicas": 2,
                                                              "rename_by_default": True})  # fmt: skip


def test_nvidia_health_variables_sit_at_the_environment_level(tmp_path: Path) -> None:
    host = host_with(tmp_path, "[health]\nenabled = true\n")
    off = load_config(host, env={"DP_DISABLE_HEALTHCHECKS": "all"})
    assert off.health.enabled is False
    # Our own flag is above the environment.
    assert load_config(
        host, env={"DP_DISABLE_HEALTHCHECKS": "all"}, flags={"health.enabled": True}
    ).health.enabled
    more = load_config(host, env={"DP_DISABLE_HEALTHCHECKS": "79"})
    assert 79 in more.health.ignored_xids and more.health.ignored_xids >= APPLICATION_XIDS


NAMES = [
    "nvidia.com/gpu",
    "nvidia.com/gpu.shared",
    "nvidia.com/mig-1g.10gb",
    "example.com/a_b.c-d",
    "a.b.c/x",
    "kubernetes.io/gpu",
    "sub.kubernetes.io/gpu",
    "requests.nvidia.com/gpu",
    "nvidia.com/",
    "/gpu",
    "gpu",
    "Nvidia.com/gpu",
    "nvidia..com/gpu",
    "nvidia.com/-gpu",
    "nvidia.com/gpu-",
    "nvidia.com/g" + "p" * 61 + "u",
    "nvidia.com/" + "g" * 63,
    "nvidia.com/" + "g" * 64,
    "nvidia.com/gpu/x",
    "nvidia.com/gpu x",
]


@pytest.mark.parametrize("name", NAMES)
def test_resource_names_are_judged_like_kubelet(name: str) -> None:
    # The fake kubelet implements kubelet's own rule; gpunode must refuse exactly what kubelet refuses.
    assert (resource_name_problem(name) is None) == is_valid_extended_resource_name(name)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"GPUNODE_RESOURCE_NAME": "example.com/gpu", "GPUNODE_HEALTH_RECOVERY_QUIET_PERIOD": "2.5s"},
        {"DP_DISABLE_HEALTHCHECKS": "79,48", "DP_ENABLE_HEALTHCHECKS": "13"},
    ],
)
def test_shown_config_is_toml_that_reads_back_to_the_same_settings(
    tmp_path: Path, env: dict[str, str]
) -> None:
    from gpunode.plugin.config import to_toml
    from tests import tomlread as tomllib

    host = host_with(tmp_path, FULL, "/etc/odd\n# dir/plugin.toml")
    resolved = load_config(host, config_path="/etc/odd\n# dir/plugin.toml", env=env)
    text = to_toml(resolved)
    tomllib.loads(text)  # valid TOML, the odd path in a comment included
    # The path's newline is written \x0a: it cannot end the comment and start a key.
    assert "# from: file /etc/odd\\x0a# dir/plugin.toml" in text
    (tmp_path / "shown.toml").write_text(text)
    assert load_config(Host(root=tmp_path, env={}), config_path="/shown.toml", env={}) == resolved
    for option in OPTIONS:
        origin = resolved.origins[option.name]
        assert f"  # from: {origin.replace(chr(10), chr(92) + 'x0a')}" in text, option.key


def test_shown_strings_are_escaped_as_toml_needs(tmp_path: Path) -> None:
    from gpunode.plugin.config import to_toml
    from tests import tomlread as tomllib

    # A path setting refuses control characters (issue 23); quotes, backslashes and astral characters
    # are what it can hold that TOML must escape.
    odd = '/srv/"quoted"\\dir\U0001f600'
    resolved = load_config(Host(root=tmp_path, env={}), env={"GPUNODE_DRIVER_ROOT": odd})
    assert tomllib.loads(to_toml(resolved))["driver-root"] == odd
    # Control characters, DEL included, are still written as escapes wherever a string holds one.
    from gpunode.plugin.config import _toml_string

    control = "a\x7fb\x01c"
    assert tomllib.loads("k = " + _toml_string(control))["k"] == control
