"""gpunode's Kubernetes API client: finding credentials the way kubectl does, and talking to the API.

Importing this package is cheap: requests and PyYAML are imported only by the functions that need them, so
that `gpunode --help` and the commands that never talk to the API start fast.
"""

from __future__ import annotations

from gpunode.kube.credentials import Credentials, Pem, resolve_credentials
from gpunode.kube.jsonpointer import escape_json_pointer, json_pointer

__all__ = [
    "Credentials",
    "Pem",
    "escape_json_pointer",
    "json_pointer",
    "resolve_credentials",
]
