"""New keys and tables take their neighbours' look: indentation, quoting, and a blank line before a new table
(issue 14). containerd 2.x writes 'literal' strings, 1.x "basic" ones; hand-written files rarely indent."""

from __future__ import annotations

from pathlib import Path

from gpunode.cli.main import main
from gpunode.errors import ExitCode
from gpunode.host import Host, ScriptedRunner
from gpunode.runtimes.edits import Editor, TomlFormat
from tests import tomlread

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "containerd"
RUNTIME = {"runtime_type": "io.containerd.runc.v2", "options": {"SystemdCgroup": True, "BinaryName": "/x"}}


def edited(text: str, cri: tuple[str, ...], *, default: bool = False) -> str:
    fmt = TomlFormat()
    doc = fmt.parse(text, "config.toml")
    editor = Editor(fmt, doc)
    editor.set((*cri, "containerd", "runtimes", "nvidia"), RUNTIME)
    if default:
        editor.set((*cri, "containerd", "default_runtime_name"), "nvidia")
    out = fmt.render(doc, text)
    tomlread.loads(out)  # always valid TOML
    return out


def block(text: str) -> list[str]:
    """The lines from the blank line before the nvidia table to the end of its options table."""
    lines = text.splitlines()
    start = next(n for n, line in enumerate(lines) if line.strip().endswith("runtimes.nvidia]"))
    end = next(n for n, line in enumerate(lines) if "BinaryName" in line and n > start)
    return lines[start - 1 : end + 1]


def test_containerd_2_files_get_literal_strings_and_its_indentation() -> None:
    text = (FIXTURES / "default-2.1.toml").read_text()
    out = edited(text, ("plugins", "io.containerd.cri.v1.runtime"), default=True)
    assert block(out) == [
        "",
        "        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia]",
        "          runtime_type = 'io.containerd.runc.v2'",
        "",
        "          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia.options]",
        "            SystemdCgroup = true",
        "            BinaryName = '/x'",
    ]
    assert "      default_runtime_name = 'nvidia'\n" in out


def test_containerd_1_files_keep_basic_strings() -> None:
    text = (FIXTURES / "default-v2.toml").read_text()
    out = edited(text, ("plugins", "io.containerd.grpc.v1.cri"), default=True)
    assert block(out) == [
        "",
        '        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]',
        '          runtime_type = "io.containerd.runc.v2"',
        "",
        '          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]',
        "            SystemdCgroup = true",
        '            BinaryName = "/x"',
    ]
    assert '      default_runtime_name = "nvidia"\n' in out


def test_a_compact_hand_written_file_gets_a_blank_line_before_each_new_table_and_no_header_indent() -> None:
    text = (
        "version = 2\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd]\n'
        '  default_runtime_name = "runc"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        '  runtime_type = "io.containerd.runc.v2"\n'
    )
    out = edited(text, ("plugins", "io.containerd.grpc.v1.cri"))
    assert block(out) == [
        "",
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]',
        '  runtime_type = "io.containerd.runc.v2"',
        "",
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]',
        "  SystemdCgroup = true",
        '  BinaryName = "/x"',
    ]
    assert out.startswith(text)  # nothing of the operator's moved


def test_a_quote_in_a_value_falls_back_to_a_basic_string() -> None:
    fmt = TomlFormat()
    text = "a = 'x'\nb = 'y'\n"
    doc = fmt.parse(text, "f.toml")
    Editor(fmt, doc).set(("c",), "it's")
    out = fmt.render(doc, text)
    assert tomlread.loads(out)["c"] == "it's" and 'c = "it\'s"' in out


def test_configure_runtime_on_containerd_2_default_writes_its_style(tmp_path: Path) -> None:
    path = tmp_path / "etc/containerd/config.toml"
    path.parent.mkdir(parents=True)
    path.write_text((FIXTURES / "default-2.1.toml").read_text())
    runner = ScriptedRunner()
    runner.answer(
        ["containerd", "--version"], "containerd github.com/containerd/containerd/v2 2.1.9+unknown\n"
    )
    args = ["configure-runtime", "containerd", "--set-as-default", "--no-restart"]
    assert main(args, host=Host(root=tmp_path, runner=runner)) == ExitCode.OK
    new_lines = [line for line in path.read_text().splitlines() if '"' in line]
    assert new_lines == [], f"double-quoted strings in a single-quoted file: {new_lines}"
