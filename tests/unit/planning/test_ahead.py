"""What runs ahead of a load and how the steps after finish it (libs.planning.ahead), the rules
the engine and the simulator share."""

from hypothesis import given, strategies as st

from libs.planning.ahead import ahead_passes, passes_to_finish

lengths = st.lists(st.integers(1, 600), max_size=40)


@given(lengths, st.integers(0, 5000), st.integers(1, 4096), st.booleans())
def test_rows_are_taken_in_order_while_they_fit_and_passed_by_length_within_the_budget(pending, room, budget,
                                                                                       first_fits):
    passes = ahead_passes(pending, room, budget, first_fits=first_fits)
    taken = sorted(i for p in passes for i in p)
    assert taken == list(range(len(taken)))  # a prefix of the waiting rows, each row once
    forced = first_fits and taken and pending[0] > room
    assert sum(pending[i] for i in taken) <= room or forced
    if len(taken) < len(pending):  # the next row would not have fit
        assert sum(pending[i] for i in taken) + pending[len(taken)] > room or (forced and not taken)
    for p in passes:
        assert p and len({pending[i] for i in p}) == 1  # one length: no padding
        assert len(p) == 1 or len(p) * pending[p[0]] <= budget
        assert p == sorted(p)
    assert [p[0] for p in passes] == sorted(p[0] for p in passes)  # first admitted first


def test_prompts_of_one_length_go_a_budget_at_a_time_and_a_longer_prompt_alone():
    assert ahead_passes([512] * 5 + [100, 3000], 10_000, 2048, first_fits=True) == [[0, 1, 2, 3], [4], [5], [6]]
    assert ahead_passes([5000, 10], 100, 2048, first_fits=True) == [[0]]  # the first always fits
    assert ahead_passes([5000, 10], 100, 2048, first_fits=False) == []


@given(st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([0.25, 0.5, 1.0])), min_size=1, max_size=20)
       .map(lambda ps: sorted(ps, key=lambda p: p[1])), st.floats(0, 4096))
def test_a_step_finishes_the_first_passes_that_fit_its_budget_as_far_along_as_the_first(passes, budget):
    tokens, left = [n for n, _ in passes], [f for _, f in passes]  # the first admitted are furthest along
    k = passes_to_finish(tokens, left, budget)
    assert 1 <= k <= len(tokens)
    cost = [n * f for n, f in passes]
    assert k == 1 or sum(cost[:k]) <= budget
    assert all(f == left[0] for f in left[:k])
    assert k == len(tokens) or sum(cost[:k + 1]) > budget or left[k] > left[0]


def test_rows_with_only_their_last_block_left_are_not_held_back_by_prefills_still_to_do():
    # two passes a sixteenth from done, then one not started: the first step takes the two
    assert passes_to_finish([512, 512, 512], [1 / 16, 1 / 16, 1.0], 2048) == 2
    assert passes_to_finish([512, 512, 512], [1.0, 1.0, 1.0], 2048) == 3
    assert passes_to_finish([4096, 10], [1.0, 1.0], 2048) == 1  # at least one
