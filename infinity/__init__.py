"""Infinity: train models far larger than accelerator memory, ZeRO-Infinity style."""

__version__ = "0.1.0"
