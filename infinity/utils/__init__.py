"""Small helpers that import nothing else of Infinity: durable file I/O (`fsio`), streaming
safetensors, giving freed host memory back (`host_memory`), the step profiler, the step
timer and the per-step telemetry record."""
