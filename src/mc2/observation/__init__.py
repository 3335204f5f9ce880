"""Seeing what a call did: timelines of spans, the article's metrics, traces and pictures.

``timeline`` records spans; ``profiler`` collects them around calls and writes Chrome traces;
``metrics`` turns spans into comm share, hidden fraction and speedup (DESIGN.md section 6);
``breakdown`` splits a training step into the article's five parts; ``plot`` draws them.
"""
