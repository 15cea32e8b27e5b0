"""The eval table every command prints: named rows of scores, one column per score key."""

import math


def _cell(scores: dict[str, float], key: str) -> str:
    if key not in scores:
        return "-"
    value = scores[key]
    return f"{value:.3f}" if "accuracy" in key else f"{value:.2f}" if abs(value) >= 1 else f"{value:.4g}"


def format_table(rows: list[tuple[str, dict[str, float]]], columns: dict[str, str]) -> str:
    """A Markdown table (it reads in a terminal and pastes into BENCHMARKS.md). `columns` maps score keys
    to headings; a column no row has (e.g. a CLIP score without a CLIP model) is left out, a missing
    value shows as -."""
    columns = {key: heading for key, heading in columns.items() if any(key in scores for _, scores in rows)}
    lines = ["| row | " + " | ".join(columns.values()) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(_cell(scores, key) for key in columns) + " |" for name, scores in rows]
    return "\n".join(lines)


# A judge whose score carries a standard error (`<key>_se`, e.g. a KID's) in both rows reads a difference within this
# many standard errors of it (the rows' errors added in quadrature) as no evidence either way.
TIE_STANDARD_ERRORS = 2


def within_noise(value: float, error: float, other: float, other_error: float) -> bool:
    """Whether two estimates differ by at most `TIE_STANDARD_ERRORS` of their difference's standard error."""
    return abs(value - other) <= TIE_STANDARD_ERRORS * math.hypot(error, other_error)


def _reading(scores: dict[str, float], base: dict[str, float], key: str, heading: str) -> tuple[int, str]:
    """(-1 closer, 1 farther, 0 within the noise; the reading as text) of one judge's score against the baseline's."""
    value, other, error = scores[key], base[key], f"{key}_se"
    if error in scores and error in base:
        sign = 0 if within_noise(value, scores[error], other, base[error]) else -1 if value < other else 1
        symbol = {-1: "<", 0: "~", 1: ">"}[sign]
        return sign, f"{heading} {value:.4g} ± {scores[error]:.2g} {symbol} {other:.4g} ± {base[error]:.2g}"
    return (-1 if value < other else 1), f"{heading} {value:.4g} {'<' if value < other else '>='} {other:.4g}"


def judges_verdict(row: tuple[str, dict[str, float]], baseline: tuple[str, dict[str, float]],
                   judges: dict[str, str]) -> str:
    """Whether ``row`` is closer to the reference than ``baseline`` by every judge in ``judges`` (score keys of
    distances, lower is closer -> headings), said as a claim only when the judges that measured both agree: a
    win that one judge sees and another contradicts is reported as contradicted, not as a win; a difference within
    `TIE_STANDARD_ERRORS` standard errors, where the scores carry them, supports no claim either way."""
    (name, scores), (base_name, base) = row, baseline
    measured = [key for key in judges if key in scores and key in base]
    if not measured:
        return f"{name} vs {base_name}: no judge measured both"
    signs, readings = zip(*(_reading(scores, base, key, judges[key]) for key in measured))
    if set(signs) == {-1}:
        verdict = "closer by every judge" if len(measured) > 1 else "closer by the one judge that measured both"
    elif set(signs) == {1}:
        verdict = "not closer, by any judge"
    elif {-1, 1} <= set(signs):
        verdict = "CONTRADICTED: the judges disagree, no claim"
    else:
        tied = ", ".join(judges[key] for key, sign in zip(measured, signs) if sign == 0)
        verdict = f"no claim: within {TIE_STANDARD_ERRORS} standard errors by {tied}"
    return f"{name} vs {base_name}: {verdict} ({'; '.join(readings)})"


def rank_by_judges(rows: list[tuple[str, dict[str, float]]], judges: dict[str, str]) -> str:
    """A Markdown table of each row's rank by each judge (1: closest), and whether the judges rank it alike: a
    recipe search ranks by all of them, so a variant tuned on one judge cannot win on that judge alone."""
    ranks = {key: {name: 1 + sorted(s[key] for _, s in rows).index(scores[key]) for name, scores in rows}
             for key in judges}
    lines = ["| row | " + " | ".join(f"rank by {heading}" for heading in judges.values()) + " | judges |",
             "|---|" + "---:|" * len(judges) + "---|"]
    for name, _ in sorted(rows, key=lambda row: sum(ranks[key][row[0]] for key in judges)):
        spread = max(ranks[key][name] for key in judges) - min(ranks[key][name] for key in judges)
        lines.append(f"| {name} | " + " | ".join(str(ranks[key][name]) for key in judges)
                     + f" | {'agree' if spread <= 1 else f'disagree by {spread} places'} |")
    return "\n".join(lines)
