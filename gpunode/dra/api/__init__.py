"""kubelet's DRA plugin protocols: the .proto files here and the stubs generated from them (do not edit them).

Regenerate with `scripts/generate_grpc_stubs.py`; tests/unit/test_dra_api.py checks the committed stubs and
the method paths and field numbers kubelet 1.36 uses (shared/specs/dra-kubelet-plugin.md).
"""
