"""Deciding: config, validation, routing, the planner and the plan of one call.

Everything here is settled before any row moves; nothing of a call issues a collective before
the handshake (:func:`.validation.agree`) has agreed on what follows.
"""
