"""The plugin's log records skip the caller lookup (issue 24, speed): the format prints no file, line or
function, and walking the stack for them was ~10 % of an Allocate's own time. Checked in a process of its
own: the setting is the logging module's, for the whole process (the plugin's process)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import logging
from gpunode.plugin.runner import setup_logging

writer = setup_logging(False, {})
seen = []

class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record)

logging.getLogger("gpunode").handlers[:] = [Keep()]
logging.getLogger("gpunode.plugin").info("allocated %s", "GPU-1")
writer.stop()
(record,) = seen
print(record.funcName, record.lineno, record.getMessage(), sep="|")
"""


def test_plugin_log_records_skip_the_caller_lookup() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "(unknown function)|0|allocated GPU-1"
