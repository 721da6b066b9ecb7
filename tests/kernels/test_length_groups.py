"""Decode groups: every sequence in exactly one group, padding bounded, order restored."""

import numpy as np

from orchard.kernels.reference import length_groups


def test_groups_partition_the_batch_and_bound_padding():
    rng = np.random.default_rng()
    lens = rng.integers(1, 4100, size=97).astype(np.int32)
    groups = length_groups(lens, max_padding=0.25)
    members = np.concatenate(groups)
    assert sorted(members.tolist()) == list(range(97))
    for g in groups:
        padded = lens[g].max() * len(g)
        assert padded <= 1.25 * lens[g].sum() or len(g) == 1


def test_equal_lengths_stay_one_group_and_a_far_outlier_gets_its_own():
    assert [g.tolist() for g in length_groups(np.array([64, 64, 64], dtype=np.int32))] == [[0, 1, 2]]
    groups = length_groups(np.array([10, 4000, 12, 11], dtype=np.int32))
    assert [g.tolist() for g in groups] == [[1], [2, 3, 0]]
