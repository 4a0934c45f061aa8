#!/usr/bin/env python3
"""Generate gpunode/plugin/api's stubs only: scripts/generate_grpc_stubs.py for the device plugin's API.

Kept so existing commands and docs keep working (`--check` too); generate_grpc_stubs.py regenerates every API.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_grpc_stubs import main

if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], "gpunode/plugin/api"]))
