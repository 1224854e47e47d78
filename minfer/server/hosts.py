"""``--allowed-hosts`` and ``--allowed-origins``: a request must name a Host this server answers to, and a
browser's ``Origin`` must be the server itself or an allowed origin; else a 400 in OpenAI's error shape.

The threat is DNS rebinding (Ollama's CVE-2024-28224). ``minfer serve`` binds 127.0.0.1 without a key, yet
a web page in the user's browser can reach it: the page's own name (``attacker.example``) is made to
resolve to 127.0.0.1, and its requests, same-origin as far as the browser knows, arrive with
``Host: attacker.example``. The Host is the one thing that tells them apart, so a name the server was not
told of is refused. The Origin check refuses what a page on another site sends straight to the server (a
form post, a ``no-cors`` fetch: the browser sends those and only hides the answer).

A pure ASGI middleware, added last so that it runs first: it reads the headers only, before the API key,
the body or routing. An HTTP/1.1 request without a Host, or with two, is a 400 too (RFC 9112, 3.2).
"""
from __future__ import annotations

import ipaddress
import json
import re
from typing import Any, Awaitable, Callable, Iterable, Sequence

from minfer.server.errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The loopback names and addresses (``.localhost``: RFC 6761's names under it, which browsers resolve to
# loopback themselves; no DNS answer can rebind them).
LOOPBACK_HOSTS = ("localhost", ".localhost", "127.0.0.1", "[::1]")
_REG_NAME = re.compile(r"[a-z0-9\-._~!$&'()*+,;=%]*")
_ORIGIN = re.compile(r"[a-z][a-z0-9+.\-]*://[^/?#\s]+")
_DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def default_allowed_hosts(bind_host: str) -> list[str]:
    """``--allowed-hosts``' default, beside the loopback names: none on a loopback host (its own address if it is
    another, 127.0.0.2 say); ``*`` on any other interface, where the names clients will use are not known."""
    if not is_loopback(bind_host):
        return ["*"]
    own = canonical_host(bind_host)
    return [own] if own is not None and own not in LOOPBACK_HOSTS else []


def canonical_host(host: str) -> str | None:
    """A Host's name part, as compared: lower case, no trailing dot, an IPv6 address bracketed in its short
    form; None when it is neither a name nor an address."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]") or ":" in host:  # IPv6 (a bare one only in patterns)
        try:
            return f"[{ipaddress.IPv6Address(host.strip('[]')).compressed}]"
        except ValueError:
            return None
    host = host[:-1] if host.endswith(".") else host
    return host if _REG_NAME.fullmatch(host) else None


def split_host_header(value: str) -> tuple[str, str] | None:
    """``Host: name[:port]`` or ``[v6][:port]`` → (canonical name, port as sent); None when malformed."""
    value = value.strip()
    if value.startswith("["):
        name, bracket, port = value.partition("]")
        name += bracket
        if not bracket or port and not port.startswith(":"):
            return None
        port = port[1:]
    else:
        name, _, port = value.partition(":")
    host = canonical_host(name)
    if host is None or not port.isdigit() and port != "":
        return None
    return host, port


def parse_flag_list(values: Iterable[str] | None) -> list[str] | None:
    """A list flag as typed: repeated, comma-separated, or one JSON list (vLLM's form, ``'["*"]'``; a value that
    is no JSON, such as ``[::1]``, is a plain one)."""
    if values is None:
        return None
    out: list[str] = []
    for value in values:
        try:
            items = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
        except ValueError:
            items = value.split(",")
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"{value!r} is not a list of names (a JSON list must hold strings)")
        out += [item.strip() for item in items if item.strip()]
    return out


class HostAllowList:
    """Patterns: ``*`` (any Host), ``.example.com`` or ``*.example.com`` (that name and every name under it), or
    a name or address (``myhost.lan``, ``10.0.0.5``, ``[::1]`` or ``::1``); case-insensitive, any port."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.any = False
        self.names: set[str] = set()
        self.suffixes: list[str] = []
        for pattern in patterns:
            text = pattern.strip().lower()
            if text == "*":
                self.any = True
                continue
            suffix = text.startswith((".", "*."))
            name = canonical_host(text.removeprefix("*").removeprefix(".") if suffix else text)
            if not name or "*" in name or suffix and name.startswith("["):
                why = (" (a host, no port: any port is allowed)" if ":" in text and not text.startswith("[")
                       else "")
                raise ValueError(f"--allowed-hosts: {pattern!r} is not a host name, an address, '*' or a "
                                 f"'.suffix'{why}")
            if suffix:
                self.suffixes.append(name)
            else:
                self.names.add(name)

    def allows(self, host: str) -> bool:
        """``host``: a canonical name (``split_host_header``)."""
        return self.any or host in self.names or \
            any(host == suffix or host.endswith("." + suffix) for suffix in self.suffixes)


def check_origins(origins: Sequence[str]) -> list[str]:
    """``--allowed-origins`` in the form browsers send (``http://localhost:3000``: lower case, no path), or
    ``*``."""
    out = []
    for origin in origins:
        text = origin.strip().lower().rstrip("/")
        if text != "*" and not _ORIGIN.fullmatch(text):
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port]) or '*'")
        out.append(text)
    return out


def _same_origin(origin: str, host_header: str) -> bool:
    """Whether a page at ``origin`` is this server (its authority is the request's Host), the scheme's default
    port aside: a browser's own pages send Origin on their POSTs."""
    scheme, sep, authority = origin.partition("://")
    if not sep:  # "null": a sandboxed frame, a file:// page
        return False
    default = _DEFAULT_PORTS.get(scheme, "")
    host_header = host_header.strip().lower()
    return (authority.removesuffix(default) if default else authority) == \
        (host_header.removesuffix(default) if default else host_header)


class HostOriginMiddleware:
    """ASGI middleware: a 400 in OpenAI's error shape for a Host that is neither a loopback name
    (``LOOPBACK_HOSTS``, always answered: no DNS answer can rebind them) nor in ``allowed_hosts``, for a missing
    (on HTTP/1.1), repeated or malformed Host, and for an ``Origin`` that is neither this server nor in
    ``allowed_origins`` (``*``: any)."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str] = (), allowed_origins: Sequence[str] = ()) -> None:
        self.app = app
        self.hosts = HostAllowList((*LOOPBACK_HOSTS, *allowed_hosts))
        origins = check_origins(allowed_origins)
        self.any_origin, self.origins = "*" in origins, frozenset(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        message, code = refusal
        body = json.dumps(error_body(400, message, None, code)).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def refusal(self, scope: Scope) -> tuple[str, str] | None:
        """(message, code) for a request to refuse, None for one to serve."""
        hosts, origins = [], []
        for name, value in scope.get("headers", ()):
            if name == b"host":
                hosts.append(value.decode("latin-1"))
            elif name == b"origin":
                origins.append(value.decode("latin-1"))
        if not hosts:
            if scope.get("http_version") == "1.0":  # Host is HTTP/1.1's (no browser sends a request without one)
                return None
            return "the request has no Host header (HTTP/1.1 requires one)", "missing_host"
        if len(hosts) > 1:
            return "the request has more than one Host header", "invalid_host"
        parsed = split_host_header(hosts[0])
        if parsed is None:
            return f"the Host header {hosts[0][:100]!r} is not a host name or address with an optional port", \
                "invalid_host"
        if not self.hosts.allows(parsed[0]):
            return (f"this server does not answer to the host {parsed[0][:100]!r} (the Host header); start it with "
                    f"--allowed-hosts naming it (a guard against DNS rebinding)"), "host_not_allowed"
        if len(origins) > 1:
            return "the request has more than one Origin header", "origin_not_allowed"
        if origins and not self.origin_allowed(origins[0], hosts[0]):
            return (f"requests from pages at {origins[0][:100]!r} (the Origin header) are not allowed; start the "
                    f"server with --allowed-origins naming it"), "origin_not_allowed"
        return None

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        origin = origin.strip().lower()
        return self.any_origin or origin in self.origins or _same_origin(origin, host_header)
