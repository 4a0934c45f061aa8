"""`gpunode cdi generate` and `cdi check` for 8 GPUs and for 8 GPUs with 7 MIG devices each.

Usage: python bench/cdi.py [--runs N]   (from the repo root, as root: device nodes are made with mknod)

The node is made under a temp root (tests/cdinode.py): /dev nodes, the driver's stand-in libraries in a
real-format ld.so.cache, firmware, the MIG capability entries under /proc; the GPUs are the fake NVML
library's (8 x A100, and the same with MIG on and seven 1g.10gb instances each). Whole-process wall time,
median and best of N after a warm-up run: the first write (spec removed before each run), the unchanged
regeneration (nothing written), `--dry-run`, and `cdi check` (which regenerates and compares).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.timing import measure  # noqa: E402 (needs the repo on sys.path)
from tests import cdinode, fakenvml  # noqa: E402

VERSION = "550.54.15"
SPEC = "var/run/cdi/gpunode-nvidia.com-gpu.yaml"


def mig_machine(path: Path, gpus: int = 8, per_gpu: int = 7) -> Path:
    lines = [f"[system]\ndriver_version = {VERSION}\n"]
    for index in range(gpus):
        lines.append(
            f"[gpu]\nname = NVIDIA A100-SXM4-80GB\nminor = {index}\nmig_capable = 1\nmig_mode = 1\n"
            f"max_mig_devices = {per_gpu}\n"
        )
        for slot in range(per_gpu):
            lines.append(
                f"[mig]\nname = NVIDIA A100-SXM4-80GB MIG 1g.10gb\nmemory_total = 9728 MiB\n"
                f"gpu_instance_id = {slot + 7}\ncompute_instance_id = 0\nslice_count = 1\nslot = {slot}\n"
            )
    path.write_text("".join(lines))
    return path


def make_node(root: Path, *, mig: bool) -> None:
    caps: list[int] = []
    if mig:
        for gpu in range(8):
            for slot in range(7):
                gi_minor, ci_minor = 1000 + gpu * 100 + slot * 2, 1001 + gpu * 100 + slot * 2
                cdinode.mig_proc(root, gpu, slot + 7, 0, minors=(gi_minor, ci_minor))
                caps += [gi_minor, ci_minor]
    cdinode.make_driver(root, VERSION, gpus=range(8), mig_caps=caps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    gpunode = str(Path(sys.executable).parent / "gpunode")
    rows: list[tuple[str, tuple[float, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, mig in (("8 GPUs", False), ("8 GPUs x 7 MIG", True)):
            root = Path(tmp) / ("mig" if mig else "gpus")
            make_node(root, mig=mig)
            if mig:
                env = {**os.environ, **fakenvml.env(config=mig_machine(Path(tmp) / "mig.ini"))}
            else:
                env = {**os.environ, **fakenvml.env(profile="dgx-a100")}
            base = [gpunode, "--root", str(root), "cdi"]
            spec = root / SPEC

            def remove(spec: Path = spec) -> None:
                spec.unlink(missing_ok=True)

            rows.append(
                (
                    f"{label}: generate, first write",
                    measure([*base, "generate"], args.runs, env=env, before_each=remove, must_succeed=True),
                )
            )
            devices = spec.read_text().count("\n- name: ")
            rows.append(
                (
                    f"{label}: generate, unchanged (no write; {devices} devices)",
                    measure([*base, "generate"], args.runs, env=env, must_succeed=True),
                )
            )
            rows.append(
                (
                    f"{label}: generate --dry-run",
                    measure([*base, "generate", "--dry-run"], args.runs, env=env, must_succeed=True),
                )
            )
            rows.append((f"{label}: check", measure([*base, "check"], args.runs, env=env, must_succeed=True)))
    rows.append(("`python -c pass` (interpreter floor)", measure([sys.executable, "-c", "pass"], args.runs)))
    print(f"Python {platform.python_version()}, {os.cpu_count()} CPUs, {args.runs} runs each\n")
    print("| `gpunode cdi` | median | best |")
    print("|---|---|---|")
    for name, (median, best) in rows:
        print(f"| {name} | {median * 1000:.0f} ms | {best * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
