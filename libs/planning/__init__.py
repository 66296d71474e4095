"""Pure planning algorithms: every decision the planner and load-monitor make.

Modules (each cites the paper sections it implements):

- ``multicast`` — block schedules: binomial pipeline, k-way, star, binary tree,
  chain; execution pipelines; the schedule validator.
- ``chain`` — BlitzScale's topology-aware chain planner (Fig. 11).
- ``zigzag`` — live-pair scheduling: ILP (1), best-effort, simulation, Fig. 16 queue.
- ``estimate`` — ServerlessLLM load / migration time estimators and server choice.
- ``multicast_choice`` — picks chain, binomial or k-way for a scale-out.
- ``policies`` — scaling policies (threshold, concurrency, SLO saturation).
- ``placement`` — target and victim selection used by the planner service.

No I/O, no global state; everything is deterministic.
"""
