"""Structured events, log levels and per-pool reports: what workpool tells operators."""
