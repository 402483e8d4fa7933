"""Benchmarks: drive a metadata server of either dialect and measure its CPU cost per request.

``driver`` runs the engines' cycle from several client processes against a URL, ``sweep``
varies one parameter and charts it, ``core_bench`` measures the pool model in-process.
"""

__all__: list[str] = []  # the modules are imported by name
