"""Experiments behind docs/uma-kv-design.md: one script per design question."""
