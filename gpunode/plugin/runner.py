"""`gpunode plugin run` as a process: logging, signals, and the choice of a real or simulated node."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from gpunode.host import Host
from gpunode.nvml.model import Inventory
from gpunode.plugin.config import PluginConfig, load_config


def setup_logging(debug: bool, env: Mapping[str, str]) -> None:
    # Under systemd the journal stamps every line itself (JOURNAL_STREAM is set); elsewhere add the time.
    fmt = (
        "%(levelname)s %(message)s" if env.get("JOURNAL_STREAM") else "%(asctime)s %(levelname)s %(message)s"
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger("gpunode")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False


def config_loader(
    host: Host, config_path: str | None, flags: Mapping[str, Any]
) -> Callable[[], PluginConfig]:
    """Re-reads the file and the environment each call, so SIGHUP picks up edits."""

    def load() -> PluginConfig:
        return load_config(host, config_path=config_path, env=os.environ, flags=flags)

    return load


def inventory_source(host: Host, simulate: str | None) -> Callable[[PluginConfig], Inventory]:
    if simulate:
        from gpunode.plugin.simulate import PROFILES, simulated_inventory

        if simulate not in PROFILES:
            simulated_inventory(simulate)  # raises the UsageError that names the known profiles
        # `no-driver` and `init-fail` fail later, like NVML would, so fail-on-init-error applies to them.
        return lambda _config: simulated_inventory(simulate)

    def real(config: PluginConfig) -> Inventory:
        from gpunode.nvml import discover
        from gpunode.plugin.driver import preload_nvml

        preload_nvml(host, config.driver_root)
        return discover(host)

    return real


def run_plugin(
    host: Host,
    *,
    config_path: str | None,
    flags: Mapping[str, Any],
    simulate: str | None,
    debug: bool,
) -> None:
    """Serve until SIGTERM/SIGINT; SIGHUP reloads. Raises GpunodeError for what stops it at start."""
    from gpunode.plugin.lifecycle import Plugin

    setup_logging(debug, os.environ)
    log = logging.getLogger("gpunode.plugin")
    loader = config_loader(host, config_path, flags)
    plugin = Plugin(host, loader, inventory_source(host, simulate), simulated=bool(simulate))
    signal.signal(signal.SIGTERM, lambda *_: plugin.request_stop())
    signal.signal(signal.SIGINT, lambda *_: plugin.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: plugin.request_reload())
    log.info(
        "gpunode device plugin starting (%s; socket dir %s)",
        f"simulated node {simulate!r}" if simulate else "NVML",
        plugin.config.socket_dir,
    )
    plugin.run()
    log.info("stopped")
