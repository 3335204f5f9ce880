"""Adapters that switch MC2 on inside other libraries' models."""
