"""A quality claim needs every judge: `judges_verdict` and `rank_by_judges` on hand-made scores."""

from dmd2.report import judges_verdict, rank_by_judges

JUDGES = {"eval/fd": "FD", "eval/pixel_kid": "pixel KID"}


def test_a_win_is_claimed_only_when_every_judge_sees_it():
    base = ("teacher, 4 steps", {"eval/fd": 4.0, "eval/pixel_kid": 0.02})
    both = judges_verdict(("student", {"eval/fd": 3.0, "eval/pixel_kid": 0.01}), base, JUDGES)
    assert "closer by every judge" in both and "FD 3 < 4" in both
    split = judges_verdict(("student", {"eval/fd": 3.0, "eval/pixel_kid": 0.03}), base, JUDGES)
    assert "CONTRADICTED" in split and "pixel KID 0.03 >= 0.02" in split
    assert "not closer" in judges_verdict(("student", {"eval/fd": 5.0, "eval/pixel_kid": 0.03}), base, JUDGES)
    one = judges_verdict(("student", {"eval/fd": 3.0}), base, JUDGES)
    assert "the one judge" in one and "pixel KID" not in one  # a judge that did not measure is not counted
    assert "no judge" in judges_verdict(("student", {}), base, JUDGES)


def test_a_difference_within_two_standard_errors_supports_no_claim_either_way():
    base = ("teacher, 4 steps", {"eval/fd": 4.0, "eval/pixel_kid": 0.02, "eval/pixel_kid_se": 0.003})
    # 0.02 - 0.013 = 0.007 against 2 sqrt(0.003^2 + 0.002^2) = 0.0072: within the noise, though lower
    near = judges_verdict(("student", {"eval/fd": 3.0, "eval/pixel_kid": 0.013, "eval/pixel_kid_se": 0.002}), base,
                          JUDGES)
    assert "no claim: within 2 standard errors by pixel KID" in near and "0.013 ± 0.002 ~ 0.02 ± 0.003" in near
    far = judges_verdict(("student", {"eval/fd": 3.0, "eval/pixel_kid": 0.012, "eval/pixel_kid_se": 0.002}), base,
                         JUDGES)  # 0.008 > 0.0072
    assert "closer by every judge" in far and "0.012 ± 0.002 < 0.02 ± 0.003" in far
    worse = judges_verdict(("student", {"eval/fd": 3.0, "eval/pixel_kid": 0.03, "eval/pixel_kid_se": 0.001}), base,
                           JUDGES)
    assert "CONTRADICTED" in worse
    # an error in one row only is not an error of the difference: the plain comparison stands
    assert "closer by every judge" in judges_verdict(
        ("student", {"eval/fd": 3.0, "eval/pixel_kid": 0.019, "eval/pixel_kid_se": 0.01}), base[:1] + (
            {"eval/fd": 4.0, "eval/pixel_kid": 0.02},), JUDGES)


def test_variants_are_ranked_by_each_judge_and_disagreement_is_flagged():
    rows = [("a", {"eval/fd": 1.0, "eval/pixel_kid": 0.3}), ("b", {"eval/fd": 2.0, "eval/pixel_kid": 0.2}),
            ("c", {"eval/fd": 3.0, "eval/pixel_kid": 0.1})]
    lines = rank_by_judges(rows, JUDGES).splitlines()
    assert lines[0] == "| row | rank by FD | rank by pixel KID | judges |"
    assert "| a | 1 | 3 | disagree by 2 places |" in lines and "| b | 2 | 2 | agree |" in lines
