"""The demo models shipped inside the package, each one record: its file, its
language, what it was trained on and the notice its users see. The CLI, the Python API and
the app read these records alike (as torchvision's weights enums carry their transforms and
meta), so no fact about a demo is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WEIGHTS_DIR = Path(__file__).parents[1] / "weights"
DEFAULT = "demo-soft"
# What the demos were trained on, and the start of the training-data name that training
# writes into a checkpoint made from the shapes data (``Captioner.training_data``).
SYNTHETIC_SHAPES = "synthetic shapes"
SHAPES = "coloured circles, squares, triangles, stars and crosses on a dark background"
SHAPES_ONLY = "trained on synthetic shapes only: it describes any picture, a photograph too, as coloured shapes"


@dataclass(frozen=True)
class BundledModel:
    name: str  # what the user types: --weights demo-soft
    file: str  # in WEIGHTS_DIR
    language: str  # of its captions: "en", "zh"
    training_data: str = SYNTHETIC_SHAPES
    description: str = SHAPES  # what the training pictures show, for the model card

    @property
    def path(self) -> Path:
        return WEIGHTS_DIR / self.file

    @property
    def installed(self) -> bool:
        return self.path.is_file()

    def notice(self) -> str:
        """One sentence for its users: it knows the shapes and nothing else."""
        return shapes_only_notice(f"{self.name} is a demo model")


def shapes_only_notice(subject: str) -> str:
    """The notice of a model that knows the synthetic shapes only, about ``subject`` ("X is")."""
    return f"{subject} {SHAPES_ONLY} (for photographs, train a model on photographs: see the README)"


DEMOS: dict[str, BundledModel] = {m.name: m for m in (
    BundledModel("demo-soft", "demo-soft.pt", language="en"),
    BundledModel("demo-hard", "demo-hard.pt", language="en"),
    BundledModel("demo-zh", "demo-zh.pt", language="zh"),
)}


def installed() -> list[BundledModel]:
    """The demos whose files this installation has, in DEMOS's order."""
    return [m for m in DEMOS.values() if m.installed]


def bundled_at(path: Path) -> BundledModel | None:
    """The demo whose file ``path`` is, or None."""
    where = path.resolve()
    return next((m for m in DEMOS.values() if m.path.resolve() == where), None)
