"""Tracing Python epilogue functions into the IR."""
