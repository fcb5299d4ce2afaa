"""Rewrite the generated part of docs/config.md (the key tables) from swarmtrain/config.py.

    python scripts/config_reference.py          # rewrite docs/config.md in place
    python scripts/config_reference.py --check  # exit 1 if docs/config.md is out of date

The part between the two markers in docs/config.md is :func:`swarmtrain.config.render_config_doc`'s;
the rest of the file is written by hand and kept. tests/test_docs.py fails when the file is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from swarmtrain.config import render_config_doc

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    fresh = render_config_doc(text)
    if "--check" in argv:
        if fresh != text:
            print(f"{DOC} is out of date: run `python scripts/config_reference.py`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
