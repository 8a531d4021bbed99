"""Every pip extra the docs, messages and tests tell a user to install is one pyproject.toml defines.

pip only warns about an unknown extra (`vla-rt 0.1 does not provide the extra 'loadtest'`) and installs without it,
so a stale `pip install -e ".[loadtest]"` in the README fails later, at the import the extra was meant to bring.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `.[a,b]` (an editable install of this checkout) or `vla-rt[a]` (the distribution by name)
EXTRA = re.compile(r"""(?:["'\s]\.|vla-rt)\[([a-z0-9_,-]+)\]""")
# where a user is told what to install; docs/runs/ and benchmarks/results/ are records of past runs
SOURCES = ("README.md", "docs/*.md", "vla_rt/**/*.py", "tests/**/*.py", "tools/*")


def defined_extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def named_extras() -> dict[str, set[str]]:
    """extra -> the files that name it."""
    found: dict[str, set[str]] = {}
    for pattern in SOURCES:
        for path in ROOT.glob(pattern):
            if path.is_file() and path.name != Path(__file__).name:
                for match in EXTRA.finditer(path.read_text(errors="replace")):
                    for extra in match.group(1).split(","):
                        found.setdefault(extra, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_named_extra_is_defined():
    named, defined = named_extras(), defined_extras()
    assert {"loadtest", "test"} <= set(named), "the pattern no longer finds the README's install lines"
    missing = {extra: sorted(files) for extra, files in named.items() if extra not in defined}
    assert not missing, f"extras named but not in pyproject.toml {sorted(defined)}: {missing}"
