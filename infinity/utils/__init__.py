"""Small helpers with no Infinity dependencies: durable file I/O and streaming safetensors."""
