"""Render gpunode's k3s template as k3s's Go text/template would, for exactly the actions gpunode writes.

No Go toolchain here: this executes a string literal, `template "base" .` (replaced by the base output
given) and `if not (index .ExtraRuntimes "X").BinaryName` ... `end` (X is in `found` when k3s found that
runtime itself), with Go's semantics for those. Any other action, or a trim marker, fails the test: a
template that grew another construct must be checked some other way.
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"\{\{(.*?)\}\}", re.S)


def render_like_k3s(template: str, base: str, found: frozenset[str] = frozenset()) -> str:
    """Execute the template as Go's text/template would, for exactly the actions gpunode writes: a string
    literal, `template "base" .` (the base output) and `if not (index .ExtraRuntimes "X").BinaryName` /
    `end` (X is in `found` when k3s found that runtime itself). Any other action fails the test."""
    out: list[str] = []
    skipping: list[bool] = []
    pos = 0
    for action in _ACTION.finditer(template):
        if not any(skipping):
            out.append(template[pos : action.start()])
        pos = action.end()
        body = action.group(1)
        assert not body.startswith("-") and not body.endswith("-"), body  # no trim markers
        body = body.strip()
        guard = re.fullmatch(r'if not \(index \.ExtraRuntimes "([^"]+)"\)\.BinaryName', body)
        if body == '"\\n"':
            out.append("" if any(skipping) else "\n")
        elif body == 'template "base" .':
            out.append("" if any(skipping) else base)
        elif guard:
            skipping.append(guard.group(1) in found)
        elif body == "end":
            skipping.pop()
        else:
            raise AssertionError(f"k3s-like rendering does not know {{{{ {body} }}}}")
    assert not skipping, "an {{ if }} without {{ end }}"
    out.append(template[pos:])
    return "".join(out)
