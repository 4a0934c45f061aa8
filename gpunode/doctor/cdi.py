"""Doctor's `cdi` checks: gpunode's CDI spec (gpunode.cdi.check), when CDI is in use on this node.

CDI is in use when gpunode's spec exists or the device plugin's config asks for a CDI device-list
strategy; otherwise a missing spec is no fault, and only the NVIDIA_VISIBLE_DEVICES exposure (which
matters whatever the strategy) is reported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from gpunode.cdi.check import check_cdi as spec_checks
from gpunode.cdi.check import check_envvar_exposure
from gpunode.cdi.generate import GenerateOptions
from gpunode.doctor.context import simulated_tag
from gpunode.doctor.model import Finding, Status
from gpunode.errors import GpunodeError

if TYPE_CHECKING:
    from gpunode.doctor.context import Context


# gpunode.plugin.config.DEFAULT_CONFIG (a test keeps them equal): without the file, doctor does not import
# the plugin's config module and what it brings (~10-20 ms of every doctor, issue 24).
PLUGIN_CONFIG = "/etc/gpunode/plugin.toml"


def _plugin_cdi(ctx: Context) -> tuple[bool, GenerateOptions]:
    """Whether the plugin's config file asks for a CDI strategy, and the spec options it implies."""
    if not ctx.host.exists(PLUGIN_CONFIG):
        return False, GenerateOptions()
    from gpunode.plugin.config import DEFAULT_CONFIG, read_config_file

    try:
        found = read_config_file(ctx.host, DEFAULT_CONFIG, required=False)
    except GpunodeError:
        return False, GenerateOptions()
    strategies = found.get("device_list_strategy", (("envvar",), ""))[0]
    kind = found.get("cdi_kind", ("nvidia.com/gpu", ""))[0]
    driver_root = found.get("driver_root", ("/", ""))[0]
    uses = any(s.startswith("cdi-") for s in strategies)
    return uses, GenerateOptions(kind=kind, driver_root=driver_root)


def check_cdi(ctx: Context) -> Iterable[Finding]:
    uses_cdi, options = _plugin_cdi(ctx)
    if not uses_cdi and not ctx.host.exists(options.path):
        yield Finding(
            "cdi",
            Status.SKIP,
            "CDI is not in use (no gpunode CDI spec, and the plugin uses no cdi-* strategy)",
        )
        yield check_envvar_exposure(ctx.host)
        return
    if ctx.simulated:
        # This host's spec is made from its real GPUs: judged against simulated ones it would read as stale.
        yield Finding(
            "cdi",
            Status.SKIP,
            f"gpunode's CDI spec not compared with the GPUs: they are {simulated_tag(ctx.simulated)}",
            detail=f"`gpunode cdi generate --simulate {ctx.simulated} --dry-run` shows the spec such a node "
            "gets",
        )
        yield check_envvar_exposure(ctx.host)
        return
    yield from spec_checks(ctx.host, ctx.inventory, options)
