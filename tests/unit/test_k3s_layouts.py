"""configure-runtime on k3s / RKE2: the layout each release reads, never a frozen copy of config.toml.

The generated configs are tests/fixtures/containerd/k3s/ (rendered k3s configs of each layout). The
template gpunode writes is rendered the way k3s's text/template does for the few actions it uses
(tests/gotemplate.py), with the generated config as the output of `{{ template "base" . }}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpunode.errors import ConfigError, NotFound
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes import containerd, k3s, records
from gpunode.runtimes.configure import apply, plan_configure, plan_revert
from gpunode.runtimes.plan import ConfigureOptions, RuntimePlan
from tests import tomlread
from tests.gotemplate import render_like_k3s

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "containerd" / "k3s"
NVIDIA = "/usr/bin/nvidia-container-runtime"
V2_CRI = ("plugins", "io.containerd.grpc.v1.cri")
V3_CRI = ("plugins", "io.containerd.cri.v1.runtime")
K3S_1_28 = "k3s version v1.28.5+k3s1 (5b2d1271)\ngo version go1.20.12\n"
K3S_1_27_OLD = "k3s version v1.27.4+k3s1 (36645e73)\ngo version go1.20.6\n"
K3S_1_32 = "k3s version v1.32.2+k3s1 (381620ef)\ngo version go1.23.6\n"
K3S_1_35 = "k3s version v1.35.3+k3s1 (0f6e2f1c)\ngo version go1.25.7\n"
RKE2_1_32 = "rke2 version v1.32.2+rke2r1 (2e8e4a6b)\ngo version go1.23.6 X:boringcrypto\n"
DROPIN = f"{containerd.K3S_DIR}/config-v3.toml.d/{k3s.DROPIN_NAME}"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def node(root: Path, generated: str, version: str | None, flavour: str = "k3s") -> tuple[Host, Path]:
    """A k3s (or RKE2) node that has rendered `generated`; `version` answers `k3s --version`."""
    config = containerd.K3S_CONFIG if flavour == "k3s" else containerd.RKE2_CONFIG
    target = root / config.lstrip("/")
    target.parent.mkdir(parents=True)
    target.write_text(generated)
    runner = ScriptedRunner()
    if version is not None:
        runner.answer([flavour, "--version"], version)
    return Host(root=root, runner=runner), target


def configure(host: Host, **options: Any) -> RuntimePlan:
    plan = plan_configure(host, "containerd", ConfigureOptions(**options))
    apply(host, plan, restart=False)
    return plan


def revert(host: Host) -> RuntimePlan:
    plan = plan_revert(host, "containerd", ConfigureOptions())
    apply(host, plan, restart=False)
    return plan


def files_under(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "var/lib/gpunode" not in str(p)
    }


def dig(doc: Any, *keys: str) -> Any:
    for key in keys:
        doc = doc[key]
    return doc


# -- versions ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "release"),
    [
        (K3S_1_28, (1, 28, 5)),
        (RKE2_1_32, (1, 32, 2)),
        ("k3s version v1.24.17+k3s1 (026bb0ec)\n", (1, 24, 17)),
        ("nonsense\n", None),
    ],
)
def test_release_is_read_from_the_version_line(output: str, release: tuple[int, int, int] | None) -> None:
    assert k3s.parse_release(output) == release


@pytest.mark.parametrize(
    ("release", "has_base"),
    [
        ((1, 23, 17), False),
        ((1, 24, 16), False),
        ((1, 24, 17), True),
        ((1, 25, 12), False),
        ((1, 25, 13), True),
        ((1, 26, 8), True),
        ((1, 27, 4), False),
        ((1, 27, 5), True),
        ((1, 28, 0), False),
        ((1, 28, 1), True),
        ((1, 29, 0), True),
        ((1, 35, 3), True),
    ],
)
def test_base_template_version_gate(release: tuple[int, int, int], has_base: bool) -> None:
    assert k3s.has_base_template(release) is has_base


def test_drop_in_directory_is_read_from_the_generated_import() -> None:
    doc = containerd.parse_toml(fixture("v3-k3s-v1.35-dropin.toml"), "config.toml")
    assert k3s.imported_dropin_dir(doc, containerd.K3S_DIR) == f"{containerd.K3S_DIR}/config-v3.toml.d"
    assert k3s.imported_dropin_dir({"imports": ["/etc/other/*.toml"]}, containerd.K3S_DIR) is None
    v2 = {"imports": [f"{containerd.K3S_DIR}/config.toml.d/*.toml"]}
    assert k3s.imported_dropin_dir(v2, containerd.K3S_DIR) == f"{containerd.K3S_DIR}/config.toml.d"


# -- base template (k3s without a drop-in directory) ---------------------------------------------------


def test_containerd_2_k3s_gets_a_v3_template_on_the_base_not_a_frozen_copy(tmp_path: Path) -> None:
    generated = fixture("v3-k3s-v1.32.toml")
    host, config = node(tmp_path, generated, K3S_1_32)
    plan = configure(host)
    template = tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")
    text = template.read_text()
    assert text.startswith(k3s.MARKER)
    assert '{{ template "base" . }}' in text
    # Nothing of k3s's own settings is copied: the pause image, CNI paths, snapshotter come from the base.
    assert "rancher/mirrored-pause" not in text and "cni" not in text and "snapshotter" not in text
    # config.toml.tmpl would make k3s render a version 2 config with the v2 base: never written here.
    assert not (tmp_path / containerd.K3S_TEMPLATE.lstrip("/")).exists()
    assert config.read_text() == generated  # k3s's own file is k3s's
    assert plan.flavour == "k3s" and plan.unit == "k3s.service"

    rendered = tomlread.loads(render_like_k3s(text, generated))
    nvidia = dig(rendered, *V3_CRI, "containerd", "runtimes", "nvidia")
    assert nvidia == {
        "runtime_type": "io.containerd.runc.v2",
        "options": {"BinaryName": NVIDIA, "SystemdCgroup": True},
    }
    assert dig(rendered, "plugins", "io.containerd.cri.v1.images", "pinned_images", "sandbox") == (
        "rancher/mirrored-pause:3.6"
    )
    assert dig(rendered, *V3_CRI, "containerd", "runtimes", "runc", "options", "SystemdCgroup") is True


def test_the_rendered_template_is_the_base_output_then_the_runtime(tmp_path: Path) -> None:
    generated = fixture("v2-k3s-v1.28.toml")
    host, _ = node(tmp_path, generated, K3S_1_28)
    configure(host)
    text = (tmp_path / containerd.K3S_TEMPLATE.lstrip("/")).read_text()
    rendered = render_like_k3s(text, generated)
    header_end = rendered.index(generated)
    # Header comments, then the base output byte for byte, then the runtime's tables (on a line of their
    # own even if the base output did not end with a newline).
    assert all(line.startswith("#") for line in rendered[:header_end].splitlines())
    tail = rendered[header_end + len(generated) :]
    assert tail == (
        "\n"
        '# the NVIDIA runtime, unless k3s added "nvidia" itself:\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        'runtime_type = "io.containerd.runc.v2"\n'
        "\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        "SystemdCgroup = true\n"
        f'BinaryName = "{NVIDIA}"\n'
        "# end of the NVIDIA runtime\n"
    )


def test_the_template_is_valid_toml_as_written(tmp_path: Path) -> None:
    # gpunode reads back every file it writes as TOML; every Go action sits in a comment.
    host, _ = node(tmp_path, fixture("v2-k3s-v1.28.toml"), K3S_1_28)
    configure(host)
    doc = tomlread.loads((tmp_path / containerd.K3S_TEMPLATE.lstrip("/")).read_text())
    assert dig(doc, *V2_CRI, "containerd", "runtimes", "nvidia", "options", "BinaryName") == NVIDIA


def test_when_k3s_finds_the_runtime_later_the_template_does_not_define_it_twice(tmp_path: Path) -> None:
    # gpunode wrote the template before nvidia-container-runtime was installed; at the next start k3s finds
    # the binary and its base output has its own "nvidia": the template must not repeat that table (TOML
    # refuses a table defined twice and containerd would not start).
    host, _ = node(tmp_path, fixture("v2-k3s-v1.28.toml"), K3S_1_28)
    configure(host)
    text = (tmp_path / containerd.K3S_TEMPLATE.lstrip("/")).read_text()
    later_base = fixture("v2-k3s-v1.28-nvidia.toml")
    rendered = tomlread.loads(render_like_k3s(text, later_base, frozenset({"nvidia", "nvidia-experimental"})))
    assert dig(rendered, *V2_CRI, "containerd", "runtimes", "nvidia", "options", "BinaryName") == NVIDIA
    with pytest.raises(tomlread.TOMLDecodeError, match="twice"):
        tomlread.loads(render_like_k3s(text, later_base))  # what an unguarded template would give


def test_template_is_reverted_byte_for_byte(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v3-k3s-v1.32.toml"), K3S_1_32)
    before = files_under(tmp_path)
    configure(host)
    assert files_under(tmp_path) != before
    revert(host)
    assert files_under(tmp_path) == before


def test_running_again_is_already_configured(tmp_path: Path) -> None:
    host, config = node(tmp_path, fixture("v3-k3s-v1.32.toml"), K3S_1_32)
    configure(host)
    template = tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")
    written = template.read_text()
    # k3s restarted and rendered the template: its config.toml now has the runtime (from gpunode's tables).
    config.write_text(render_like_k3s(written, fixture("v3-k3s-v1.32.toml")))
    plan = plan_configure(host, "containerd", ConfigureOptions())
    assert not plan.pending
    assert not any("itself" in m for m in plan.messages)  # the runtime there is gpunode's own
    assert template.read_text() == written


def test_rke2_gets_its_own_template(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v3-k3s-v1.32.toml"), RKE2_1_32, flavour="rke2")
    plan = configure(host)
    text = (tmp_path / containerd.RKE2_TEMPLATE_V3.lstrip("/")).read_text()
    assert text.startswith(k3s.MARKER) and "rke2" in text
    assert plan.flavour == "rke2"


def test_release_without_base_template_is_refused_untouched(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v2-k3s-v1.28.toml"), K3S_1_27_OLD)
    before = files_under(tmp_path)
    with pytest.raises(ConfigError, match="no base template") as raised:
        plan_configure(host, "containerd", ConfigureOptions())
    assert "v1.27.5" in (raised.value.fix or "")
    assert files_under(tmp_path) == before


def test_unknown_release_with_a_version_2_config_is_refused(tmp_path: Path) -> None:
    # A version 2 config alone does not say whether this k3s has the base template.
    host, _ = node(tmp_path, fixture("v2-k3s-v1.28.toml"), None)
    with pytest.raises(ConfigError, match="version unknown"):
        plan_configure(host, "containerd", ConfigureOptions())


def test_set_as_default_with_a_template_says_how_k3s_keeps_it(tmp_path: Path) -> None:
    # The base template writes the [..containerd] table that holds default_runtime_name: a template cannot
    # set it again. k3s's own --default-runtime (config.yaml default-runtime) is the way that lasts.
    host, _ = node(tmp_path, fixture("v3-k3s-v1.32.toml"), K3S_1_32)
    before = files_under(tmp_path)
    with pytest.raises(ConfigError) as raised:
        plan_configure(host, "containerd", ConfigureOptions(set_as_default=True))
    assert "default-runtime: nvidia" in (raised.value.fix or "")
    assert "/etc/rancher/k3s/config.yaml" in (raised.value.fix or "")
    assert files_under(tmp_path) == before


def test_cdi_with_a_v3_template_needs_nothing_and_with_v2_is_refused(tmp_path: Path) -> None:
    host, _ = node(tmp_path / "v3", fixture("v3-k3s-v1.32.toml"), K3S_1_32)
    plan = plan_configure(host, "containerd", ConfigureOptions(cdi=True))
    assert any("enables CDI by default" in m for m in plan.messages)
    host2, _ = node(tmp_path / "v2", fixture("v2-k3s-v1.28.toml"), K3S_1_28)
    with pytest.raises(ConfigError, match="CDI"):
        plan_configure(host2, "containerd", ConfigureOptions(cdi=True))


# -- k3s's own nvidia runtime -------------------------------------------------------------------------


def test_k3s_own_nvidia_runtime_is_left_alone(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v2-k3s-v1.28-nvidia.toml"), K3S_1_28)
    before = files_under(tmp_path)
    plan = configure(host)
    assert not plan.pending
    assert any('k3s already adds the "nvidia" runtime itself' in m for m in plan.messages)
    assert files_under(tmp_path) == before


def test_k3s_own_nvidia_runtime_for_another_binary_is_a_clash_with_a_template(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v2-k3s-v1.28-nvidia.toml"), K3S_1_28)
    with pytest.raises(ConfigError, match="already adds") as raised:
        plan_configure(host, "containerd", ConfigureOptions(runtime_path="/opt/nvidia/bin/nvidia-runtime"))
    assert "--runtime-path /usr/bin/nvidia-container-runtime" in (raised.value.fix or "")


# -- drop-in directory ---------------------------------------------------------------------------------


def test_dropin_release_gets_a_drop_in_and_no_template(tmp_path: Path) -> None:
    generated = fixture("v3-k3s-v1.35-dropin.toml")
    host, config = node(tmp_path, generated, K3S_1_35)
    before = files_under(tmp_path)
    plan = configure(host, set_as_default=True)
    dropin = tmp_path / DROPIN.lstrip("/")
    doc = tomlread.loads(dropin.read_text())
    assert doc["version"] == 3  # containerd 2.x skips a drop-in of a newer version than the main file
    assert dig(doc, *V3_CRI, "containerd", "runtimes", "nvidia") == {
        "runtime_type": "io.containerd.runc.v2",
        "options": {"SystemdCgroup": True, "BinaryName": NVIDIA},
    }
    assert dig(doc, *V3_CRI, "containerd", "default_runtime_name") == "nvidia"
    assert "pinned_images" not in dropin.read_text()  # only the runtime: containerd 2.1+ merges drop-ins
    for template in (containerd.K3S_TEMPLATE, containerd.K3S_TEMPLATE_V3):
        assert not (tmp_path / template.lstrip("/")).exists()
    assert config.read_text() == generated
    assert plan.expect == ("nvidia", True)
    revert(host)
    assert files_under(tmp_path) == before
    assert not dropin.parent.exists()  # the directory gpunode created goes too


def test_dropin_sets_only_the_default_when_k3s_has_the_runtime(tmp_path: Path) -> None:
    generated = fixture("v3-k3s-v1.35-dropin.toml") + (
        "\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.'nvidia']\n"
        '  runtime_type = "io.containerd.runc.v2"\n'
        "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.'nvidia'.options]\n"
        f'  BinaryName = "{NVIDIA}"\n'
        "  SystemdCgroup = true\n"
    )
    host, _ = node(tmp_path, generated, K3S_1_35)
    assert not plan_configure(host, "containerd", ConfigureOptions()).pending
    configure(host, set_as_default=True)
    doc = tomlread.loads((tmp_path / DROPIN.lstrip("/")).read_text())
    assert dig(doc, *V3_CRI, "containerd") == {"default_runtime_name": "nvidia"}


def test_dropin_with_a_user_go_template_leaves_the_template_alone(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v3-k3s-v1.35-dropin.toml"), K3S_1_35)
    user = tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")
    user.write_text("{{ template \"base\" . }}\n\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n")
    mine = user.read_bytes()
    plan = configure(host)
    assert user.read_bytes() == mine
    assert (tmp_path / DROPIN.lstrip("/")).is_file()
    assert any("yours" in m for m in plan.messages)


def test_embedded_containerd_before_2_1_uses_the_template(tmp_path: Path) -> None:
    # containerd 2.0 replaces a whole imported plugin table: a drop-in with only the runtime would lose
    # every CRI setting k3s wrote.
    host, _ = node(tmp_path, fixture("v3-k3s-v1.35-dropin.toml"), K3S_1_35)
    binary = tmp_path / k3s.EMBEDDED_CONTAINERD["k3s"].lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    assert isinstance(host.runner, ScriptedRunner)
    host.runner.answer(
        [k3s.EMBEDDED_CONTAINERD["k3s"], "--version"],
        "containerd github.com/k3s-io/containerd/v2 v2.0.4-k3s2 1a43cb6a\n",
    )
    plan = configure(host)
    assert (tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")).is_file()
    assert not (tmp_path / DROPIN.lstrip("/")).exists()
    assert any("replaces imported plugin tables" in m for m in plan.messages)


def test_not_generated_yet_is_not_found(tmp_path: Path) -> None:
    (tmp_path / containerd.K3S_DIR.lstrip("/")).mkdir(parents=True)
    host = Host(root=tmp_path, runner=ScriptedRunner())
    with pytest.raises(NotFound, match="has not generated"):
        plan_configure(host, "containerd", ConfigureOptions())


def test_a_file_of_the_users_at_gpunodes_drop_in_path_is_refused(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v3-k3s-v1.35-dropin.toml"), K3S_1_35)
    theirs = tmp_path / DROPIN.lstrip("/")
    theirs.parent.mkdir(parents=True)
    theirs.write_text("version = 3\n")
    with pytest.raises(ConfigError, match="not written by gpunode"):
        plan_configure(host, "containerd", ConfigureOptions())
    assert theirs.read_text() == "version = 3\n"


def test_frozen_copy_made_by_an_earlier_gpunode_is_refused_and_reverted(tmp_path: Path) -> None:
    # Earlier releases created config.toml.tmpl as a copy of config.toml (and recorded it as created):
    # editing it again would keep k3s's settings frozen; --revert takes it away, then the new layout applies.
    generated = fixture("v2-k3s-v1.28.toml")
    host, _ = node(tmp_path, generated, K3S_1_28)
    frozen = tmp_path / containerd.K3S_TEMPLATE.lstrip("/")
    frozen.write_text(generated)
    old = records.Records().updated("containerd", containerd.K3S_TEMPLATE, None, generated, (), owned=False)
    records.save(host, records.Records({containerd.K3S_TEMPLATE: old}, set()))
    with pytest.raises(ConfigError, match="earlier gpunode") as raised:
        plan_configure(host, "containerd", ConfigureOptions())
    assert "--revert" in (raised.value.fix or "")
    revert(host)
    assert not frozen.exists()
    configure(host)
    assert frozen.read_text().startswith(k3s.MARKER)


def test_template_code_in_the_runtime_path_is_refused(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v3-k3s-v1.32.toml"), K3S_1_32)
    with pytest.raises(ConfigError, match="template code"):
        plan_configure(host, "containerd", ConfigureOptions(runtime_path="/opt/{{.}}/x"))
    assert not (tmp_path / containerd.K3S_TEMPLATE_V3.lstrip("/")).exists()


def test_version_2_drop_in_directory_gets_a_version_2_drop_in(tmp_path: Path) -> None:
    # A user's config.toml.tmpl on the v2 base: k3s then generates version 2 and imports config.toml.d.
    generated = fixture("v2-k3s-v1.28.toml").replace(
        "version = 2\n", f'version = 2\nimports = ["{containerd.K3S_DIR}/config.toml.d/*.toml"]\n', 1
    )
    host, _ = node(tmp_path, generated, K3S_1_35)
    user = tmp_path / containerd.K3S_TEMPLATE.lstrip("/")
    user.write_text('{{ template "base" . }}\n')
    configure(host)
    dropin = tmp_path / containerd.K3S_DIR.lstrip("/") / "config.toml.d" / k3s.DROPIN_NAME
    doc = tomlread.loads(dropin.read_text())
    assert doc["version"] == 2
    assert dig(doc, *V2_CRI, "containerd", "runtimes", "nvidia", "options", "BinaryName") == NVIDIA
    assert user.read_text() == '{{ template "base" . }}\n'


def test_drop_in_is_added_to_by_a_later_run(tmp_path: Path) -> None:
    host, _ = node(tmp_path, fixture("v3-k3s-v1.35-dropin.toml"), K3S_1_35)
    before = files_under(tmp_path)
    configure(host, set_as_default=True)
    dropin = tmp_path / DROPIN.lstrip("/")
    first = dropin.read_text()
    assert not plan_configure(host, "containerd", ConfigureOptions()).pending  # the default stays
    configure(host, cdi=True)
    doc = tomlread.loads(dropin.read_text())
    assert dig(doc, *V3_CRI, "containerd", "default_runtime_name") == "nvidia"
    assert dig(doc, *V3_CRI, "enable_cdi") is True
    assert dropin.read_text().startswith(first.split("\n", 1)[0])
    revert(host)  # however many runs added to it, the node is as it was
    assert files_under(tmp_path) == before


def test_k3s_own_nvidia_runtime_without_systemd_cgroup_is_not_already_configured(tmp_path: Path) -> None:
    # An older k3s wrote its nvidia runtime without SystemdCgroup while runc has it: pods would be killed.
    generated = fixture("v2-k3s-v1.28-nvidia.toml")
    nvidia_options = '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes."nvidia".options]\n'
    nvidia_binary = '  BinaryName = "/usr/bin/nvidia-container-runtime"\n'
    without = generated.replace(
        nvidia_options + nvidia_binary + "  SystemdCgroup = true\n", nvidia_options + nvidia_binary
    )
    assert without != generated
    host, _ = node(tmp_path, without, K3S_1_28)
    before = files_under(tmp_path)
    with pytest.raises(ConfigError, match='adds the "nvidia" runtime itself without SystemdCgroup') as raised:
        plan_configure(host, "containerd", ConfigureOptions())
    fix = raised.value.fix or ""
    assert "upgrade k3s" in fix and "--runtime-name nvidia-systemd" in fix
    assert files_under(tmp_path) == before
    # The way out it names works: a runtime of another name, in gpunode's template, with SystemdCgroup.
    plan = configure(host, runtime_name="nvidia-systemd")
    assert [c.path for c in plan.pending] == [containerd.K3S_TEMPLATE]
    assert "SystemdCgroup = true" in (tmp_path / containerd.K3S_TEMPLATE.lstrip("/")).read_text()
