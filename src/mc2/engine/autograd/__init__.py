"""Autograd and compile: thin adapters over one pass (:mod:`mc2.engine.passes.run`)."""
