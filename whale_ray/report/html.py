"""The report pages' common parts: one self-contained HTML file (images inlined as base64 data URIs, styles
inline, no script and no network), rendered by Jinja2 with autoescaping; diffs highlighted by Pygments."""

from __future__ import annotations

import base64
from functools import cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

TEMPLATES = Path(__file__).parent / "templates"


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def highlight_diff(patch: str) -> Markup:
    """A unified diff as HTML with inline colours (no stylesheet to fetch or to clash with the page's)."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import DiffLexer

    if not patch.strip():
        return Markup("<p class='muted'>(no change to the code)</p>")
    return Markup(highlight(patch, DiffLexer(), HtmlFormatter(noclasses=True, style="friendly")))


@cache
def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["data_uri"] = data_uri
    return env


def render(template: str, **context: Any) -> str:
    return _env().get_template(template).render(**context)
