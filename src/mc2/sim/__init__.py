"""Predict comm share and throughput of MoE training for clusters we do not have.

``presets`` loads hardware and model descriptions (TOML, shipped or the user's own), ``model``
predicts one training step, ``report`` prints the article's table and the scale sweep.
"""
