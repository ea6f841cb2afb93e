"""Regenerate the config reference in docs/reference.md from the dataclasses in lq/config.py.

    python scripts/update_reference.py          # rewrite docs/reference.md in place
    python scripts/update_reference.py --check  # exit 1 if it is out of date (the test suite does this)
"""

import sys
from pathlib import Path

from lq.config import reference_markdown

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def render(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference_markdown()}\n{END}{tail}"


def main() -> int:
    text = REFERENCE.read_text()
    new = render(text)
    if "--check" in sys.argv:
        if new != text:
            print("docs/reference.md config reference is out of date: run python scripts/update_reference.py")
            return 1
        return 0
    REFERENCE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
