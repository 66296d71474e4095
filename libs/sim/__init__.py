"""`layercast simulate`: a discrete-event fleet simulator that runs layercast's own decisions.

Pure: no sockets, no NATS, no threads, no asyncio. Its own clock and event queue
(:mod:`libs.sim.clock`) drive the real, unchanged decision code of libs.planning — the
load-monitor's :func:`libs.planning.autoscale.step` and policies, the planner's
:func:`libs.planning.scaleout.decide`, the scale operation's and the instance's lifecycles
(:mod:`libs.planning.scaleop`, :mod:`libs.planning.instance`), the multicast plans as the
executors carry out their parts (:func:`libs.planning.multicast.node_parts`), pipelines
to form and retire — against modelled time (:mod:`libs.sim.timemodel`, parameterised by a
profile file, :mod:`libs.sim.profile`). :mod:`libs.sim.fleet` is the simulator,
:mod:`libs.sim.report` turns a run into the per-mode figures.

Imported by nothing but the CLI (services/cli) and its tests (an import-linter contract says so).
"""
