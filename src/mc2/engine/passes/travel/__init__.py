"""How rows travel: the strategies the one pass body (:mod:`mc2.engine.passes.run`) is handed.

Each way is a pair of classes, one per pass, whose objects hold the pass's buffers and answer
the scheduler's per-micro-batch steps (:class:`~mc2.engine.passes.pipeline.PipelineSteps`):

* forward ``(x, experts, call, needs, result)``: ``gather(i)`` the rows to send, ``compute(i,
  received)`` the rows to send back (the experts run here, through the experts strategy's
  ``run``), ``scatter(i, returned)`` where they land, ``finish()`` what is left to fill in the
  :class:`~mc2.engine.passes.pass_output.PassOutput`;
* backward ``(grad_out, inputs, state, needs)``: the same four steps, ``deferred(i)`` (work
  that nothing sent depends on: weight gradients), ``grad_x`` (``[T, H]``, where the shared
  experts add theirs) and ``finish()`` → ``(grad_x, routed experts' gradients, combine weights'
  gradient)``.

The plan names the way (:attr:`mc2.engine.decide.call_plan.CallPlan.travel`, a
:class:`~mc2.engine.decide.call_plan.Travel`), chosen where the call is planned; :data:`TRAVELS`
is the one place that maps it to its classes.

How experts compute is the other strategy: :class:`~mc2.engine.compute.experts.ExpertWeights`
(mc2's SwiGLU) and :class:`~mc2.engine.compute.module_experts.ModuleExperts` (a framework's
experts module) answer the same ``run`` / ``backward`` / ``gradients`` / ``dense``.
"""

from __future__ import annotations

from typing import NamedTuple

from mc2.engine.decide.call_plan import Travel as Way
from mc2.engine.passes.travel.once import OnceBackward, OnceForward
from mc2.engine.passes.travel.pairs import PairsBackward, PairsForward
from mc2.engine.passes.travel.slabs import SlabsBackward, SlabsForward


class Travel(NamedTuple):
    """One way rows travel: its forward and its backward steps."""

    forward: type
    backward: type


TRAVELS: dict[Way, Travel] = {
    Way.PAIRS: Travel(PairsForward, PairsBackward),
    Way.ONCE: Travel(OnceForward, OnceBackward),
    Way.SLABS: Travel(SlabsForward, SlabsBackward),
}
