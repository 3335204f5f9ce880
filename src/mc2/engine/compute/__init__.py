"""Computing: the experts a pass calls on each micro-batch's rows (SwiGLU, its GEMMs)."""
