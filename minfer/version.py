"""The package's version, in a leaf module so that any layer (the server's GET /version) may read it."""
__version__ = "0.1.0"
