"""Prefix KV reuse and its lifecycle."""
