"""Execute while loading inside one instance (λScale §4): which waiting prompts run ahead of a
load, in which passes, and which of those passes the steps after the load finish first.

The worker's engine (libs/engine/engine.py, ``Engine.prefill_ahead``) and the fleet simulator
(libs/sim/fleet.py) both follow this, so the simulated instance batches as the real one does.

While the blocks arrive nothing decodes, so the step's token budget has nothing to protect and
prompts go whole, as many as ``AHEAD_TOKEN_LIMIT`` tokens (it bounds one pass's activations).
They are cut into passes of one length each (rows need no padding) and at most a step's budget
(a longer prompt is a pass of its own). While blocks land, the first admitted pass that is behind
runs first. Once every block is in, each step finishes the passes that fit its budget, first
admitted first and only those as far along as the first, so the first prompts' tokens come one
block's compute after the load, not the whole batch's.
"""

from collections.abc import Sequence

__all__ = ["AHEAD_TOKEN_LIMIT", "ahead_passes", "passes_to_finish"]

AHEAD_TOKEN_LIMIT = 16 * 1024  # prompt tokens run ahead of a load at most


def ahead_passes(pending: Sequence[int], room: int, budget: int, *, first_fits: bool) -> list[list[int]]:
    """The waiting rows (by their pending token counts, in admission order) that run ahead, as
    passes of row indices: rows are taken in order while their tokens fit `room` (the first one
    always when `first_fits`, i.e. nothing runs ahead yet); each pass holds rows of one length
    and at most `budget` tokens (at least one row); passes are in the order of their first row."""
    passes: list[list[int]] = []
    open_pass: dict[int, int] = {}  # length -> index in passes of the pass that still takes rows
    for i, n in enumerate(pending):
        if n > room and not (first_fits and i == 0):
            break
        room -= n
        k = open_pass.get(n)
        if k is None or (len(passes[k]) + 1) * n > budget:
            open_pass[n] = k = len(passes)
            passes.append([])
        passes[k].append(i)
    return passes


def passes_to_finish(tokens: Sequence[float], left: Sequence[float], budget: float) -> int:
    """How many of the passes run ahead (in order: their tokens, and the share of their layers
    each has `left`) the next step finishes: the first ones while they fit `budget` together, a
    pass counting its tokens times its share left, and only those as far along as the first (a
    pass further behind waits for the next step, so rows that have only their last block left
    are not held back by prefills still to do); at least one."""
    used = 0.0
    for k, (n, f) in enumerate(zip(tokens, left)):
        if k and (used + n * f > budget or f > left[0] + 1e-9):
            return k
        used += n * f
    return len(tokens)
