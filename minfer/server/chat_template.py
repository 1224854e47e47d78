"""``--chat-template``: a Jinja file, or the template itself, used instead of the tokenizer's.

Read and compiled once at start, so a missing file or a syntax error stops ``minfer serve`` with one
line naming the flag, rather than turning every chat request into a 400.
"""
from __future__ import annotations

from pathlib import Path

import jinja2

_JINJA_CHARS = "{}\n"  # text holding none of these is a path, not a template (vLLM's rule)


def load_chat_template(value: str) -> str:
    """The template text of ``value``: the contents of the file it names, else ``value`` itself."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a long inline template is no valid path
        is_file = False
    if is_file:
        text = path.read_text(encoding="utf-8")
    elif any(c in value for c in _JINJA_CHARS):
        text = value
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    try:  # transformers renders with these extensions; the check only needs the syntax
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return text
