"""Engine benchmarks: ``python -m prefixgate.engine.bench.<name>`` scripts that measure the engine
(and its kernels) in-process, plus ``hf_server``, the transformers baseline server.

Each imports torch and the engine only when run; none imports ``prefixgate.gateway``.
"""
