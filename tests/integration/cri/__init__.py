"""A real containerd for tests: a private daemon, a minimal CRI client and a locally built sandbox image.

Nothing here talks to a system containerd: every daemon gets its own socket, root and state directories.
"""
