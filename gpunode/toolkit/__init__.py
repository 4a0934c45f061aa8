"""nvidia-container-toolkit from NVIDIA's signed repositories: keys.py (the signing key), managers.py (one
engine per package manager), install.py (plan, apply, uninstall, status)."""
