"""One pass over a plan: the pipeline's order and the named state a forward leaves behind."""
