"""The HTTP server: protocol, routing, and one module per wire dialect."""
