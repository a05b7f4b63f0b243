"""One way to finish the project's line plots (matplotlib, imported when called)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def save_line_plot(fig: Any, ax: Any, title: str, path: str | Path, dpi: int = 120) -> None:
    """Finish a matplotlib line plot the project's way (small title, light grid, legend) and write it to ``path``."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
