"""Gateway benchmarks: ``python -m prefixgate.gateway.bench.<name>`` scripts that measure the
gateway (overhead, routing, faults), each starting ``prefixgate serve`` as its own process.
"""
