"""The repository's promises: the README's test command is what CI runs, and the layout is complete."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (REPO / ".ci/run").read_text().strip().splitlines()[-1]
    readme = (REPO / "README.md").read_text()
    assert ci in readme
    assert re.search(r"```(?:bash|sh)\n" + re.escape(ci) + r"\n```", readme), "not a command block of its own"


def test_layout() -> None:
    for path in (
        "gpunode",
        "templates",
        "tests",
        "pyproject.toml",
        "install.sh",
        "README.md",
        ".ci/run",
        "bench",
        "BENCHMARKS.md",
    ):
        assert (REPO / path).exists(), path


def test_every_exit_code_is_documented() -> None:
    from gpunode.errors import ExitCode

    readme = (REPO / "README.md").read_text()
    for code in ExitCode:
        assert re.search(rf"^\| {int(code)} \|", readme, re.MULTILINE), f"exit code {int(code)} not in README"


def test_templates_are_package_data() -> None:
    from importlib.resources import files

    assert files("gpunode.templates").joinpath("README.md").is_file()
    assert (REPO / "templates").resolve() == REPO / "gpunode/templates"


# The programs the test bed unpacks (tests/testbed.py). A test that ran the host's own (found on PATH or at
# /usr/bin/...) would pass here, where Debian's packages happen to be installed, and break, or quietly test
# another version, where they are not: the README promises that the test command installs none of them.
BED_PROGRAMS = {
    "containerd",
    "containerd-shim",
    "containerd-shim-runc-v1",
    "containerd-shim-runc-v2",
    "ctr",
    "runc",
    "dockerd",
    "docker",
    "docker-init",
    "docker-proxy",
    "tini",
    "tini-static",
}
HOST_PROGRAM = re.compile(r"^(/usr)?(/local)?/s?bin/(?P<name>[\w.-]+)$")
# Calls that locate or run a program: a daemon's name or host path as their argument is a direct use.
# `which` is shutil's (or gpunode's Host() on the real root), not a Host's on a temp root.
LOCATING = {"which", "access", "exists", "isfile", "is_file", "Path", "_find", "require_program"}
RUNNING = {"run", "Popen", "check_output", "check_call", "call"}


def _program(node: object) -> str | None:
    """The test bed program a string constant names, by name or by host path; None otherwise."""
    import ast

    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return None
    match = HOST_PROGRAM.match(node.value)
    name = match.group("name") if match else node.value
    return name if name in BED_PROGRAMS else None


def _on_the_host(func: object) -> bool:
    """Whether a `which` call looks on the host: shutil.which, a bare which, Host().which."""
    import ast

    if isinstance(func, ast.Name):
        return True
    if not isinstance(func, ast.Attribute):
        return False
    owner = func.value
    if isinstance(owner, ast.Name):
        return owner.id == "shutil"
    return (
        isinstance(owner, ast.Call)
        and getattr(owner.func, "id", "") == "Host"
        and not owner.args
        and all(k.arg != "root" for k in owner.keywords)
    )


def _direct_uses(source: str) -> list[tuple[int, str]]:
    import ast

    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in LOCATING and (called != "which" or _on_the_host(func)):
                for arg in node.args:
                    if program := _program(arg):
                        found.append((node.lineno, f"{called}({program!r})"))
            if called in RUNNING and node.args and isinstance(node.args[0], (ast.List, ast.Tuple)):
                argv = node.args[0].elts
                if argv and (program := _program(argv[0])):
                    found.append((node.lineno, f"{called}([{program!r}, ...])"))
        if isinstance(node, ast.arguments):
            for default in [*node.defaults, *node.kw_defaults]:
                if default is not None and (program := _program(default)):
                    found.append((default.lineno, f"a default argument of {program!r}"))
    return found


def test_tests_run_the_test_beds_daemons_never_the_hosts() -> None:
    """No test finds containerd, ctr, runc, dockerd or docker on the host (shutil.which, /usr/bin/...) or runs
    one by name: each comes from tests/testbed.py (testbed.binary, testbed.path_with). Scripted answers
    (`runner.answer(["containerd", "--version"], ...)`) and config data that mention a path are not uses."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name in ("testbed.py", "test_repo.py"):
            continue
        for line, what in _direct_uses(path.read_text()):
            found.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not found, "tests use the host's daemons instead of the test bed's:\n" + "\n".join(found)


def test_the_direct_use_check_sees_what_it_must() -> None:
    source = (
        "import shutil, subprocess, os\n"
        "shutil.which('containerd')\n"
        "subprocess.run(['ctr', 'plugins', 'ls'])\n"
        "box.run(['/usr/sbin/dockerd', '--version'])\n"
        "os.access('/usr/bin/runc', os.X_OK)\n"
        "def start(binary: str = 'dockerd'): ...\n"
        "Host().which('docker')\n"
        "runner.answer(['containerd', '--version'], 'containerd 1.6')\n"
        "subprocess.run([binary, 'config', 'dump'])\n"
        "data = {'path': '/usr/bin/runc'}\n"
        "Host(root=tmp_path).which('dockerd')\n"
    )
    assert [line for line, _ in _direct_uses(source)] == [2, 3, 4, 5, 6, 7]
