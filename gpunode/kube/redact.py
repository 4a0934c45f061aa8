"""Keeping secrets (tokens, keys) out of text that is shown: shared by the API client and the exec plugin
runner, which must not import each other (the runner is imported at credential resolution, the client
imports requests)."""

from __future__ import annotations

import re


def secret_forms(secret: str) -> set[str]:
    """The ways a secret may appear in a text: as it is, as repr() escapes it (a token with a line break,
    quoted in an exception), and its long pieces (each line of a token with line breaks)."""
    forms = {secret, secret.strip(), repr(secret)[1:-1]}
    forms.update(piece for piece in re.split(r"[\s\x00-\x1f\x7f]+", secret) if len(piece) >= 6)
    return {form for form in forms if form}


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every form of every secret replaced by <hidden> (the longest forms first)."""
    forms = sorted({form for secret in secrets for form in secret_forms(secret)}, key=len, reverse=True)
    for form in forms:
        text = text.replace(form, "<hidden>")
    return text
