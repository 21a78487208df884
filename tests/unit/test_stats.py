from specialists.stats.agent import robust_outliers


def test_single_large_value_is_flagged() -> None:
    flagged = robust_outliers([100, 102, 98, 101, 99, 1000], 3.5)
    assert [index for index, _ in flagged] == [5]


def test_no_spread_flags_nothing() -> None:
    assert robust_outliers([5, 5, 5, 5], 3.5) == []
