"""The HTTP server: protocol, routing, and one module per wire dialect."""

__all__: list[str] = []  # the modules are imported by name
