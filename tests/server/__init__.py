"""HTTP server tests. A package, so that its conftest gets a module name of its own
(``server.conftest``) rather than competing for the bare name ``conftest``."""
