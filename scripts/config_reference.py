"""Rewrite the generated part of docs/config.md (the key tables) from swarmtrain/config/.

    python scripts/config_reference.py          # rewrite docs/config.md in place
    python scripts/config_reference.py --check  # exit 1 if docs/config.md is out of date

The same as ``python -m swarmtrain.config``. The part between the two markers in
docs/config.md is :func:`swarmtrain.config.render_config_doc`'s; the rest of the file is
written by hand and kept. tests/test_docs.py fails when the file is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from swarmtrain.config.docs import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], Path(__file__).resolve().parent.parent / "docs" / "config.md"))
