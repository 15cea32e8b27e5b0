"""The eval table every command prints: named rows of scores, one column per score key."""


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
