"""Seeing what a call did: timelines of spans, the article's metrics, traces and pictures.

``timeline`` records spans; ``profiler`` collects them around calls and writes Chrome traces;
``metrics`` turns spans into comm share, hidden fraction and speedup (the vocabulary of
``docs/profiling.md``); ``host_syncs`` counts the host synchronisations code would make on an
accelerator; ``plot`` draws timelines. (What runs work to observe, such as the article's
five-part breakdown, lives in :mod:`mc2.tools`.)
"""
