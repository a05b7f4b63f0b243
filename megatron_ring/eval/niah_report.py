"""What ``megatron-ring niah`` writes and prints: ``niah.json`` (every cell), the heatmap, the table, and
the cell-by-cell comparison of two results (``--compare-to``).

A cell scores 1 when its answer (the greedy tokens up to the first end-of-sequence token, decoded with
special tokens dropped) contains the needle's 6-digit value as a substring, else 0
(:func:`score`); the answer is kept beside it, so a reader can judge a 0 (a refusal, a wrong number).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

SCHEMA = "megatron_ring.eval.niah/1"
IDENTITY = ("answer", "generated_ids", "score")
"""What must agree for two results' cells to be identical (besides the prompt: same length, depth, ids)."""


def score(answer: str, value: str) -> int:
    """1 when ``answer`` contains the needle's ``value``, else 0."""
    return int(value in answer)


def model_name(summary: dict[str, Any]) -> str:
    """A short name of the model for titles: the GGUF file's stem, else the checkpoint's folder, else the
    model config's name."""
    if summary.get("gguf_file"):
        return Path(summary["gguf_file"]).stem
    if summary.get("checkpoint"):
        return Path(str(summary["checkpoint"]).removeprefix("package:")).name
    return str(summary.get("name", "model"))


def grid_of(result: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The lengths (columns) and depths (rows) of a result, in the order given on the command line."""
    return list(result["grid"]["lengths"]), list(result["grid"]["depths"])


def cell_at(result: dict[str, Any], length: int, depth: float) -> dict[str, Any]:
    """The cell of ``(length, depth)``."""
    for cell in result["cells"]:
        if cell["length"] == length and math.isclose(cell["depth"], depth):
            return cell
    raise KeyError(f"no cell of length {length} and depth {depth}")


def format_table(result: dict[str, Any]) -> str:
    """Rows = depth, columns = length: each cell's score and seconds; the mean score of each column."""
    lengths, depths = grid_of(result)
    width = 14
    lines = [f"needle in a haystack: {model_name(result['model'])}, {result['layout_text']} "
             f"({result['runner']} runner, {result['attention_kernel']}); score (seconds)",
             f"{'depth':>7} " + "".join(f"{length:>{width}}" for length in lengths)]
    for depth in depths:
        cells = [cell_at(result, length, depth) for length in lengths]
        row = "".join(f"{c['score']:>5} ({c['seconds']:>6.1f}s)".rjust(width) for c in cells)
        lines.append(f"{depth:>7.2f} {row}")
    means = [sum(cell_at(result, length, d)["score"] for d in depths) / len(depths) for length in lengths]
    lines.append(f"{'mean':>7} " + "".join(f"{m:>{width}.2f}" for m in means))
    lines.append(f"overall score {result['score']:.3f} over {len(result['cells'])} cells; "
                 f"{result['wall_s']:.1f} s wall")
    return "\n".join(lines)


def write_heatmap(result: dict[str, Any], path: Path) -> Path:
    """The classic NIAH heatmap as a PNG: rows = needle depth (0 at the top), columns = context length,
    colour = score (red 0, green 1), each cell annotated with its score and seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = grid_of(result)
    scores = [[cell_at(result, length, depth)["score"] for length in lengths] for depth in depths]
    fig, ax = plt.subplots(figsize=(max(6.4, 2.4 + 1.2 * len(lengths)), 1.9 + 0.55 * len(depths)))
    image = ax.imshow(scores, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for row, depth in enumerate(depths):
        for col, length in enumerate(lengths):
            cell = cell_at(result, length, depth)
            ax.text(col, row, f"{cell['score']}\n{cell['seconds']:.1f}s", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{depth:.0%}" for depth in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"needle in a haystack: {model_name(result['model'])} ({result['runner']} runner)\n"
                 f"{result['layout_text']}: score {result['score']:.2f}", fontsize=10)
    fig.colorbar(image, ax=ax, label="score")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def same_grid_problem(result: dict[str, Any], grid: dict[str, Any], field: str) -> str | None:
    """Why ``result`` (a niah.json) cannot be compared with a run of ``grid`` (lengths, depths, new_tokens,
    seed, texts, chat_template), naming ``field``; None when it can."""
    if result.get("schema") != SCHEMA:
        return f"{field}: not a result of megatron-ring niah (schema {result.get('schema')!r}, expected {SCHEMA!r})"
    theirs = result.get("grid", {})

    def same(key: str, value: Any) -> bool:  # texts by file name: the other run may have had another working dir
        if key == "texts" and isinstance(theirs.get(key), list):
            return [Path(t).name for t in theirs[key]] == [Path(t).name for t in value]
        return theirs.get(key) == value

    differ = [f"{key} {theirs.get(key)!r} vs {value!r}" for key, value in grid.items() if not same(key, value)]
    if differ:
        return f"{field}: another grid ({'; '.join(differ)}); run the same --lengths, --depths, --new-tokens, " \
               "--seed and texts to compare cell by cell"
    return None


def compare_cells(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Every difference between two results of the same grid, cell by cell (prompt ids, answer, generated ids,
    score); an empty list when they are identical."""
    lengths, depths = grid_of(ours)
    problems = []
    for length in lengths:
        for depth in depths:
            a, b = cell_at(ours, length, depth), cell_at(theirs, length, depth)
            if a["ids_digest"] != b["ids_digest"]:
                problems.append(f"length {length} depth {depth}: different prompts")
            for key in IDENTITY:
                if a[key] != b[key]:
                    problems.append(f"length {length} depth {depth}: {key} {a[key]!r} vs {b[key]!r}")
    return problems


def comparison_text(ours: dict[str, Any], theirs: dict[str, Any], other: str) -> tuple[bool, str]:
    """(identical, a line saying so or listing the differences) of :func:`compare_cells`."""
    problems = compare_cells(ours, theirs)
    cells = len(ours["cells"])
    if not problems:
        return True, (f"cell by cell identical to {other} ({theirs['layout_text']}): {cells} cells, same prompts, "
                      "answers, generated tokens and scores")
    return False, f"{len(problems)} difference(s) from {other} ({theirs['layout_text']}):\n  " + "\n  ".join(problems)


def mean_score(cells: Sequence[dict[str, Any]]) -> float:
    return sum(c["score"] for c in cells) / len(cells)
