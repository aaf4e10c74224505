"""The Megatron-Core backend: pure config mapping (config.py), runtime wiring (runtime.py), CPU rehearsal (cpu_shim.py)."""
