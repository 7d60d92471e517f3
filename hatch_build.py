"""The long description on the package index: README.md with its relative links made absolute.

README.md links to docs/ and CONTRIBUTING.md relatively, which works on the repository's pages and
breaks on the index's project page. This build hook (hatchling loads ``hatch_build.py`` for
``[tool.hatch.metadata.hooks.custom]``) points each of them at the file in the repository at the
release's tag, ``v<version>``, so a project page shows the docs of the version it describes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hatchling.metadata.plugin.interface import MetadataHookInterface

README = "README.md"
# A markdown link or image target that is neither absolute (a scheme or "/") nor an anchor on the page.
RELATIVE_TARGET = re.compile(r"\]\((?![a-zA-Z][a-zA-Z0-9+.-]*:|#|/)([^)\s]+)\)")


def absolute_links(text: str, source_url: str, version: str) -> str:
    """``text`` with every relative link target ``path`` made ``<source_url>/blob/v<version>/path``."""
    base = f"{source_url.rstrip('/')}/blob/v{version}/"
    return RELATIVE_TARGET.sub(lambda match: f"]({base}{match.group(1)})", text)


class ReadmeHook(MetadataHookInterface):
    def update(self, metadata: dict[str, Any]) -> None:
        source = metadata.get("urls", {}).get("Source")
        if not source:
            raise ValueError("pyproject.toml's [project.urls] has no Source; the README's links need it")
        text = (Path(self.root) / README).read_text(encoding="utf-8")
        metadata["readme"] = {
            "content-type": "text/markdown",
            "text": absolute_links(text, source, metadata["version"]),
        }
