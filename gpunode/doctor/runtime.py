"""Doctor checks of the container side: nvidia-container-toolkit and each container runtime's configuration
(containerd and CRI-O as the runtime itself reads it, where it can be asked)."""

from __future__ import annotations

from collections.abc import Iterable

from gpunode.doctor.context import RUNTIMES, Context, program_probe
from gpunode.doctor.model import Finding, Status
from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.kubelet import kubelet_runtime
from gpunode.runtimes.model import RuntimeConfigState


def check_toolkit(ctx: Context) -> Iterable[Finding]:
    found = {prog: program_probe(ctx.host, prog) for prog in ("nvidia-ctk", "nvidia-container-runtime")}
    missing = [prog for prog, (path, _, _) in found.items() if path is None]
    if missing:
        yield Finding(
            "toolkit",
            Status.FAIL,
            f"nvidia-container-toolkit is not installed ({', '.join(missing)} not found)",
            detail="Without nvidia-container-runtime no container runtime can give a container a GPU.",
            fix="gpunode toolkit install (NVIDIA's signed repository, its key checked; add --dry-run "
            "to see every file and command first)",
        )
        return
    versions = ", ".join(f"{prog} {ver or 'version unknown'}" for prog, (_, ver, _) in found.items())
    yield Finding(
        "toolkit",
        Status.OK,
        f"nvidia-container-toolkit installed: {versions}",
        detail=_probed(ctx.host, found),
    )


def _probed(host: Host, found: dict[str, tuple[str | None, str | None, str]]) -> str | None:
    """Under --root, where each version came from: R's package database, never a program run (neither this
    machine's nor R's own: gpunode.runtimes.probe)."""
    if host.is_real_root:
        return None
    return "under --root gpunode runs no program, this machine's or the image's: " + "; ".join(
        f"{where}" + ("" if version else " (version unknown)") for _, version, where in found.values()
    )


# -- container runtimes -------------------------------------------------------------------------


def read_runtime_state(host: Host, runtime: str) -> RuntimeConfigState:
    if runtime == "docker":
        from gpunode.runtimes import docker

        state = docker.read_state(host)
        return state if host.is_real_root else _docker_probed_in_root(host, state)
    if runtime == "containerd":
        from gpunode.runtimes import containerd

        # Where containerd can be asked (the real root, the program installed), its `config dump` decides:
        # imports, migration and keys it ignores are its to judge.
        return containerd.read_state(host, effective=True)
    from gpunode.runtimes import crio

    # Where the crio program is here, CRI-O's own view decides (`crio status config` of the running CRI-O,
    # else `crio config`): drop-in layouts, built-in defaults and handlers CRI-O ignored are its to judge.
    return crio.read_state(host, effective=True)


def _docker_probed_in_root(host: Host, state: RuntimeConfigState) -> RuntimeConfigState:
    """Under --root, say where dockerd's version came from, where it decides (a BOM, shim keys next to a
    path): R's package database (gpunode.runtimes.probe); no program runs, this machine's or R's. Without
    one that names it the version is unknown, and unknown counts as refused; with no dockerd in R docker
    is not installed there (runtime.docker is skipped), and configure-runtime judges as the newest dockerd
    it knows."""
    from dataclasses import replace

    from gpunode.runtimes import docker, probe

    text = host.read_text_if_exists(state.config_path) or ""
    runtimes = docker.configured_runtimes(
        docker.parse_daemon_json(text, state.config_path), state.config_path
    )
    if not (docker.split_bom(text)[0] or docker.path_and_shim(runtimes)):
        return state  # no version asked: nothing depends on it
    version = docker.installed_dockerd_version(host)
    where = probe.locate(host, "dockerd").where
    said = f"{version[0]}.{version[1]}" if version else "no version (unknown: judged as refusing)"
    note = f"dockerd's version under --root (no program run, this machine's or the image's): {where}: {said}"
    return replace(state, notes=(*state.notes, note))


def check_runtimes(ctx: Context) -> Iterable[Finding]:
    host = ctx.host
    try:
        kubelet_uses = kubelet_runtime(host)
    except GpunodeError:
        kubelet_uses = None  # kubelet's files unreadable: which runtime it uses is unknown
    if kubelet_uses is None and ctx.has_kubelet:
        kubelet_uses = "containerd"  # kubelet's built-in default endpoint since Kubernetes 1.27
    installed = [(name, unit) for name, binary, unit in RUNTIMES if host.which(binary)]
    if "containerd" not in [n for n, _ in installed] and ctx.embedded_containerd:
        installed.insert(0, ("containerd", "containerd.service"))
    if not installed:
        yield Finding(
            "runtime",
            Status.FAIL,
            "no container runtime is installed (containerd, docker or CRI-O)",
            fix="install containerd (`apt install containerd` / `dnf install containerd.io`), the runtime "
            "Kubernetes uses by default",
        )
        return
    if kubelet_uses and kubelet_uses not in [n for n, _ in installed]:
        yield Finding(
            f"runtime.{kubelet_uses}",
            Status.FAIL,
            f"kubelet is configured for {kubelet_uses}, which is not installed",
            detail="kubelet's --container-runtime-endpoint (or containerRuntimeEndpoint) names it.",
            fix=f"install {kubelet_uses}, or point kubelet's container runtime endpoint at the installed one",
        )
    for name, _binary, unit in RUNTIMES:
        if name == kubelet_uses and (name, unit) not in installed:
            continue
        if (name, unit) not in installed:
            # Under --root, looked for in the root only: this machine's programs do not read its files.
            where = "" if host.is_real_root else f" (no {_binary} in {host.root})"
            yield Finding(f"runtime.{name}", Status.SKIP, f"{name} is not installed{where}")
            continue
        essential = name == kubelet_uses or len(installed) == 1
        yield _runtime_finding(ctx, name, unit, essential, name == kubelet_uses)


def _runtime_finding(ctx: Context, name: str, unit: str, essential: bool, kubelets: bool) -> Finding:
    fid = f"runtime.{name}"
    # k3s, RKE2 and microk8s run their own containerd inside their own service.
    embedded = ctx.embedded_containerd if name == "containerd" else None
    state_word = None if embedded else ctx.service(unit)
    running = "" if state_word is None else f", service {state_word}"
    bad = Status.FAIL if essential else Status.WARN
    try:
        state = read_runtime_state(ctx.host, name)
    except GpunodeError as exc:
        return Finding(
            fid,
            bad,
            f"{name}: its configuration cannot be read",
            detail=exc.message,
            fix=exc.fix or "fix the file (the message says where), then run doctor again",
        )
    detail_lines = [
        f"config: {', '.join(state.files) or state.config_path}"
        + ("" if state.exists else " (absent: built-in defaults)")
    ]
    detail_lines.append(
        f"runtimes: {', '.join(state.runtimes) or '(none defined)'}; default: {state.default_runtime or '-'}"
    )
    detail_lines += list(state.notes)
    detail = "\n".join(detail_lines)
    configure = _configure_fix(name, embedded)
    restart = EMBEDDED_FIX[embedded][1] if embedded else f"`systemctl restart {unit}`"
    if state.problems:
        return Finding(
            fid,
            bad,
            f"{name}{running}: {state.problems[0]}",
            detail=detail,
            fix="correct the configuration as described" + (f", then {restart}" if state.exists else ""),
        )
    if state.nvidia_runtime is None:
        return Finding(
            fid,
            bad,
            f"{name}{running}: no nvidia runtime configured"
            + (" (kubelet uses this runtime)" if kubelets else ""),
            detail=detail,
            fix=configure,
        )
    if state_word is not None and state_word != "active":
        return Finding(
            fid,
            bad,
            f"{name}: nvidia runtime '{state.nvidia_runtime}' configured, but the service is {state_word}",
            detail=detail,
            fix=f"{restart} and read `journalctl -u {unit} -n 50`",
        )
    summary = f"{name}{running}: nvidia runtime '{state.nvidia_runtime}' configured"
    if state.nvidia_is_default:
        return Finding(fid, Status.OK, summary + " and is the default", detail=detail)
    return Finding(
        fid,
        Status.WARN,
        summary + f", but the default is '{state.default_runtime}'",
        detail=detail + "\nPods get a GPU only when they ask for the nvidia runtime class.",
        fix=f"make it the default ({_configure_fix(name, embedded, default=True)}), or give GPU pods "
        f"`runtimeClassName: {state.nvidia_runtime}`",
    )


EMBEDDED_FIX = {
    # (template, restart) for distributions that rewrite containerd's config.toml at every start.
    "k3s": ("config.toml.tmpl next to k3s's config.toml", "`systemctl restart k3s` (k3s-agent on agents)"),
    "rke2": (
        "config.toml.tmpl next to RKE2's config.toml",
        "`systemctl restart rke2-server` (or rke2-agent)",
    ),
    "microk8s": (
        "/var/snap/microk8s/current/args/containerd-template.toml",
        "`microk8s stop && microk8s start`",
    ),
}


def _configure_fix(name: str, embedded: str | None = None, *, default: bool = False) -> str:
    # gpunode edits k3s/RKE2/microk8s templates itself, and restarts and checks the runtime.
    runtime = "containerd" if embedded else name
    flag = " --set-as-default" if default else ""
    return f"`gpunode configure-runtime {runtime}{flag}` (`--dry-run` first shows the diff)"


# -- kubelet and the device plugin --------------------------------------------------------------
