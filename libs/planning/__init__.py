"""Pure planning algorithms: every decision the planner and load-monitor make.

Modules (each cites the paper sections it implements):

- ``multicast`` — block schedules: binomial pipeline, k-way, star, binary tree,
  chain; execution pipelines; the schedule validator; the multicast-algorithm registry
  (``MULTICAST_ALGORITHMS``: the one vocabulary of algorithm names).
- ``chain`` — BlitzScale's topology-aware chain planner (Fig. 11).
- ``zigzag`` — live-pair scheduling: ILP (1), best-effort, simulation, Fig. 16 queue.
- ``estimate`` — ServerlessLLM load / migration time estimators and server choice.
- ``multicast_choice`` — picks among the registry's candidates (chain, binomial, k-way) for a scale-out.
- ``policies`` — scaling policies (threshold, concurrency, SLO saturation).
- ``autoscale`` — the load-monitor's whole decision: ``step(state, observation, now)``
  and the ``POLICIES`` registry chosen per deployment.
- ``scaleout`` — the planner's decisions: the ``MODES`` table,
  ``decide`` / ``plan_scale_out`` / ``plan_scale_in``.
- ``pool`` — the parameter pool (BlitzScale §5.3): which workers get which blocks back.
- ``placement`` — target and victim selection (locality first).
- ``instance`` — a worker's instance lifecycle: ``step(lifecycle, event) -> (lifecycle, effects)``
  (loading, serving while loading, serving, pipeline stage, draining, stopped, failed).
- ``block_sources`` — where a worker takes each block from: host tier, a transfer, disk.
- ``mesh`` — LLM-Mesh (many models on shared workers): profiles, headroom order, shadow
  validation, KV watermarks, the memory reservation station, defragmentation order.
- ``ratelimit`` — per-API-key requests and tokens per minute: ``admit`` / ``settle`` over a
  sliding 60 s window (the gateway's 429s and x-ratelimit-* headers).
- ``scaleop`` — a scale operation's lifecycle, the planner's ``step(op, event, now)``:
  parts, loads, pipelines formed and retired, the outcome, resuming after a restart, the
  pool-fill throttle, the periodic checks it declares (``Timers``).

No I/O, no global state; everything is deterministic.
"""
