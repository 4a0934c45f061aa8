"""Every unit gpunode writes hands its program exactly the arguments gpunode meant, as a real systemd
(tests/integration/nspawn.py) reads the unit and runs it: values with `%` (specifiers), `$` (variables),
`\\`, quotes, spaces and a lone `;` included, and a program path with a space and a `%`.

The units are rendered with a stand-in program that writes the argv it was given to a file; systemd runs
it as it would run gpunode. `systemctl show -p ExecStart` is not enough: systemd keeps `$$` there and
expands variables only when it runs the command. The path unit's PathChanged= is read back with
`systemctl show -p Paths`. Needs root, systemd-nspawn and nsenter; in CI a missing one is a failure.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from gpunode.cdi.generate import GenerateOptions
from gpunode.cdi.install import PATH_UNIT, SERVICE, generate_argv, render_path_unit, render_service
from gpunode.systemd import service
from tests.integration import nspawn

ODD = "%n $HOME ${USER} a\\b \"dq\" 's' ; %% $$ end"
OPTIONS = GenerateOptions(
    driver_root=f"/drv {ODD}",
    dev_root="/dev root/%i/$X",
    output="/cdi/$X %i\\.yaml",
    hook_program='/hook/100%"quoted"\\',
)
UNIT_DIR = "/etc/systemd/system"


def stand_in(box: nspawn.Container, tag: str) -> str:
    """A program at an odd path that writes its argv to /run/argv-TAG.json (a directory every unit's
    hardening leaves writable)."""
    program = f"/opt/gpunode 100%/{tag}/gpunode"
    path = box.path(program)
    path.parent.mkdir(parents=True)
    path.write_text(
        "#!/usr/bin/python3\nimport json, sys\n"
        f"with open('/run/argv-{tag}.json', 'w') as f:\n    json.dump(sys.argv, f)\n"
    )
    path.chmod(0o755)
    return program


def argv_of(box: nspawn.Container, tag: str) -> list[str]:
    written = box.path(f"/run/argv-{tag}.json")
    assert written.exists(), box.journal(tag)
    loaded = json.loads(written.read_text())
    assert isinstance(loaded, list)
    return [str(a) for a in loaded]


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[nspawn.Container]:
    problems = nspawn.missing_prerequisites()
    if problems:
        if os.environ.get("CI"):
            pytest.fail("; ".join(problems) + ", and CI must run the real-systemd tests")
        pytest.skip("; ".join(problems))
    with nspawn.boot(tmp_path_factory.mktemp("escaping")) as container:
        container.path(UNIT_DIR).mkdir(parents=True, exist_ok=True)
        yield container


def test_the_cdi_units_run_generate_with_exactly_the_options_given(box: nspawn.Container) -> None:
    program = stand_in(box, "cdi")
    box.path(f"{UNIT_DIR}/{SERVICE}").write_text(render_service(program, OPTIONS))
    box.path(f"{UNIT_DIR}/{PATH_UNIT}").write_text(render_path_unit(OPTIONS))
    assert box.systemctl("daemon-reload").returncode == 0
    started = box.systemctl("start", SERVICE)  # a oneshot: returns once the program has run
    assert started.returncode == 0, started.stderr + box.journal(SERVICE)
    assert argv_of(box, "cdi") == [program, *generate_argv(program, OPTIONS)[1:]]
    assert "--driver-root" in argv_of(box, "cdi") and f"/drv {ODD}" in argv_of(box, "cdi")
    paths = box.unit_properties(PATH_UNIT, "Paths", "Triggers")
    assert paths["Paths"] == f"/drv {ODD}/etc/ld.so.cache (PathChanged)"
    assert paths["Triggers"] == SERVICE


def test_the_doctor_unit_writes_to_exactly_the_directory_given(box: nspawn.Container) -> None:
    program = stand_in(box, "doctor")
    directory = "/var/lib/node exporter/%H/$METRICS/a\\b"
    unit, _ = service.render_doctor_units(program, directory)
    box.path(f"{UNIT_DIR}/{service.DOCTOR_SERVICE}").write_text(unit)
    assert box.systemctl("daemon-reload").returncode == 0
    started = box.systemctl("start", service.DOCTOR_SERVICE)
    assert started.returncode == 0, started.stderr + box.journal(service.DOCTOR_SERVICE)
    assert argv_of(box, "doctor") == [program, "doctor", "--prometheus", f"{directory}/gpunode_doctor.prom"]


def test_the_plugin_unit_runs_the_program_at_its_odd_path(box: nspawn.Container) -> None:
    program = stand_in(box, "plugin")
    box.path(service.UNIT_PATH).write_text(service.render_unit(program))
    assert box.systemctl("daemon-reload").returncode == 0
    # Type=notify: the stand-in exits without READY=1, so the start fails once it has run.
    box.systemctl("start", service.UNIT)
    box.systemctl("stop", service.UNIT)
    assert argv_of(box, "plugin") == [program, "plugin", "run"]
