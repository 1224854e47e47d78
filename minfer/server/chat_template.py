"""Chat templates: ``--chat-template`` (a Jinja file, or the template itself, used instead of the tokenizer's)
and ``RenderBudget``, the bound on one render.

``--chat-template`` is read and compiled once at start, so a missing file or a syntax error stops
``minfer serve`` with one line naming the flag, rather than turning every chat request into a 400.

A template is a program: Jinja's sandbox keeps it from reaching outside, but not from looping (two nested
``range(100000)`` loops are 10^10 iterations in 150 bytes). Jinja compiles templates to Python, so a trace
function on the rendering thread sees every line the template runs and can stop it there: past a deadline,
or when the client has gone. One C call that runs long (a huge string product) is not interrupted; the
body-size cap bounds the inputs, and a request's own template needs ``--trust-request-chat-template``.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, TypeVar

import jinja2

T = TypeVar("T")
TEMPLATE_FILENAME = "<template>"  # the file name of the code Jinja compiles from a string
RENDER_TIMEOUT_S = 5.0  # a real template renders the longest chat that fits a context in milliseconds
_JINJA_CHARS = "{}\n"  # text holding none of these is a path, not a template (vLLM's rule)


class RenderStopped(BaseException):
    """Raised inside a render that ran past its time or whose client left. A BaseException, so that no
    ``except Exception`` on the way (in Jinja, transformers or a filter) swallows it and lets the loop go on
    untraced (Python unsets a trace function that raised)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # "timeout" or "cancelled"


class RenderBudget:
    """The time one render may take, and a flag another thread sets to stop it (``cancel``).

    ``run`` calls a function under a trace function installed on the calling thread only: every Python call
    checks the deadline and the flag, and so does every line of the template's own compiled code (loops,
    macros), where a runaway template spends its time. Other frames are not line-traced, which keeps the
    cost of a real template's render small.

    A render also shares the interpreter: Python runs one thread at a time, and a thread that never waits
    takes its turn every few milliseconds against the event loop, the engine thread and the tokenizers, so
    two looping templates would slow every other request several-fold until their deadline. After each
    ``SLICE_S`` of running, a traced render sleeps (releasing the interpreter) for that long times the
    renders under way: together they hold it at most half of the time, whatever their number."""

    SLICE_S = 0.005
    _active = 0  # traced renders under way, in every thread
    _active_lock = threading.Lock()

    def __init__(self, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.cancelled = False

    def cancel(self) -> None:
        """Stop the render at its next traced line (safe from any thread: a flag the tracer reads)."""
        self.cancelled = True

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        deadline = time.monotonic() + self.timeout_s
        clock = time.monotonic

        def stopped() -> RenderStopped:
            return RenderStopped("cancelled" if self.cancelled else "timeout")

        slice_end = [clock() + self.SLICE_S]

        def line(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                now = clock()
                if self.cancelled or now > deadline:
                    raise stopped()
                if now > slice_end[0]:  # a slice used: give the interpreter back for a while
                    time.sleep(self.SLICE_S * RenderBudget._active)
                    slice_end[0] = clock() + self.SLICE_S
            return line

        def call(frame: FrameType, event: str, arg: Any) -> Any:
            if self.cancelled or clock() > deadline:
                raise stopped()
            return line if frame.f_code.co_filename == TEMPLATE_FILENAME else None

        if self.cancelled:
            raise stopped()
        previous = sys.gettrace()  # a coverage tool's or a debugger's, put back after
        with RenderBudget._active_lock:
            RenderBudget._active += 1
        sys.settrace(call)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.settrace(previous)
            with RenderBudget._active_lock:
                RenderBudget._active -= 1


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
