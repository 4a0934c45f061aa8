"""CRI-O: the nvidia runtime gpunode writes, merged with the drop-ins CRI-O's packages ship, must be one
CRI-O starts and runs; and CRI-O's own view of its configuration (`crio config`, `crio status config`).

CRI-O is not packaged in Debian, so it cannot run here. The packaging drop-ins under
tests/fixtures/crio/packaging are those of cri-o/packaging (templates/latest/cri-o); the `crio config`
outputs under tests/fixtures/crio/crio-config are rendered by hand from CRI-O's template
(pkg/config/template.go: values equal to the built-in default commented out with "# "), and the
`crio status config` ones in the BurntSushi TOML encoding of the running config (server/inspect.go serves
config.ToBytes()). The rules checked are CRI-O's (pkg/config/config.go: RuntimeHandler.Validate,
TranslateMonitorFields, ValidateDefaultRuntime), in crio.config_problems; the merge below is written
independently of gpunode's, with tomllib.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpunode.doctor.checks import read_runtime_state
from gpunode.errors import CommandFailed, ConfigError, NotFound
from gpunode.host import CommandResult, Host, ScriptedRunner
from gpunode.runtimes import crio
from gpunode.runtimes.configure import apply, plan_configure, plan_revert
from gpunode.runtimes.plan import ConfigureOptions, RuntimePlan
from tests import tomlread
from tests.scriptedrunner import FakeRunner

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "crio"
NVIDIA = "/usr/bin/nvidia-container-runtime"
DROPIN = "/etc/crio/crio.conf.d/99-nvidia.toml"
# (packaging directory, files it puts in crio.conf.d, the default runtime they give)
LAYOUTS = {
    "libexec-conmon": (("libexec-conmon/10-crio.conf",), "crun"),
    "pod-conmonrs": (("pod-conmonrs/10-crio.conf",), "crun"),
    "crio-bin": (("crio-bin/10-crun.conf",), "crun"),
    "runc-default": (("libexec-conmon/10-crio.conf", "runc-default/20-runc.conf"), "runc"),
}


def put(root: Path, host_path: str, text: str, mode: int = 0o644) -> Path:
    target = root / host_path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    target.chmod(mode)
    return target


def install_layout(root: Path, layout: str) -> None:
    for name in LAYOUTS[layout][0]:
        put(root, f"/etc/crio/crio.conf.d/{Path(name).name}", (FIXTURES / "packaging" / name).read_text())


def configure(host: Host, **options: Any) -> RuntimePlan:
    plan = plan_configure(host, "crio", ConfigureOptions(**options))
    apply(host, plan, restart=False)
    return plan


def crio_merge(root: Path) -> dict[str, Any]:
    """crio.conf, then every file under crio.conf.d in filepath.Walk order, each decoded over the last:
    tables merge key by key, an entry of crio.runtime.runtimes is replaced whole."""
    files = [root / "etc/crio/crio.conf"] if (root / "etc/crio/crio.conf").is_file() else []
    dropins = root / "etc/crio/crio.conf.d"
    walked = sorted(
        (p for p in dropins.rglob("*") if p.is_file()), key=lambda p: p.relative_to(dropins).parts
    )
    merged: dict[str, Any] = {}
    for path in files + walked:
        merged = _decode_over(merged, tomlread.loads(path.read_text()), ())
    return merged


def _decode_over(base: Mapping[str, Any], top: Mapping[str, Any], at: tuple[str, ...]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        whole = at == ("crio", "runtime", "runtimes")
        if isinstance(value, dict) and isinstance(out.get(key), dict) and not whole:
            out[key] = _decode_over(out[key], value, (*at, key))
        else:
            out[key] = value
    return out


def runtimes_of(doc: Mapping[str, Any]) -> dict[str, Any]:
    runtimes: dict[str, Any] = doc["crio"]["runtime"]["runtimes"]
    return runtimes


# -- the packaging layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("as_default", [False, True])
def test_nvidia_runtime_passes_crio_rules_with_packaged_dropins(
    tmp_path: Path, layout: str, as_default: bool
) -> None:
    install_layout(tmp_path, layout)
    default = LAYOUTS[layout][1]
    configure(Host(root=tmp_path, runner=ScriptedRunner()), set_as_default=as_default)
    merged = crio_merge(tmp_path)
    assert crio.config_problems(merged) == []
    runtimes = runtimes_of(merged)
    nvidia, model = runtimes["nvidia"], runtimes[default]
    assert nvidia["runtime_path"] == NVIDIA
    # The type and its monitor come together from the default runtime: CRI-O runs "oci" with conmon and
    # "pod" with conmon-rs, and refuses (or fails every pod) when they are mixed.
    assert nvidia.get("runtime_type", "oci") == model.get("runtime_type", "oci")
    assert nvidia.get("monitor_path") == model.get("monitor_path")
    kind = crio.monitor_kind(nvidia["monitor_path"])
    assert kind == ("conmon-rs" if nvidia["runtime_type"] == "pod" else "conmon")
    assert nvidia.get("runtime_root") == model.get("runtime_root")
    assert merged["crio"]["runtime"]["default_runtime"] == ("nvidia" if as_default else default)
    assert crio.read_state(Host(root=tmp_path)).problems == ()


def test_pod_default_with_conmonrs_gives_a_pod_nvidia_runtime(tmp_path: Path) -> None:
    """The defect: a "pod" default was skipped as a model, so nvidia got runtime_type "oci" with no
    monitor_path, and CRI-O looked for "conmon" on $PATH, which packaged CRI-O does not fill: CRI-O stopped
    with "failed to translate monitor fields for runtime nvidia"."""
    install_layout(tmp_path, "pod-conmonrs")
    plan = configure(Host(root=tmp_path, runner=ScriptedRunner()), set_as_default=True)
    nvidia = runtimes_of(tomlread.loads((tmp_path / DROPIN.lstrip("/")).read_text()))["nvidia"]
    assert nvidia == {
        "runtime_path": NVIDIA,
        "runtime_type": "pod",
        "runtime_root": "/run/crun",
        "monitor_path": "/usr/libexec/crio/conmonrs",
        "allowed_annotations": ["io.containers.trace-syscall"],
    }
    assert any('runtime_type "pod" with conmon-rs /usr/libexec/crio/conmonrs' in m for m in plan.messages)


def test_settings_that_bypass_runtime_path_are_not_copied(tmp_path: Path) -> None:
    """inherit_default_runtime makes CRI-O load the default's runtime_path into the entry; a copied
    platform_runtime_paths runs crun instead of nvidia-container-runtime for linux/amd64 images."""
    put(
        tmp_path,
        "/etc/crio/crio.conf.d/10-crio.conf",
        '[crio.runtime]\ndefault_runtime = "crun"\n\n[crio.runtime.runtimes.crun]\n'
        'runtime_path = "/usr/libexec/crio/crun"\nmonitor_path = "/usr/libexec/crio/conmon"\n'
        "inherit_default_runtime = true\n"
        'platform_runtime_paths = { "linux/amd64" = "/usr/libexec/crio/crun" }\n',
    )
    configure(Host(root=tmp_path, runner=ScriptedRunner()))
    nvidia = runtimes_of(tomlread.loads((tmp_path / DROPIN.lstrip("/")).read_text()))["nvidia"]
    assert "inherit_default_runtime" not in nvidia and "platform_runtime_paths" not in nvidia
    assert nvidia["runtime_path"] == NVIDIA and nvidia["monitor_path"] == "/usr/libexec/crio/conmon"


def test_oci_runtime_gets_the_packaged_conmon_when_it_is_not_on_path(tmp_path: Path) -> None:
    """An "oci" model without monitor_path (a hand-written drop-in): CRI-O looks for conmon on $PATH only;
    packaged CRI-O keeps it in /usr/libexec/crio, so gpunode names it."""
    put(
        tmp_path,
        "/etc/crio/crio.conf.d/10-local.conf",
        '[crio.runtime]\ndefault_runtime = "crun"\n\n[crio.runtime.runtimes.crun]\n'
        'runtime_path = "/usr/libexec/crio/crun"\nruntime_type = "oci"\n',
    )
    put(tmp_path, "/usr/libexec/crio/conmon", "#!/bin/sh\n", mode=0o755)
    host = Host(root=tmp_path, runner=ScriptedRunner(), env={"PATH": "/usr/bin"})
    configure(host)
    nvidia = runtimes_of(tomlread.loads((tmp_path / DROPIN.lstrip("/")).read_text()))["nvidia"]
    assert nvidia["runtime_type"] == "oci" and nvidia["monitor_path"] == "/usr/libexec/crio/conmon"
    # conmon on $PATH: CRI-O finds it itself, nothing is added.
    (tmp_path / DROPIN.lstrip("/")).unlink()
    put(tmp_path, "/usr/bin/conmon", "#!/bin/sh\n", mode=0o755)
    records = tmp_path / "var/lib/gpunode"
    for child in sorted(records.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    configure(host)
    nvidia = runtimes_of(tomlread.loads((tmp_path / DROPIN.lstrip("/")).read_text()))["nvidia"]
    assert "monitor_path" not in nvidia


def test_existing_entry_with_a_monitor_of_the_other_type_is_repaired(tmp_path: Path) -> None:
    """A drop-in written by hand (or an older tool): runtime_type "oci" with conmon-rs, which CRI-O runs as
    conmon and refuses at start. gpunode sets the type that monitor needs, and reverting restores it."""
    install_layout(tmp_path, "pod-conmonrs")
    before = (
        "[crio.runtime.runtimes.nvidia]\n"
        'runtime_path = "/usr/bin/nvidia-container-runtime"\n'
        'runtime_type = "oci"\n'
        'monitor_path = "/usr/libexec/crio/conmonrs"\n'
    )
    path = put(tmp_path, DROPIN, before)
    assert any(
        "conmon-rs, which needs runtime_type" in p for p in crio.read_state(Host(root=tmp_path)).problems
    )
    host = Host(root=tmp_path, runner=ScriptedRunner())
    plan = configure(host)
    assert runtimes_of(tomlread.loads(path.read_text()))["nvidia"]["runtime_type"] == "pod"
    assert any('set to "pod"' in m for m in plan.messages)
    assert crio.config_problems(crio_merge(tmp_path)) == []
    apply(host, plan_revert(host, "crio", ConfigureOptions()), restart=False)
    assert path.read_text() == before


def test_a_result_crio_refuses_is_not_written(tmp_path: Path) -> None:
    """The default runtime's monitor_cgroup is no systemd slice: CRI-O refuses it for every "oci"
    runtime, the copy included. gpunode says so and writes nothing."""
    put(
        tmp_path,
        "/etc/crio/crio.conf.d/10-crio.conf",
        '[crio.runtime]\ndefault_runtime = "crun"\n\n[crio.runtime.runtimes.crun]\n'
        'runtime_path = "/usr/libexec/crio/crun"\nmonitor_path = "/usr/libexec/crio/conmon"\n'
        'monitor_cgroup = "conmon"\n',
    )
    with pytest.raises(ConfigError, match="monitor_cgroup must be 'pod' or a systemd slice"):
        plan_configure(Host(root=tmp_path, runner=ScriptedRunner()), "crio", ConfigureOptions())
    assert not (tmp_path / DROPIN.lstrip("/")).exists()


def test_nvidia_container_runtime_without_a_runtime_to_wrap_is_noted(tmp_path: Path) -> None:
    """CRI-O's packages keep crun and runc in /usr/libexec/crio: nvidia-container-runtime, which looks up
    runc or crun on $PATH, would find neither. The note names the fix; once its config.toml lists the
    binary, the note is gone."""
    install_layout(tmp_path, "pod-conmonrs")
    put(tmp_path, "/usr/libexec/crio/crun", "#!/bin/sh\n", mode=0o755)
    host = Host(root=tmp_path, runner=ScriptedRunner(), env={"PATH": "/usr/bin"})
    plan = plan_configure(host, "crio", ConfigureOptions())
    note = next(m for m in plan.messages if m.startswith("nvidia-container-runtime looks for"))
    assert "docker-runc, runc, crun on $PATH" in note
    assert 'set runtimes = ["/usr/libexec/crio/crun"] under [nvidia-container-runtime]' in note
    put(
        tmp_path,
        "/etc/nvidia-container-runtime/config.toml",
        '[nvidia-container-runtime]\nmode = "auto"\nruntimes = ["/usr/libexec/crio/crun"]\n',
    )
    plan = plan_configure(host, "crio", ConfigureOptions())
    assert not any(m.startswith("nvidia-container-runtime looks for") for m in plan.messages)


# -- CRI-O's rules ------------------------------------------------------------------------------------


def rules(entry: Mapping[str, Any], runtime: Mapping[str, Any] | None = None) -> list[crio.ConfigProblem]:
    doc = {"crio": {"runtime": {**(runtime or {}), "runtimes": {"gpu": entry}}}}
    return crio.config_problems(doc)


@pytest.mark.parametrize(
    ("entry", "runtime", "message", "fatal"),
    [
        ({"runtime_type": "wasm"}, {}, 'runtime_type "wasm" is not one of', False),
        ({"runtime_type": "oci", "monitor_path": "/usr/bin/crio-conmonrs"}, {}, "it is conmon-rs", True),
        ({"runtime_type": "pod", "monitor_path": "/usr/libexec/crio/conmon"}, {}, "but /usr/libexec", False),
        ({"monitor_path": "/usr/bin/conmon"}, {"conmon": "/usr/bin/conmonrs"}, "it is conmon-rs", True),
        ({"monitor_cgroup": "conmon"}, {}, "'pod' or a systemd slice", True),
        ({"monitor_cgroup": "system.slice"}, {"cgroup_manager": "cgroupfs"}, None, False),
        ({"monitor_cgroup": "crio.slice"}, {"cgroup_manager": "cgroupfs"}, "with cgroupfs", True),
        ({"monitor_exec_cgroup": "pod"}, {}, 'must be "" or "container"', False),
        ({"runtime_config_path": "/etc/kata.toml"}, {}, 'only be used with runtime_type "vm"', False),
        ({"runtime_type": "vm", "runtime_path": "/usr/bin/kata-runtime"}, {}, "containerd-shim", False),
        ({"runtime_type": "vm", "runtime_path": "/usr/bin/containerd-shim-kata-v2"}, {}, None, False),
        ({"runtime_type": "pod", "no_sync_log": True}, {}, "no_sync_log is only allowed", False),
        ({"runtime_type": "oci", "stream_websockets": True}, {}, 'needs runtime_type "pod"', False),
        ({"exec_cpu_affinity": "last"}, {}, 'exec_cpu_affinity must be "" or "first"', False),
        ({"runtime_path": 7}, {}, "runtime_path must be a string, not 7", True),
        ({"container_create_timeout": True}, {}, "container_create_timeout must be a integer", True),
        (
            {"allowed_annotations": "io.kubernetes.cri-o.Devices"},
            {},
            "allowed_annotations must be a list",
            True,
        ),
        ({"runtime_type": "pod", "monitor_path": "", "stream_websockets": True}, {}, None, False),
    ],
)
def test_crio_rules_for_one_runtime(
    entry: dict[str, Any], runtime: dict[str, Any], message: str | None, fatal: bool
) -> None:
    found = rules(entry, runtime)
    if message is None:
        assert found == []
        return
    assert len(found) == 1 and message in found[0].message and found[0].runtime == "gpu"
    assert found[0].fatal is fatal


def test_crio_rules_default_runtime_makes_a_handler_failure_fatal() -> None:
    """A handler that fails validation is dropped with a warning, unless it is the default."""
    doc = {"crio": {"runtime": {"default_runtime": "gpu", "runtimes": {"gpu": {"runtime_type": "wasm"}}}}}
    assert [p.fatal for p in crio.config_problems(doc)] == [True]
    doc = {"crio": {"runtime": {"default_runtime": "kata"}}}
    assert [p.message for p in crio.config_problems(doc)] == [
        'default_runtime "kata" has no [crio.runtime.runtimes.kata] table'
    ]
    assert crio.config_problems({"crio": {"runtime": {"default_runtime": "crun"}}}) == []  # built in


# -- CRI-O's own view ---------------------------------------------------------------------------------


def crio_config_output(name: str) -> str:
    return (FIXTURES / "crio-config" / f"{name}.conf").read_text()


def test_crio_config_output_with_everything_at_its_default() -> None:
    """No drop-in: `crio config` comments out default_runtime and the whole built-in runtime (and the
    template's own example entry, runtime-handler, which is no runtime)."""
    seen = crio.parse_effective(crio_config_output("builtin"), "`crio config`")
    assert seen.default == "crun"
    assert list(seen.runtimes) == ["crun"]
    assert seen.runtimes["crun"]["runtime_type"] == "oci"
    assert seen.runtimes["crun"]["monitor_cgroup"] == "system.slice"
    assert crio.config_problems(seen.doc) == []


def test_crio_config_output_with_gpunode_dropin() -> None:
    seen = crio.parse_effective(crio_config_output("pod-conmonrs-nvidia"), "`crio config`")
    assert seen.default == "nvidia" and list(seen.runtimes) == ["crun", "nvidia", "runc"]
    assert seen.describe("nvidia") == (
        "`crio config`: runtimes crun, nvidia, runc; default nvidia; nvidia runs "
        "/usr/bin/nvidia-container-runtime (runtime_type pod, monitor /usr/libexec/crio/conmonrs)"
    )


@dataclass
class FakeCrio(FakeRunner):
    """A runner answering `crio ... config` with the outputs given, in turn (the last one again after),
    keeping the files it was shown (the temp directory exists only during the call)."""

    outputs: list[str]
    returncode: int = 0
    stderr: str = ""
    shown: list[dict[str, str]] = field(default_factory=list)
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def answer(self, argv: tuple[str, ...]) -> CommandResult:
        if argv[-1] != "config" or "--config-dir" not in argv:
            raise CommandFailed(f"`{argv[0]}` is not installed (not found on PATH)")
        main = Path(argv[argv.index("--config") + 1])
        directory = Path(argv[argv.index("--config-dir") + 1])
        files = {"crio.conf": main.read_text()} if main.is_file() else {}
        for path in sorted(directory.rglob("*")) if directory.is_dir() else []:
            if path.is_file():
                files[str(path.relative_to(directory))] = path.read_text()
        self.shown.append(files)
        output = self.outputs[min(len(self.calls), len(self.outputs)) - 1]
        return CommandResult(argv, self.returncode, output, self.stderr)


def crio_node(root: Path, runner: Any) -> Host:
    install_layout(root, "pod-conmonrs")
    put(root, "/usr/bin/crio", "#!/bin/sh\n", mode=0o755)
    return Host(root=root, runner=runner, env={"PATH": "/usr/bin"})


def test_effective_decides_and_checks_the_planned_files_with_crio_config(tmp_path: Path) -> None:
    # The first call reads today's configuration, the second judges the planned files.
    fake = FakeCrio([crio_config_output("pod-conmonrs"), crio_config_output("pod-conmonrs-nvidia")])
    host = crio_node(tmp_path, fake)
    plan = configure(host, set_as_default=True, effective=True)
    today, planned_call = fake.calls
    assert today == (
        "/usr/bin/crio",
        "--config",
        str(tmp_path / "etc/crio/crio.conf"),
        "--config-dir",
        str(tmp_path / "etc/crio/crio.conf.d"),
        "config",
    )
    temp_dir = Path(planned_call[planned_call.index("--config-dir") + 1])
    assert tmp_path not in temp_dir.parents and not temp_dir.exists()  # a private copy, removed after
    planned = fake.shown[1]
    assert planned["crio.conf"] == ""  # no crio.conf: an empty one, CRI-O's defaults
    assert planned["10-crio.conf"] == (tmp_path / "etc/crio/crio.conf.d/10-crio.conf").read_text()
    assert planned["99-nvidia.toml"] == (tmp_path / DROPIN.lstrip("/")).read_text()
    nvidia = runtimes_of(tomlread.loads(planned["99-nvidia.toml"]))["nvidia"]
    assert nvidia["runtime_type"] == "pod" and nvidia["monitor_path"] == "/usr/libexec/crio/conmonrs"
    assert any(m.endswith("monitor /usr/libexec/crio/conmonrs): as intended") for m in plan.messages)


def test_effective_refuses_when_crio_sees_something_else(tmp_path: Path) -> None:
    """`crio config` on the planned files keeps crun as the default (a drop-in gpunode's own merge does not
    explain, e.g. in a subdirectory layout): nothing is written."""
    host = crio_node(
        tmp_path,
        FakeCrio([crio_config_output("pod-conmonrs"), crio_config_output("pod-conmonrs-nvidia-not-default")]),
    )
    with pytest.raises(ConfigError, match="keeps 'crun' as the default"):
        plan_configure(host, "crio", ConfigureOptions(set_as_default=True, effective=True))
    assert not (tmp_path / DROPIN.lstrip("/")).exists()


def test_effective_reports_crio_refusing_the_files(tmp_path: Path) -> None:
    fatal = (
        'level=fatal msg="validating runtime config: invalid `runtime_type` \\"wasm\\" for runtime '
        '\\"crun\\""'
    )
    host = crio_node(tmp_path, FakeCrio([""], returncode=1, stderr=fatal))
    with pytest.raises(
        ConfigError, match=r"refuses the configuration \(CRI-O would not start\): level=fatal"
    ):
        plan_configure(host, "crio", ConfigureOptions(effective=True))


def test_effective_needs_the_crio_program(tmp_path: Path) -> None:
    install_layout(tmp_path, "pod-conmonrs")
    with pytest.raises(NotFound, match="crio program is not installed") as caught:
        plan_configure(Host(root=tmp_path, runner=ScriptedRunner()), "crio", ConfigureOptions(effective=True))
    assert caught.value.fix is not None and "leave out --effective" in caught.value.fix


def test_effective_through_the_cli_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpunode.cli.main import main
    from gpunode.errors import ExitCode

    fake = FakeCrio([crio_config_output("pod-conmonrs"), crio_config_output("pod-conmonrs-nvidia")])
    host = crio_node(tmp_path, fake)
    code = main(["configure-runtime", "crio", "--set-as-default", "--effective", "--dry-run"], host=host)
    out = capsys.readouterr().out
    assert code == ExitCode.OK
    assert "+++ b/etc/crio/crio.conf.d/99-nvidia.toml" in out and '+runtime_type = "pod"' in out
    assert "note: `crio config` on the planned files: runtimes crun, nvidia, runc; default nvidia" in out
    assert not (tmp_path / DROPIN.lstrip("/")).exists() and len(fake.calls) == 2
    fake.calls.clear()
    (tmp_path / "usr/bin/crio").unlink()
    code = main(["configure-runtime", "crio", "--effective", "--dry-run"], host=host)
    assert code == ExitCode.NOT_FOUND and fake.calls == []
    assert "crio program is not installed" in capsys.readouterr().err


# -- doctor ---------------------------------------------------------------------------------------------


def status_config(name: str) -> str:
    return (FIXTURES / "crio-status-config" / f"{name}.toml").read_text()


def running_node(root: Path, answer: str) -> tuple[Host, ScriptedRunner]:
    install_layout(root, "pod-conmonrs")
    configure(Host(root=root, runner=ScriptedRunner()), set_as_default=True)
    put(root, "/usr/bin/crio", "#!/bin/sh\n", mode=0o755)
    sock = root / "var/run/crio/crio.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(sock, 0o140600)
    runner = ScriptedRunner()
    runner.answer(["/usr/bin/crio", "status", "--socket", str(sock), "config"], answer)
    return Host(root=root, runner=runner, env={"PATH": "/usr/bin"}), runner


def test_doctor_shows_what_the_running_crio_uses(tmp_path: Path) -> None:
    host, runner = running_node(tmp_path, status_config("pod-conmonrs-nvidia"))
    state = read_runtime_state(host, "crio")
    assert state.problems == ()
    assert state.nvidia_runtime == "nvidia" and state.nvidia_is_default
    assert (
        "`crio status config`: runtimes crun, nvidia, runc; default nvidia; nvidia runs "
        "/usr/bin/nvidia-container-runtime (runtime_type pod, monitor /usr/libexec/crio/conmonrs)"
    ) in state.notes
    assert runner.calls[0][:2] == ("/usr/bin/crio", "status")
    # crun and runc only in /usr/libexec/crio: nvidia-container-runtime would find neither.
    assert any('runtimes = ["/usr/libexec/crio/crun"]' in n for n in state.notes)


def test_doctor_fails_when_the_running_crio_lacks_the_runtime_its_files_define(tmp_path: Path) -> None:
    host, _ = running_node(tmp_path, status_config("pod-conmonrs"))
    state = read_runtime_state(host, "crio")
    assert state.nvidia_runtime is None and state.default_runtime == "crun"
    assert any("does not list it" in p and "journalctl -u crio" in p for p in state.problems)


def test_doctor_without_a_running_crio_asks_crio_config(tmp_path: Path) -> None:
    install_layout(tmp_path, "pod-conmonrs")
    put(tmp_path, "/usr/bin/crio", "#!/bin/sh\n", mode=0o755)
    runner = ScriptedRunner()
    runner.answer(["/usr/bin/crio", "--config"], "", returncode=1, stderr='level=fatal msg="invalid"\n')
    state = read_runtime_state(Host(root=tmp_path, runner=runner, env={"PATH": "/usr/bin"}), "crio")
    assert any("`crio config` refuses the configuration" in p for p in state.problems)


def test_doctor_without_the_crio_program_reads_the_files_alone(tmp_path: Path) -> None:
    install_layout(tmp_path, "pod-conmonrs")
    runner = ScriptedRunner()
    state = read_runtime_state(Host(root=tmp_path, runner=runner, env={"PATH": "/usr/bin"}), "crio")
    assert runner.calls == [] and state.runtimes == ("crun", "runc") and state.problems == ()
