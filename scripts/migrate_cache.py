"""Copy a Carnator cache between an SQLite folder and a PostgreSQL database (either way).

    .venv/bin/python scripts/migrate_cache.py ~/ComfyUI/user/carnator_cache postgresql://carnator@db/carnator
    .venv/bin/python scripts/migrate_cache.py postgresql://carnator@db/carnator /backup/carnator_cache

Every entry is verified before it is copied; damaged ones are reported and skipped.
Exit status 1 when any entry was skipped. See carnator_core/cache/migrate.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from carnator_core.cache.migrate import migrate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="cache folder or postgresql:// URL to copy from")
    ap.add_argument("destination", help="cache folder or postgresql:// URL to copy into")
    args = ap.parse_args()
    result = migrate(args.source, args.destination)
    print(f"{result.copied} entries copied, {len(result.skipped)} skipped")
    return 1 if result.skipped else 0


if __name__ == "__main__":
    raise SystemExit(main())
